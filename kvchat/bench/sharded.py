"""``python -m kvchat.bench.sharded``: one turn on one rank against two local ranks.

The same replay script (one long message, a short reply) runs as ``kvchat replay``
in one process, once as kvchat runs on one machine and once without the CPU fast
path (the code path a sharded model takes), and as ``kvchat launch -n 2 -- replay``:
two ranks over the ring backend on loopback, each holding half the weights (tensor
parallel) or half the layers (pipeline). Each row is prompt eval and decode tok/s
from the turn's own stats, and rank 0's peak memory.

Two ranks on one machine share its cores and add a collective per layer: the point
of sharding is memory (a model that fits no single machine), not speed here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kvchat.engine.models.demo import corpus_parts

from .common import KVCHAT, temp_home
from .servers import free_port

RUNS = {  # name: (kvchat arguments before the replay, extra environment)
    "1 rank": ([], {}),
    "1 rank, CPU fast path off": ([], {"KVCHAT_CPU_FASTPATH": "0"}),
    "2 local ranks (ring)": (["launch", "-n", "2", "--port", "{port}", "--"], {}),
}


def run(model: str, chars: int, max_tokens: int, home: Path) -> dict:
    """Every row of the table, as a dict of name: figures."""
    script = home / "script.json"
    script.write_text(json.dumps({"turns": [corpus_parts()[0][:chars]]}), encoding="utf-8")
    rows = {}
    for name, (prefix, env) in RUNS.items():
        prefix = [a.replace("{port}", str(free_port())) for a in prefix]
        argv = [
            *KVCHAT,
            *prefix,
            "replay",
            str(script),
            "--model",
            model,
            "--json",
            "--max-tokens",
            str(max_tokens),
        ]
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=1800, env={**os.environ, **env}
        )
        if out.returncode != 0:
            raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1:]}")
        turn = json.loads(out.stdout)["turns"][0]
        rows[name] = {
            "prompt_tokens": turn["evaluated_tokens"],
            "prompt_tps": round(turn["evaluated_tokens"] / turn["prompt_eval_s"], 1),
            "generated_tokens": turn["generated_tokens"],
            "decode_tps": round(turn["gen_tps"], 2),
            "rank0_peak_gib": round(turn["peak_memory_bytes"] / 2**30, 2),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.sharded")
    parser.add_argument("--model", default="demo:llama-3.2-1b")
    parser.add_argument("--chars", type=int, default=2000, help="length of the message")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    with temp_home() as home:
        rows = run(args.model, args.chars, args.max_tokens, home)
    print(
        f"{'run':<28} {'prompt tok':>10} {'prompt tok/s':>12} {'decode tok/s':>12} "
        f"{'rank 0 peak GiB':>15}"
    )
    for name, r in rows.items():
        print(
            f"{name:<28} {r['prompt_tokens']:>10} {r['prompt_tps']:>12} {r['decode_tps']:>12} "
            f"{r['rank0_peak_gib']:>15}"
        )
    print(json.dumps({"model": args.model, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
