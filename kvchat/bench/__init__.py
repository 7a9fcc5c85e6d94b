"""``kvchat bench``: what the live prompt cache buys, measured side by side in one run.

Every figure is measured with the cache and without it in the same process and
the same run, so the ratios hold on a noisy machine even where the absolute
seconds do not. Sections:

1. **classic**: turn 1 hands over a long article, turn 2 asks for a summary;
   each turn's prompt evaluation with the cache and from an empty cache.
2. **sweep**: a ~30-token follow-up after histories of 512 … 8k tokens: time to
   first token with the cache, without it, and the cost of evaluating only the
   new tokens; plus a **profile** of the cached turn (render, prefix search,
   prefill, first token) and its share of the time to first token.
3. **kinds**: every cache kind at 2k history: bytes per token, TTFT, generation
   speed and how many of 64 greedy tokens agree with ``standard``.
4. **persistence**: save and load seconds, file size, and the first turn after
   a resume against a full re-prefill.
5. **blas**: prefill speed with the optimised BLAS and without it (one
   subprocess each, since the BLAS is chosen when mlx is first imported).
6. **cpu**: prefill, decode and a cached follow-up with the CPU fast path on and
   off, and **quantized weights**: the model's 4- and 8-bit copies, kept packed
   (see ``bench/cpu.py``).
7. **fidelity**: each quantized kind's KL divergence against ``standard``, top-1
   agreement and perplexity on a held-out text (:mod:`kvchat.bench.fidelity`).

:func:`run_bench` returns a plain dict (what ``--json`` prints);
:func:`to_markdown` and :func:`print_tables` render it. No Textual here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import cpu as cpu_bench
from .blas_speed import blas_comparison
from .common import DEFAULT_MODEL, Log, machine, make_text
from .experiments import Bench
from .report import print_tables, to_markdown
from .startup import start_up_times
from .targets import targets

__all__ = ["DEFAULT_MODEL", "PHASES", "make_text", "print_tables", "run_bench", "to_markdown"]

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel


PHASES = ("start-up", "classic", "sweep", "kinds", "blas", "cpu", "quantized weights", "fidelity")


def run_bench(
    spec: str = DEFAULT_MODEL,
    quick: bool = False,
    log: Log | None = None,
    lm: LoadedModel | None = None,
    load_s: float | None = None,
    on_phase: Callable[[int, str], None] | None = None,
) -> dict[str, Any]:
    """Run every section on model ``spec``; return all figures as a plain dict.

    Pass ``lm`` (and the seconds it took to load, ``load_s``) to reuse a loaded model.
    ``on_phase(i, name)`` is told as phase ``i`` of :data:`PHASES` starts. Ctrl-C ends the
    run at once with the sections measured so far (``interrupted`` names the phase it
    stopped in; there are no targets then).
    """
    from kvchat.bench.fidelity import DEFAULT_KINDS, evaluate
    from kvchat.engine.caches.kinds import applicable_kinds
    from kvchat.engine.models.model import load_model

    say = log or (lambda _m: None)
    started = time.perf_counter()
    head = machine()
    if lm is None:
        t0 = time.perf_counter()
        lm = load_model(spec)
        load_s = time.perf_counter() - t0
    say(f"model {spec} ready" + (f", loaded in {load_s:.1f}s" if load_s else ""))
    bench = Bench(lm, quick, log)
    result: dict[str, Any] = {
        "machine": head,
        "model": {
            "id": lm.model_id,
            "fingerprint": lm.fingerprint,
            "context_length": lm.context_length,
            "dtype": _model_dtype(lm),
            "parameters": _parameters(lm),
            "load_s": load_s,
        },
        "quick": quick,
        "plan": bench.plan,
    }

    def sweep() -> None:
        points, result["persistence"] = bench.sweep()
        result["sweep"] = points
        last = points["points"][-1]
        result["profile"] = last["profile"] | {
            "history_tokens": last["history_tokens"],
            "session_ttft_s": last["cached_ttft_s"],
        }

    def kinds() -> None:
        result["kinds"] = bench.kinds()
        bench.sessions.clear()

    def cpu() -> None:
        say("cpu: the fast path on and off")
        result["cpu"] = cpu_bench.fast_path(lm, bench.plan, say)

    def quantized() -> None:
        float32 = {}
        if "rows" in result.get("cpu", {}):
            first = result["cpu"]["rows"]
            float32 = {
                "prefill_tokens": bench.plan["cpu_prefill"][0],
                "prefill_tps": first[0]["on"],
                "decode_tps": first[1]["on"],
            }
        result["quantized_weights"] = cpu_bench.quantized_weights(lm, bench.plan, say, float32)

    def fidelity() -> None:
        say("fidelity: KL divergence of each kind against standard")
        runnable = applicable_kinds(lm.model, list(DEFAULT_KINDS))  # the rest: result["kinds"]
        result["fidelity"] = [f.as_dict() for f in evaluate(lm, runnable)]

    steps: list[Callable[[], None]] = [
        lambda: result.update(startup=start_up_times(say)),
        lambda: result.update(classic=bench.classic()),
        sweep,
        kinds,
        lambda: result.update(blas=blas_comparison(lm, bench.plan, say)),
        cpu,
        quantized,
        fidelity,
    ]
    phase = PHASES[0]
    try:
        for i, (phase, step) in enumerate(zip(PHASES, steps)):
            if on_phase is not None:
                on_phase(i, phase)
            step()
    except KeyboardInterrupt:
        result["interrupted"] = phase
    else:
        result["targets"] = targets(result)
    result["total_s"] = time.perf_counter() - started
    with contextlib.suppress(OSError, AttributeError):
        head["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _model_dtype(lm: LoadedModel) -> str:
    from kvchat.engine.caches.trees import flatten

    dtypes = {str(v.dtype) for _, v in flatten(lm.model.parameters())}
    return ", ".join(sorted(d.replace("mlx.core.", "") for d in dtypes))


def _parameters(lm: LoadedModel) -> int:
    from kvchat.engine.caches.trees import flatten

    return sum(v.size for _, v in flatten(lm.model.parameters()))
