"""The bench's result as tables: (title, headers, rows, note) for every section, the one
source of its Markdown report and its Rich tables, and the figures formatted for them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import PROFILE_PARTS, SUMMARY_PROMPT


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def _x(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×" if x < 100 else f"{x:,.0f}×"


def _mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f} MB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def fidelity_table(rows: list[dict[str, Any]]) -> tuple[str, list[str], list[list[str]], str]:
    """(title, headers, rows, note) of cache fidelity, for the bench and ``kvchat eval-cache``."""
    n = rows[0]["tokens"] if rows else 0
    return (
        f"Cache fidelity: KL divergence against standard over {n:,} held-out tokens",
        ["kind", "mean KLD", "p99 KLD", "top-1 agree", "perplexity"],
        [
            [
                r["kind"],
                f"{r['kld_mean']:.6f}",
                f"{r['kld_p99']:.6f}",
                _pct(r["top1_agreement"]),
                f"{r['perplexity']:.3f}",
            ]
            for r in rows
        ],
        "KL(standard ‖ kind) of the next-token distribution at every position of a text the "
        "demo model never trained on (the corpus's last section), fed in chunks of 32 tokens "
        "through a fresh cache of each kind; top-1: the most likely token is the same.",
    )


Table = tuple[str, list[str], list[list[str]], str | None]  # title, headers, rows, note


def tables(result: dict[str, Any]) -> list[Table]:
    """(title, headers, rows, note) for every section measured: one source for Markdown
    and rich."""
    out = [t for key, make in SECTIONS if key in result for t in make(result)]
    out += _cpu_tables(result)
    if result.get("fidelity"):
        out.append(fidelity_table(result["fidelity"]))
    if "targets" not in result:  # an interrupted run
        return out
    out.append(
        (
            "Targets",
            ["target", "measured", "limit", "met"],
            [
                [t["target"], _f(t["value"]), f"{t['op']} {t['limit']}", _f(t["met"])]
                for t in result["targets"]
            ],
            None,
        )
    )
    return out


def _classic(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    c = result["classic"]
    out.append(
        (
            f'Classic: a {c["article_tokens"]:,}-token article, then "{SUMMARY_PROMPT}"',
            [
                "turn",
                "prompt tokens",
                "evaluated (cache)",
                "prompt eval, cache (s)",
                "prompt eval, no cache (s)",
                "speedup",
                "TTFT cache (s)",
                "TTFT no cache (s)",
                "same reply",
            ],
            [
                [
                    str(t["turn"]),
                    _f(t["prompt_tokens"]),
                    _f(t["cached"]["evaluated_tokens"]),
                    _f(t["cached"]["prompt_eval_s"]),
                    _f(t["uncached"]["prompt_eval_s"]),
                    _x(t["speedup_prompt_eval"]),
                    _f(t["cached"]["ttft_s"]),
                    _f(t["uncached"]["ttft_s"]),
                    _f(t["same_reply"]),
                ]
                for t in c["turns"]
            ],
            "Turn 1 starts from an empty cache either way, so its two columns are the same work "
            '(measured once, shown in both). "No cache" is the same transcript after `reset()`: '
            "a full prefill.",
        )
    )
    return out


def _sweep(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    pts = result["sweep"]["points"]
    out.append(
        (
            "History sweep: a ~30-token follow-up after N tokens of history",
            [
                "history tokens",
                "new tokens",
                "TTFT cache (s)",
                "TTFT no cache (s)",
                "speedup",
                "eval new tokens only (s)",
                "cache ÷ new-only",
                "same 1st token",
            ],
            [
                [
                    _f(p["history_tokens"]),
                    _f(p["new_tokens"]),
                    _f(p["cached_ttft_s"]),
                    _f(p["uncached_ttft_s"]),
                    _x(p["speedup_ttft"]),
                    _f(p["eval_new_only_s"]),
                    _f(p["cached_over_new_only"]),
                    _f(p["same_reply"]),
                ]
                for p in pts
            ],
            "TTFT with the cache is the median of "
            f'{result["plan"]["cached_repeats"]} runs; "eval new tokens only" evaluates just the '
            "turn's new tokens from an empty cache and samples one token (no history at all). "
            'The histories are prefixes of one transcript; "no cache" is one fresh full prefill '
            "of it from an empty cache, timed (plus templating) up to each follow-up prompt's last "
            "token and its first sampled token, the work a fresh prefill of that prompt does. "
            "\"Same 1st token\": the cached turn's first token equals the fresh prefill's (greedy).",
        )
    )
    return out


def _kinds(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    k = result["kinds"]
    out.append(
        (
            f"Cache kinds at {k['history_tokens']:,} tokens of history",
            [
                "kind",
                "bytes/token",
                "vs standard",
                "holds tokens",
                "TTFT (s)",
                "gen tok/s",
                f"agree of {result['plan']['agree_tokens']}",
                "first divergence",
                "prepared by",
            ],
            [
                [
                    r["kind"],
                    _f(r["bytes_per_token"]),
                    _f(r["bytes_vs_standard"]),
                    _f(r["cache_tokens_after_turn"]),
                    _f(r["ttft_s"]),
                    _f(r["gen_tps"]),
                    f"{r['agree_with_standard']}/{r['agree_of']}",
                    _f(r["first_divergence"]),
                    r["prepared"],
                ]
                for r in k["rows"]
            ]
            + [[name, "not available on this backend", *[""] * 7] for name in k["unavailable"]],
            "Bytes per token: each layer's key and value buffers over their token slots, summed "
            'over layers (preallocation slack excluded); "holds tokens" is what the cache keeps '
            f"after the turn. The model runs in {result['model']['dtype']}; at 16 bits the standard "
            f"cache would take {_f(k['at_16_bit']['standard_bytes_per_token'])} bytes/token and quantized:8 / "
            f"quantized:4 {_f(k['at_16_bit']['ratios']['quantized:8'])} / "
            f"{_f(k['at_16_bit']['ratios']['quantized:4'])} of it. Rotating and chunked kinds "
            "keep only a window, so they diverge by design; quantized kinds were converted from "
            "the standard cache, the way switching a live session does."
            + "".join(f" {why}" for why in k["unavailable"].values()),
        )
    )
    return out


def _persistence(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    ps = result["persistence"]["points"]
    if ps:
        out.append(
            (
                "Persistence: save, load, and the first turn after a resume",
                [
                    "history tokens",
                    "save (s)",
                    "load (s)",
                    "size",
                    "resumed TTFT (s)",
                    "re-prefill TTFT (s)",
                    "speedup",
                    "incl. load",
                    "same 1st token",
                ],
                [
                    [
                        _f(p["history_tokens"]),
                        _f(p["save_s"]),
                        _f(p["load_s"]),
                        _mb(p["folder_bytes"]),
                        _f(p["resumed_ttft_s"]),
                        _f(p["reprefill_ttft_s"]),
                        _x(p["speedup_ttft"]),
                        _x(p["load_plus_turn_speedup"]),
                        _f(p["same_reply"]),
                    ]
                    for p in ps
                ],
                "Saved into a temporary KVCHAT_HOME. Load time includes reading every cache array "
                'into memory; "incl. load" compares load + first turn with the re-prefill.',
            )
        )
    return out


def _profile(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    p = result["profile"]
    out.append(
        (
            f"Profile of one cached turn ({p['history_tokens']:,} tokens of history, "
            f"{p['new_tokens']} new)",
            ["part", "seconds", "share of TTFT"],
            [[PROFILE_PARTS[key], _f(p[key]), _pct(p["shares"][key])] for key in PROFILE_PARTS]
            + [
                ["total (profiled)", _f(p["total_s"]), "100%"],
                ["TTFT measured by Session (median)", _f(p["session_ttft_s"]), ""],
            ],
            "Each part is the median of "
            f"{result['plan']['profile_repeats']} runs, timed outside the Session with its own helpers.",
        )
    )
    return out


def _blas(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    b = result["blas"]
    if "skipped" not in b:
        rows = []
        for label in ("optimised", "reference"):
            r = b.get(label, {})
            if "error" in r:
                rows.append([label, r["error"], "", "", ""])
            else:
                rows.append(
                    [
                        label,
                        r.get("blas", ""),
                        _f(r.get("tokens")),
                        _f(r.get("prefill_tps")),
                        _f(r.get("matmul_gflops")),
                    ]
                )
        out.append(
            (
                "BLAS: prefill with the optimised BLAS and without it",
                ["BLAS", "library", "tokens", "prefill tok/s", "matmul GFLOP/s (512²)"],
                rows,
                f"Prefill speedup {_x(b.get('speedup'))}, matmul {_x(b.get('matmul_speedup'))}; "
                "one subprocess each (KVCHAT_NO_BLAS=1 for the reference BLAS).",
            )
        )
    return out


# each section's table(s), in the report's order (an interrupted run has the first few)
SECTIONS: tuple[tuple[str, Callable[[dict[str, Any]], list[Table]]], ...] = (
    ("classic", _classic),
    ("sweep", _sweep),
    ("kinds", _kinds),
    ("persistence", _persistence),
    ("profile", _profile),
    ("blas", _blas),
)


def _cpu_tables(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    c = result.get("cpu", {})
    if "rows" in c:
        out.append(
            (
                "CPU fast path: the same work with it on and off",
                ["measure", "unit", "fast path on", "off", "speedup"],
                [
                    [r["what"], r["unit"], _f(r["on"]), _f(r["off"]), _x(r["speedup"])]
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
                        f"{_f(r['stream_gb_s'])} GB/s",
                        _f(r["decode_bound_tps"]),
                    ],
                    [
                        f"prefill: {r['prefill_rows']}-row matmuls over every layer",
                        f"{_f(r['matmul_gflop_s'])} GFLOP/s",
                        _f(r["prefill_bound_tps"]),
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
                        _f(r.get("load_s")),
                        _f(r["prefill_tokens"]),
                        _f(r["prefill_tps"]),
                        _f(r["decode_tps"]),
                        (
                            f"{_f(r['prefill_vs_float32'])} / {_f(r['decode_vs_float32'])}"
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
