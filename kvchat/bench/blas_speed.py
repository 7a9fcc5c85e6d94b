"""The BLAS experiment: a prefill and n×n matmuls with the optimised BLAS kvchat loads
and with the reference one (``KVCHAT_NO_BLAS=1``), each in its own process, since a
process cannot change its BLAS once mlx is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from kvchat import blas

from .common import Log, make_text, ratio

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel


def blas_comparison(lm: LoadedModel, plan: dict[str, Any], say: Log) -> dict[str, Any]:
    """Prefill and matmul speed with the optimised BLAS and with the reference one, each
    measured by :func:`blas_probe` in its own process, and their ratios."""
    if not sys.platform.startswith("linux"):
        return {"skipped": "not Linux: mlx uses the platform BLAS"}
    out: dict[str, Any] = {}
    for label, off in (("optimised", False), ("reference", True)):
        say(f"blas: prefill probe with the {label} BLAS (subprocess)")
        env = dict(os.environ)
        env.pop("KVCHAT_NO_BLAS", None)
        if off:
            env["KVCHAT_NO_BLAS"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "kvchat.bench",
            "--blas-probe",
            "--model",
            lm.model_id,
            "--tokens",
            str(plan["blas_probe_tokens"]),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            out[label] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
            continue
        out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    opt, ref = out.get("optimised", {}), out.get("reference", {})
    out["speedup"] = ratio(opt.get("prefill_tps"), ref.get("prefill_tps"))
    out["matmul_speedup"] = ratio(opt.get("matmul_gflops"), ref.get("matmul_gflops"))
    return out


def blas_probe(spec: str, tokens: int) -> dict[str, Any]:
    """Prefill speed of ``tokens`` tokens in one pass, and n×n matmul GFLOP/s, in this process."""
    import mlx.core as mx

    from kvchat.engine.caches.kinds import make_cache, parse_kind
    from kvchat.engine.models.model import load_model

    lm = load_model(spec)
    ids = lm.tokenizer.encode(make_text(lm.tokenizer, tokens + 8, seed=7), add_special_tokens=False)
    ids = (ids * (tokens // max(1, len(ids)) + 1))[:tokens]

    def once(n: int) -> float:
        cache = make_cache(lm.model, parse_kind("standard"))
        start = time.perf_counter()
        mx.eval(lm.model(mx.array(ids[:n])[None], cache=cache))
        return time.perf_counter() - start

    once(8)  # warm up
    times = [once(tokens)]
    while len(times) < 3 and sum(times) < 3.0:
        times.append(once(tokens))
    seconds = min(times)
    n = 512
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    start = time.perf_counter()
    reps = 0
    while reps < 2 or (time.perf_counter() - start < 0.5 and reps < 50):
        mx.eval(a @ a)
        reps += 1
    gflops = 2 * n**3 * reps / (time.perf_counter() - start) / 1e9
    return {
        "blas": blas.describe(),
        "blas_status": blas.info.status,
        "tokens": tokens,
        "prefill_s": seconds,
        "prefill_tps": tokens / seconds,
        "matmul_gflops": gflops,
    }
