"""The bench's CPU tables: the fast path on and off, the machine's bounds for the weights,
and the quantized copies of the model."""

from __future__ import annotations

from typing import Any

from .cells import Table, figure, times


def cpu_tables(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    c = result.get("cpu", {})
    if "rows" in c:
        out.append(
            (
                "CPU fast path: the same work with it on and off",
                ["measure", "unit", "fast path on", "off", "speedup"],
                [
                    [r["what"], r["unit"], figure(r["on"]), figure(r["off"]), times(r["speedup"])]
                    for r in c["rows"]
                ],
                "Numpy attention, SwiGLU and linear layers against mlx-lm's own on the CPU "
                "(KVCHAT_CPU_FASTPATH); best of two interleaved runs each, in one process.",
            )
        )
    r = c.get("roofline")
    if r:
        out.append(
            (
                "What this machine allows the float32 weights",
                ["bound", "measured", "tok/s at most"],
                [
                    [
                        f"decode: stream all {r['weight_bytes'] / 2**30:.2f} GiB of weights per token",
                        f"{figure(r['stream_gb_s'])} GB/s",
                        figure(r["decode_bound_tps"]),
                    ],
                    [
                        f"prefill: {r['prefill_rows']}-row matmuls over every layer",
                        f"{figure(r['matmul_gflop_s'])} GFLOP/s",
                        figure(r["prefill_bound_tps"]),
                    ],
                ],
                "numpy's BLAS on the model's own weights (the fast path's route), best of two; "
                "attention, norms and sampling come on top, so the model's decode and prefill "
                "rates cannot exceed these.",
            )
        )
    q = result.get("quantized_weights", {})
    if "rows" in q:
        out.append(
            (
                "Quantized weights on the CPU",
                [
                    "weights",
                    "load (s)",
                    "prefill tokens",
                    "prefill tok/s",
                    "decode tok/s",
                    "÷ float32, prefill / decode",
                ],
                [
                    [
                        r["weights"],
                        figure(r.get("load_s")),
                        figure(r["prefill_tokens"]),
                        figure(r["prefill_tps"]),
                        figure(r["decode_tps"]),
                        (
                            f"{figure(r['prefill_vs_float32'])} / {figure(r['decode_vs_float32'])}"
                            if "prefill_vs_float32" in r
                            else "–"
                        ),
                    ]
                    for r in q["rows"]
                ],
                "The model's @q4/@q8 copies (mlx-lm's affine quantization, group size 64), "
                "kept packed: the CPU fast path computes with them as stored. Each copy is "
                "measured interleaved with the float32 model in one process (best of two each), "
                "and the last column divides by those float32 runs.",
            )
        )
    return out
