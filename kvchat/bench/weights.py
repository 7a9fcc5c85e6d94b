"""``python -m kvchat.bench.weights``: one shape's weights as stored, side by side.

For each demo shape and variant (float32, ``bf16``, ``q8``, ``q4`` by default) a fresh
process loads ``demo:<shape>@<variant>`` and measures: the load's seconds, the
resident memory after it, a prefill of ``--prefill`` tokens from empty (twice), and
decoding with one conversation (the best of those two replies and of two alone) and
with ``--sessions`` at once (sessions in that process through the generation core,
:func:`kvchat.bench.concurrency.crowd`; best of two rounds). The variants take turns,
``--rounds`` times over, and each figure is the best of its rounds, so that a shared
machine's noise falls on all alike. This process measures the memory bandwidth before and after (a STREAM-like
read: numpy's sum over a 512 MiB float32 array, on one thread and on one per core,
best of 3) and divides it by the bytes of the weights one decoding token reads (each
weight once as loaded: the tied embedding once as the output head, and of a
mixture of experts only the chosen experts' share): that is the decode limit each
one-conversation figure is a fraction of. Each variant is also compared with the
first variant of its shape (float32 by default) and with the first shape's row of
the same variant (``--shape qwen3-0.35b,qwen3-moe-2b --variants q4``: a mixture of
experts against a dense model with as many active weights). Variants are built
before anything is timed. Only ratios measured in one run mean much on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import blas

from .common import Log, machine, make_text, rounded_ratio, run_turn, temp_home

if TYPE_CHECKING:
    import mlx.nn as nn

VARIANTS = ("float32", "bf16", "q8", "q4")
STREAM_BYTES = 512 << 20


def spec(shape: str, variant: str) -> str:
    """The ``--model`` value of ``shape`` as ``variant`` (``float32`` is the plain shape)."""
    from kvchat.engine.models.demo import PREFIX

    base = PREFIX if shape == PREFIX else f"{PREFIX}:{shape}"
    return base if variant == "float32" else f"{base}@{variant}"


def bandwidth(repeats: int = 3) -> dict[str, Any]:
    """Bytes a second this machine reads: numpy's sum over a 512 MiB float32 array, best
    of ``repeats``, on one thread and split over one thread per core."""
    import numpy as np

    data = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    threads = os.cpu_count() or 1
    parts = np.array_split(data, threads)

    def split_sum() -> None:
        workers = [threading.Thread(target=part.sum) for part in parts]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def best(read: Any) -> float:
        seconds = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            read()
            seconds = min(seconds, time.perf_counter() - started)
        return data.nbytes / seconds

    one, many = best(data.sum), best(split_sum)
    return {
        "array_bytes": data.nbytes,
        "one_thread_gb_s": round(one / 1e9, 2),
        "threads": threads,
        "threads_gb_s": round(many / 1e9, 2),
        "gb_s": round(max(one, many) / 1e9, 2),
    }


def read_per_token(model: nn.Module) -> int:
    """Bytes of the weights one decoding token reads, as loaded: every parameter once,
    but an untied embedding only for its one row (its output head is read whole) and a
    mixture of experts' stacked experts only for the share its tokens choose."""
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    experts = getattr(args, "num_experts", 0) or 0
    share = getattr(args, "num_experts_per_tok", 0) / experts if experts else 1.0
    params = dict(tree_flatten(model.parameters()))
    untied = any(k.startswith("lm_head.") for k in params)
    total = 0.0
    for key, value in params.items():
        if untied and ".embed_tokens." in f".{key}":
            continue
        total += value.nbytes * (share if ".switch_mlp." in key else 1.0)
    return int(total)


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure(model: str, prefill: int, decode: int, sessions: int) -> dict[str, Any]:
    """One variant, in this process: load, memory, prefill, decode at 1 and ``sessions``."""
    from kvchat.engine.conversation.session import GenerationSettings, Session
    from kvchat.engine.models.model import load_model

    from .concurrency import crowd

    started = time.perf_counter()
    lm = load_model(model)
    load_s = time.perf_counter() - started
    rss = resident_bytes()
    settings = GenerationSettings(max_tokens=decode, ignore_eos=True)
    turns = [
        run_turn(Session(lm, settings=settings), make_text(lm.tokenizer, prefill, seed=11 + i))
        for i in range(2)
    ]
    many = crowd(lm, sessions, first_tokens=64, max_tokens=decode, rounds=2)
    return {
        "model": model,
        "weights": lm.weights,
        "load_s": round(load_s, 2),
        "resident_bytes": rss,
        "read_per_token_bytes": read_per_token(lm.model),
        "prefill_tokens": turns[0]["evaluated_tokens"],
        "prefill_tps": round(max(t["evaluated_tokens"] / t["prompt_eval_s"] for t in turns), 1),
        "first_turn_s": round(min(t["ttft_s"] for t in turns), 3),
        "decode_after_prefill_tps": round(max(t["gen_tps"] for t in turns), 2),
        "decode_1_tps": round(
            max([t["gen_tps"] for t in turns] + [many["alone"]["decode_tps"]]), 2
        ),
        f"decode_{sessions}_tps": many["together"]["decode_tps"],
    }


def _child(model: str, prefill: int, decode: int, sessions: int) -> dict[str, Any]:
    """:func:`measure` in a fresh process (its memory is that variant's alone)."""
    argv = [sys.executable, "-m", "kvchat.bench.weights", "--measure", model]
    argv += ["--prefill", str(prefill), "--decode", str(decode), "--sessions", str(sessions)]
    out = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"{model}: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def experiment(
    shapes: list[str],
    variants: list[str],
    prefill: int = 512,
    decode: int = 32,
    sessions: int = 8,
    rounds: int = 2,
    log: Log | None = None,
) -> dict[str, Any]:
    """Every shape × variant measured (see the module's docstring), and the ratios."""
    from kvchat.engine.models.demo import build_demo, parse_demo_spec

    say = log or (lambda _m: None)
    head = machine()
    builds = {}
    for shape in shapes:
        for variant in variants:
            name = spec(shape, variant)
            say(f"weights: building {name} (once)")
            started = time.perf_counter()
            folder = build_demo(parse_demo_spec(name) or name)
            builds[name] = {
                "seconds": round(time.perf_counter() - started, 1),
                "disk_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
            }
    say("weights: memory bandwidth")
    before = bandwidth()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    for r in range(rounds):
        for name in builds:
            say(f"weights: measuring {name} in a fresh process (round {r + 1} of {rounds})")
            runs[name].append(_child(name, prefill, decode, sessions))
    rows = [
        {
            "shape": shape,
            "variant": variant,
            **builds[name],
            **_best(runs[name]),
            "runs": runs[name],
        }
        for shape in shapes
        for variant in variants
        for name in [spec(shape, variant)]
    ]
    say("weights: memory bandwidth again")
    after = bandwidth()
    gb_s = max(before["gb_s"], after["gb_s"])
    many = f"decode_{sessions}_tps"
    for row in rows:
        row[f"decode_{sessions}_vs_1"] = rounded_ratio(row[many], row["decode_1_tps"])
        row["limit_tps"] = round(gb_s * 1e9 / row["read_per_token_bytes"], 1)
        row["decode_of_limit"] = rounded_ratio(row["decode_1_tps"], row["limit_tps"])
        base = next(r for r in rows if r["shape"] == row["shape"])
        twin = next(r for r in rows if r["variant"] == row["variant"])
        row["vs_first_variant"] = _ratios(row, base, sessions)
        row["vs_first_shape"] = _ratios(row, twin, sessions)
    head["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "machine": head,
        "bandwidth": {"before": before, "after": after, "gb_s": gb_s},
        "prefill": prefill,
        "decode": decode,
        "sessions": sessions,
        "rounds": rounds,
        "rows": rows,
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the best of a variant's rounds: the highest rate, the lowest seconds
    and memory (the rest is the same in every round)."""
    best = dict(runs[0])
    for key, value in best.items():
        if isinstance(value, (int, float)) and value is not None:
            values = [run[key] for run in runs if run[key] is not None]
            best[key] = max(values) if key.endswith("_tps") else min(values)
    return best


def _ratios(row: dict[str, Any], base: dict[str, Any], sessions: int) -> dict[str, Any]:
    """``row``'s figures over ``base``'s (resident memory: the smaller, the better)."""
    many = f"decode_{sessions}_tps"
    return {
        "of": base["model"],
        "decode_1": rounded_ratio(row["decode_1_tps"], base["decode_1_tps"]),
        f"decode_{sessions}": rounded_ratio(row[many], base[many]),
        "prefill": rounded_ratio(row["prefill_tps"], base["prefill_tps"]),
        "resident": rounded_ratio(row["resident_bytes"], base["resident_bytes"]),
    }


def table(result: dict[str, Any]) -> tuple[str, list[str], list[list[str]], str]:
    """(title, headers, rows, note) of the run, for Markdown and Rich alike."""
    n, sessions = result["prefill"], result["sessions"]
    cross = len({r["shape"] for r in result["rows"]}) > 1
    headers = [
        "model",
        "weights",
        "load s",
        "resident MB",
        f"prefill {n} tok/s",
        "decode tok/s",
        f"{sessions} at once tok/s",
        "read/token MB",
        "limit tok/s",
        "of limit",
        "decode ×",
        "prefill ×",
        "memory ×",
    ]
    rows = []
    for r in result["rows"]:
        vs = r["vs_first_shape"] if cross else r["vs_first_variant"]
        rows.append(
            [
                r["model"],
                r["weights"],
                f"{r['load_s']:.2f}",
                _mb(r["resident_bytes"]),
                f"{r['prefill_tps']:,.0f}",
                f"{r['decode_1_tps']:.1f}",
                f"{r[f'decode_{sessions}_tps']:.1f}",
                _mb(r["read_per_token_bytes"]),
                f"{r['limit_tps']:.1f}",
                _cell(r["decode_of_limit"]),
                _cell(vs["decode_1"]),
                _cell(vs["prefill"]),
                _cell(vs["resident"]),
            ]
        )
    bw = result["bandwidth"]
    against = "the first shape's row of the same weights" if cross else "the shape's first row"
    note = (
        f"Memory bandwidth {bw['gb_s']:.1f} GB/s (numpy's sum over 512 MiB, best of 3, one "
        f"thread or {bw['before']['threads']}, before and after); limit = bandwidth / bytes "
        "one decoding token reads. Decode: one conversation; "
        f"{sessions} at once: their summed decode rate. The × columns divide by {against}."
    )
    return "Weights as stored: load, memory, prefill and decode", headers, rows, note


def _cell(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.0f}" if n >= 1e8 else f"{n / 1e6:.3g}"


def markdown(result: dict[str, Any]) -> str:
    """The run's table as Markdown, headed by the machine."""
    title, headers, rows, note = table(result)
    m = result["machine"]
    lines = [
        f"### {title}",
        "",
        f"{m['cpu']}, {m['cores']} cores; mlx {m['mlx']}, mlx-lm {m['mlx_lm']}; {m['date']}; "
        f"load average at start {m['load_average_at_start']}, at end "
        f"{m.get('load_average_at_end')}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        note,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.weights")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="demo shapes, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32, help="tokens each reply decodes")
    parser.add_argument("--sessions", type=int, default=8, help="conversations at once")
    parser.add_argument("--rounds", type=int, default=2, help="the variants take turns")
    parser.add_argument("--json", action="store_true", help="print every figure as JSON")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one variant, in this process
    args = parser.parse_args(argv)
    blas.preload()  # as kvchat's own entry point does, before mlx is imported
    if args.measure:
        print(json.dumps(measure(args.measure, args.prefill, args.decode, args.sessions)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; use {', '.join(VARIANTS)}")
    with temp_home():
        result = experiment(
            [s for s in args.shape.split(",") if s],
            variants,
            args.prefill,
            args.decode,
            args.sessions,
            args.rounds,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
