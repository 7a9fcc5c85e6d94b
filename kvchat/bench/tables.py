"""The bench's result as tables: (title, headers, rows, note) for every section, the one
source of its Markdown report and its Rich tables (the CPU sections' in
:mod:`.cpu_tables`, the figures formatted by :mod:`.cells`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cells import Table, figure, megabytes, percent, times
from .common import PROFILE_PARTS, SUMMARY_PROMPT
from .cpu_tables import cpu_tables


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
                percent(r["top1_agreement"]),
                f"{r['perplexity']:.3f}",
            ]
            for r in rows
        ],
        "KL(standard ‖ kind) of the next-token distribution at every position of a text the "
        "demo model never trained on (the corpus's last section), fed in chunks of 32 tokens "
        "through a fresh cache of each kind; top-1: the most likely token is the same.",
    )


def tables(result: dict[str, Any]) -> list[Table]:
    """(title, headers, rows, note) for every section measured: one source for Markdown
    and rich."""
    out = [t for key, make in SECTIONS if key in result for t in make(result)]
    out += cpu_tables(result)
    if result.get("fidelity"):
        out.append(fidelity_table(result["fidelity"]))
    if "targets" not in result:  # an interrupted run
        return out
    out.append(
        (
            "Targets",
            ["target", "measured", "limit", "met"],
            [
                [t["target"], figure(t["value"]), f"{t['op']} {t['limit']}", figure(t["met"])]
                for t in result["targets"]
            ],
            None,
        )
    )
    return out


def _startup(result: dict[str, Any]) -> list[Table]:
    s = result["startup"]
    return [
        (
            "Start-up: fresh processes",
            ["what", "seconds"],
            [[r["what"], figure(r["s"])] for r in s["rows"]],
            f"Best of {s['rounds']} each, wall time of the whole process. The commands import "
            "neither MLX's model code nor Textual; the TUI shows its first frame before it "
            "imports mlx-lm (tests/test_cli_imports.py checks both).",
        )
    ]


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
                    figure(t["prompt_tokens"]),
                    figure(t["cached"]["evaluated_tokens"]),
                    figure(t["cached"]["prompt_eval_s"]),
                    figure(t["uncached"]["prompt_eval_s"]),
                    times(t["speedup_prompt_eval"]),
                    figure(t["cached"]["ttft_s"]),
                    figure(t["uncached"]["ttft_s"]),
                    figure(t["same_reply"]),
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
                    figure(p["history_tokens"]),
                    figure(p["new_tokens"]),
                    figure(p["cached_ttft_s"]),
                    figure(p["uncached_ttft_s"]),
                    times(p["speedup_ttft"]),
                    figure(p["eval_new_only_s"]),
                    figure(p["cached_over_new_only"]),
                    figure(p["same_reply"]),
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
                    figure(r["bytes_per_token"]),
                    figure(r["bytes_vs_standard"]),
                    figure(r["cache_tokens_after_turn"]),
                    figure(r["ttft_s"]),
                    figure(r["gen_tps"]),
                    f"{r['agree_with_standard']}/{r['agree_of']}",
                    figure(r["first_divergence"]),
                    r["prepared"],
                ]
                for r in k["rows"]
            ]
            + [[name, "not available on this backend", *[""] * 7] for name in k["unavailable"]],
            "Bytes per token: each layer's key and value buffers over their token slots, summed "
            'over layers (preallocation slack excluded); "holds tokens" is what the cache keeps '
            f"after the turn. The model runs in {result['model']['dtype']}; at 16 bits the standard "
            f"cache would take {figure(k['at_16_bit']['standard_bytes_per_token'])} bytes/token and quantized:8 / "
            f"quantized:4 {figure(k['at_16_bit']['ratios']['quantized:8'])} / "
            f"{figure(k['at_16_bit']['ratios']['quantized:4'])} of it. Rotating and chunked kinds "
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
                        figure(p["history_tokens"]),
                        figure(p["save_s"]),
                        figure(p["load_s"]),
                        megabytes(p["folder_bytes"]),
                        figure(p["resumed_ttft_s"]),
                        figure(p["reprefill_ttft_s"]),
                        times(p["speedup_ttft"]),
                        times(p["load_plus_turn_speedup"]),
                        figure(p["same_reply"]),
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
            [
                [PROFILE_PARTS[key], figure(p[key]), percent(p["shares"][key])]
                for key in PROFILE_PARTS
            ]
            + [
                ["total (profiled)", figure(p["total_s"]), "100%"],
                ["TTFT measured by Session (median)", figure(p["session_ttft_s"]), ""],
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
                        figure(r.get("tokens")),
                        figure(r.get("prefill_tps")),
                        figure(r.get("matmul_gflops")),
                    ]
                )
        out.append(
            (
                "BLAS: prefill with the optimised BLAS and without it",
                ["BLAS", "library", "tokens", "prefill tok/s", "matmul GFLOP/s (512²)"],
                rows,
                f"Prefill speedup {times(b.get('speedup'))}, matmul {times(b.get('matmul_speedup'))}; "
                "one subprocess each (KVCHAT_NO_BLAS=1 for the reference BLAS).",
            )
        )
    return out


# each section's table(s), in the report's order (an interrupted run has the first few)
SECTIONS: tuple[tuple[str, Callable[[dict[str, Any]], list[Table]]], ...] = (
    ("startup", _startup),
    ("classic", _classic),
    ("sweep", _sweep),
    ("kinds", _kinds),
    ("persistence", _persistence),
    ("profile", _profile),
    ("blas", _blas),
)
