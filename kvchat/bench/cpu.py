"""The CPU fast path in the bench: the same work with it on and off, and quantized weights.

Each pair is measured in one process, interleaved (on, off, on, off; the best
of each is kept), so the ratio holds on a busy machine. The follow-up rows
reuse one history: it is prefilled once (fast path on) and every measured
turn runs on a copy of its cache (:meth:`Session.fork_prefix`). Quantized
weights are the same shape's ``@q4``/``@q8`` copies, kept packed as loaded (the fast
path reads them as stored), each interleaved with the float32 model it is compared
with.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from .common import FOLLOW_UP, Log, make_text, ratio

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel


def _turn(session: Session, text: str):
    from kvchat.engine.conversation.session import TurnDone

    return [e for e in session.send(text) if isinstance(e, TurnDone)][0].stats


def _prefill_and_decode(lm: LoadedModel, tokens: int, decode: int) -> dict[str, float]:
    """A fresh session answering a ``tokens``-token message: prefill tok/s, decode tok/s."""
    from kvchat.engine.conversation.session import GenerationSettings, Session

    session = Session(lm, settings=GenerationSettings(max_tokens=decode, ignore_eos=True))
    stats = _turn(session, make_text(lm.tokenizer, tokens, seed=11))
    return {
        "prefill_tokens": stats.evaluated_tokens,
        "prefill_tps": stats.evaluated_tokens / stats.prompt_eval_s,
        "decode_tps": stats.gen_tps,
    }


def _follow_up(history: Session, decode: int) -> dict[str, float]:
    """A follow-up on a copy of ``history``'s cache: its TTFT and decode speed."""
    child = history.fork_prefix(history.messages)
    child.settings.max_tokens = decode
    stats = _turn(child, FOLLOW_UP)
    return {
        "new_tokens": stats.evaluated_tokens,
        "history_tokens": stats.reused_tokens,
        "ttft_s": stats.ttft_s,
        "decode_tps": stats.gen_tps,
    }


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per figure, the best of the runs (highest rate, lowest time)."""
    out = dict(runs[0])
    for key in out:
        values = [r[key] for r in runs]
        out[key] = min(values) if key.endswith("_s") else max(values)
    return out


def _interleaved(choices: tuple, measure, repeats: int = 2) -> list[dict[str, float]]:
    """``measure(choice)`` for each choice in turn, ``repeats`` rounds; the best of each."""
    runs: list[list] = [[] for _ in choices]
    for _ in range(repeats):
        for i, choice in enumerate(choices):
            runs[i].append(measure(choice))
    return [_best(r) for r in runs]


def _pair(lm: LoadedModel, measure, log: Log, label: str, repeats: int = 2) -> dict[str, Any]:
    """``measure()`` with ``lm``'s fast path on and off, interleaved."""

    def switched(on: bool) -> dict[str, float]:
        log(f"cpu: {label}, fast path {'on' if on else 'off'}")
        lm.fast_path.on = on
        return measure()

    try:
        on, off = _interleaved((True, False), switched, repeats)
    finally:
        lm.fast_path.on = True
    return {"on": on, "off": off}


def roofline(lm: LoadedModel, rows: int, repeats: int = 2) -> dict[str, float]:
    """What this machine's BLAS allows the model's float32 linear layers, through numpy
    (the fast path's route): a decoding step streams every weight once (one
    matrix-vector product each, the output projection included), and a prefill of
    ``rows`` tokens multiplies every layer's weight by that many rows. Attention,
    norms and hand-offs come on top, so the tok/s figures are upper bounds."""
    import numpy as np

    from kvchat.engine.cpu.linear import CpuEmbedding, CpuLinear, CpuOutput, param_view

    layers = [m for m in lm.model.modules() if isinstance(m, CpuLinear)]
    body_views = [param_view(m) for m in layers if not isinstance(m, CpuOutput)]
    output_views = [param_view(m) for m in layers if isinstance(m, CpuOutput)]
    if not output_views:  # tied: the embedding is the output projection
        output_views = [param_view(m) for m in lm.model.modules() if isinstance(m, CpuEmbedding)]
    body = [w for w in body_views if w is not None]
    output = [w for w in output_views if w is not None]
    if not body or len(body) + len(output) < len(body_views) + len(output_views):
        return {}  # a weight numpy cannot take
    rng = np.random.default_rng(0)
    inputs = {
        n: rng.standard_normal((rows, n), dtype=np.float32)
        for n in {w.shape[1] for w in body + output}
    }

    def sweep(weights: list, multiply) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for w in weights:
                multiply(w, inputs[w.shape[1]])
            best = min(best, time.perf_counter() - started)
        return best

    step_s = sweep(body + output, lambda w, x: w @ x[0])
    prefill_s = sweep(body, lambda w, x: x @ w.T)
    streamed = sum(w.nbytes for w in body + output)
    return {
        "weight_bytes": streamed,
        "stream_gb_s": streamed / step_s / 1e9,
        "decode_bound_tps": 1 / step_s,
        "prefill_rows": rows,
        "matmul_gflop_s": 2 * rows * sum(w.size for w in body) / prefill_s / 1e9,
        "prefill_bound_tps": rows / prefill_s,
    }


def fast_path(lm: LoadedModel, plan: dict[str, Any], log: Log) -> dict[str, Any]:
    """Prefill, decode and cached follow-ups with the CPU fast path on and off."""
    from kvchat.engine.conversation.session import GenerationSettings, Session

    if lm.fast_path is None:
        return {"skipped": lm.fast_path_line()}
    rows = []
    for tokens in plan["cpu_prefill"]:
        pair = _pair(
            lm,
            lambda t=tokens: _prefill_and_decode(lm, t, plan["cpu_decode"]),
            log,
            f"prefill {tokens}",
            plan["cpu_repeats"],
        )
        rows.append(
            {
                "what": f"prefill {tokens} tokens from empty",
                "unit": "tok/s",
                "on": pair["on"]["prefill_tps"],
                "off": pair["off"]["prefill_tps"],
            }
        )
        if tokens == plan["cpu_prefill"][0]:
            rows.append(
                {
                    "what": f"decode at {tokens} tokens of context",
                    "unit": "tok/s",
                    "on": pair["on"]["decode_tps"],
                    "off": pair["off"]["decode_tps"],
                }
            )
    history = Session(
        lm, settings=GenerationSettings(max_tokens=plan["cpu_decode"], ignore_eos=True)
    )
    log(f"cpu: prefilling a {plan['cpu_history']}-token history")
    _turn(history, make_text(lm.tokenizer, plan["cpu_history"], seed=12))
    pair = _pair(
        lm, lambda: _follow_up(history, plan["cpu_decode"]), log, "follow-up", plan["cpu_repeats"]
    )
    n = pair["on"]["history_tokens"]
    rows.append(
        {
            "what": f"follow-up of {pair['on']['new_tokens']} tokens after {n:,} cached",
            "unit": "s TTFT",
            "on": pair["on"]["ttft_s"],
            "off": pair["off"]["ttft_s"],
        }
    )
    rows.append(
        {
            "what": f"decode at {n:,} tokens of context",
            "unit": "tok/s",
            "on": pair["on"]["decode_tps"],
            "off": pair["off"]["decode_tps"],
        }
    )
    for row in rows:
        faster = (
            ratio(row["off"], row["on"])
            if row["unit"].startswith("s")
            else ratio(row["on"], row["off"])
        )
        row["speedup"] = faster
    log("cpu: the machine's bounds for these weights")
    return {"rows": rows, "roofline": roofline(lm, plan["cpu_prefill"][0])}


def quantized_weights(
    lm: LoadedModel, plan: dict[str, Any], log: Log, float32: dict[str, float]
) -> dict[str, Any]:
    """Prefill and decode of ``@q4``/``@q8`` copies of the model (kept packed), each
    interleaved with the float32 model."""
    from kvchat.engine.models.demo import parse_demo_spec
    from kvchat.engine.models.model import load_model

    try:
        is_demo = parse_demo_spec(lm.model_id) is not None and "@" not in lm.model_id
    except ValueError:
        is_demo = False
    if not is_demo:
        return {"skipped": "only for demo models (their @q4/@q8 copies are built here)"}
    if lm.fast_path is None:
        return {"skipped": lm.fast_path_line()}
    rows = [{"weights": "float32", **float32}]
    for bits in plan["cpu_quant_bits"]:
        spec = f"{lm.model_id}@q{bits}"
        log(f"cpu: {spec}")
        started = time.perf_counter()
        quant = load_model(spec)
        load_s = time.perf_counter() - started
        base, figures = _interleaved(
            (lm, quant),
            lambda m: _prefill_and_decode(m, plan["cpu_prefill"][0], plan["cpu_decode"]),
        )
        rows.append(
            {"weights": quant.weights, "load_s": load_s}
            | figures
            | {
                "prefill_vs_float32": ratio(figures["prefill_tps"], base["prefill_tps"]),
                "decode_vs_float32": ratio(figures["decode_tps"], base["decode_tps"]),
            }
        )
        del quant
    return {"rows": rows, "threads": os.cpu_count()}
