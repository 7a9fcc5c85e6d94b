"""`kvchat bench --quick --json --model demo`: every figure is there and is a real measurement.

These tests check structure and that numbers were measured (positive, finite),
never that anything is fast: the machine running them may be busy.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import mlx.nn as nn
import pytest

from kvchat.bench.common import WINDOW, bench_kinds
from kvchat.engine.caches.families import FAMILIES, OFFERED_KINDS
from kvchat.engine.cpu.stored import kernels

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]
# standard and each quantized family at its fewest bits: what its targets read
QUICK_KINDS = ["standard", "quantized:4", "rotated:4"]


def measured(x) -> bool:
    """A real measured figure: a finite number above zero."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory, kvchat_dirs):
    out = tmp_path_factory.mktemp("bench") / "report.md"
    home = os.environ["KVCHAT_HOME"]
    before = sorted(os.listdir(home)) if os.path.isdir(home) else []
    proc = subprocess.run(
        [*CLI, "bench", "--quick", "--json", "--model", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = sorted(os.listdir(home)) if os.path.isdir(home) else []
    return {
        "result": json.loads(proc.stdout),
        "markdown": out.read_text(),
        "stderr": proc.stderr,
        "home_before": before,
        "home_after": after,
    }


def test_machine_heads_the_report(run):
    m = run["result"]["machine"]
    for key in ("cpu", "cores", "mlx", "mlx_lm", "device", "blas", "platform"):
        assert m[key], key
    assert m["device"] in ("cpu", "gpu")
    model = run["result"]["model"]
    assert model["id"] == "demo" and measured(model["parameters"]) and "float32" in model["dtype"]
    md = run["markdown"]
    assert md.startswith("# kvchat bench")
    head = md.split("\n## ", 1)[0]
    assert m["cpu"] in head and m["mlx"] in head and "BLAS" in head


def test_start_up_of_fresh_processes(run):
    rows = run["result"]["startup"]["rows"]
    assert [r["what"].split(" (")[0] for r in rows] == [
        "python -c pass",
        "kvchat --version",
        "kvchat --help",
        "kvchat sessions list",
        "importing the TUI",
        "importing mlx-lm",
    ]
    assert all(measured(r["s"]) for r in rows)
    assert "## Start-up: fresh processes" in run["markdown"]
    assert "| kvchat --version |" in run["markdown"]


def test_classic_turns_with_and_without_cache(run):
    classic = run["result"]["classic"]
    assert measured(classic["article_tokens"])
    assert [t["turn"] for t in classic["turns"]] == [1, 2]
    for t in classic["turns"]:
        for side in ("cached", "uncached"):
            view = t[side]
            assert measured(view["prompt_eval_s"]) and measured(view["ttft_s"])
            assert view["reused_tokens"] + view["evaluated_tokens"] == view["prompt_tokens"]
        assert measured(t["speedup_prompt_eval"]) and measured(t["speedup_ttft"])
        assert t["same_reply"] is True  # greedy: the cache never changes the answer
    t2 = classic["turns"][1]
    # the cached turn 2 evaluates only its new tokens; the uncached one everything
    assert t2["cached"]["evaluated_tokens"] < t2["uncached"]["evaluated_tokens"]
    assert t2["uncached"]["evaluated_tokens"] == t2["uncached"]["prompt_tokens"]
    assert t2["cached"]["reused_tokens"] > classic["article_tokens"]


def test_history_sweep_and_profile(run):
    result = run["result"]
    points = result["sweep"]["points"]
    assert [p["target_tokens"] for p in points] == [512, 1024, 2048]  # --quick stops at 2k
    for p in points:
        assert abs(p["history_tokens"] - p["target_tokens"]) <= 64
        for key in (
            "cached_ttft_s",
            "uncached_ttft_s",
            "eval_new_only_s",
            "speedup_ttft",
            "cached_over_new_only",
            "new_tokens",
            "gen_tps_cached",
        ):
            assert measured(p[key]), key
        assert p["new_tokens"] < p["uncached_prompt_tokens"]
        assert p["same_reply"] is True
    profile = result["profile"]
    parts = ["render_s", "prefix_search_s", "trim_s", "prefill_s", "first_token_s"]
    for key in parts:
        assert profile[key] >= 0 and math.isfinite(profile[key])
    assert measured(profile["render_s"]) and measured(profile["first_token_s"])
    assert math.isclose(sum(profile["shares"].values()), 1.0, rel_tol=1e-6)
    assert math.isclose(sum(profile[k] for k in parts), profile["total_s"], rel_tol=1e-6)
    assert profile["slowest"] in parts
    assert measured(profile["session_ttft_s"])


def test_cache_kinds(run):
    kinds = run["result"]["kinds"]
    rows = {r["kind"]: r for r in kinds["rows"]}
    assert list(rows) == run["result"]["plan"]["kinds"] == QUICK_KINDS
    for name, r in rows.items():
        for key in ("bytes_per_token", "ttft_s", "gen_tps", "bytes_vs_standard"):
            assert measured(r[key]), (name, key)
        assert (
            0 <= r["agree_with_standard"] <= r["agree_of"] == rows["standard"]["generated_tokens"]
        )
    assert rows["standard"]["agree_with_standard"] == rows["standard"]["agree_of"] > 0
    assert rows["quantized:4"]["bytes_per_token"] < rows["standard"]["bytes_per_token"]
    assert rows["rotated:4"]["bytes_per_token"] == rows["quantized:4"]["bytes_per_token"]
    ratios16 = kinds["at_16_bit"]["ratios"]
    assert 0 < ratios16["quantized:4"] < ratios16["quantized:8"] < 1


def test_the_kinds_measured_come_from_the_families():
    """Every family, each kind the picker offers, the windowed families at the bench's
    window (its history passes it); the quick run's kinds among them."""
    full = bench_kinds(quick=False)
    assert {k.split(":")[0] for k in full} == set(FAMILIES) and len(set(full)) == len(full)
    windowed = [n for n, f in FAMILIES.items() if f.min_size is not None]
    assert [k for k in full if k.split(":")[0] in windowed] == [f"{n}:{WINDOW}" for n in windowed]
    assert [k for k in OFFERED_KINDS if k.split(":")[0] not in windowed] == [
        k for k in full if k.split(":")[0] not in windowed
    ]
    assert bench_kinds(quick=True) == QUICK_KINDS and set(QUICK_KINDS) < set(full)


def test_persistence_in_a_temporary_home(run):
    points = run["result"]["persistence"]["points"]
    assert [p["target_tokens"] for p in points] == [2048]
    p = points[0]
    for key in (
        "save_s",
        "load_s",
        "folder_bytes",
        "cache_file_bytes",
        "resumed_ttft_s",
        "reprefill_ttft_s",
        "speedup_ttft",
        "load_plus_turn_speedup",
    ):
        assert measured(p[key]), key
    assert p["resumed_from_disk"] is True and p["notice"] is None
    assert p["resumed_reused_tokens"] > 0 and p["same_reply"] is True
    # the bench saved into a temporary KVCHAT_HOME, never the user's
    assert run["home_after"] == run["home_before"]


@pytest.mark.cpu_only
def test_blas_probe(run):
    b = run["result"]["blas"]
    if sys.platform.startswith("linux"):
        for label in ("optimised", "reference"):
            assert "error" not in b[label], b[label]
            assert measured(b[label]["prefill_tps"]) and measured(b[label]["matmul_gflops"])
        assert b["reference"]["blas_status"] == "disabled"
        assert measured(b["speedup"])
    else:
        assert "skipped" in b


@pytest.mark.cpu_only
def test_cpu_fast_path_on_and_off(run, demo_model):
    rows = run["result"]["cpu"]["rows"]
    assert [r["what"] for r in rows] == [
        "prefill 512 tokens from empty",
        "decode at 512 tokens of context",
        rows[2]["what"],
        rows[3]["what"],
    ]
    assert rows[2]["what"].startswith("follow-up of ") and rows[2]["unit"] == "s TTFT"
    for r in rows:
        assert measured(r["on"]) and measured(r["off"]) and measured(r["speedup"]), r
    bound = run["result"]["cpu"]["roofline"]
    # every linear weight of the demo model, streamed once a decoding step
    tied = "lm_head" not in demo_model.model
    assert bound["weight_bytes"] == sum(
        m.weight.nbytes
        for m in demo_model.model.modules()
        if isinstance(m, nn.Linear) or (tied and isinstance(m, nn.Embedding))
    )
    assert all(
        measured(bound[k])
        for k in ("stream_gb_s", "decode_bound_tps", "matmul_gflop_s", "prefill_bound_tps")
    )
    assert "## What this machine allows the float32 weights" in run["markdown"]


@pytest.mark.cpu_only
def test_quantized_weights_kept_packed(run):
    rows = run["result"]["quantized_weights"]["rows"]
    assert [r["weights"] for r in rows] == [
        "float32",
        f"4-bit, groups of 64, kept packed, {kernels()}",
    ]
    for r in rows:
        assert measured(r["prefill_tps"]) and measured(r["decode_tps"]), r
    # The packed copy is compared with float32 runs interleaved with its own.
    packed = rows[1]
    assert measured(packed["prefill_vs_float32"]) and measured(packed["decode_vs_float32"])
    targets = {t["target"]: t["value"] for t in run["result"]["targets"]}
    assert (
        targets["4-bit weights: decode no slower than float32 (ratio, interleaved runs)"]
        == packed["decode_vs_float32"]
    )
    assert "## Quantized weights on the CPU" in run["markdown"]
    assert "## CPU fast path" in run["markdown"]


def test_fidelity_section(run):
    rows = {r["kind"]: r for r in run["result"]["fidelity"]}
    assert list(rows) == ["standard", "quantized:8", "quantized:4", "rotated:8", "rotated:4"]
    assert rows["standard"]["kld_mean"] == 0 and rows["standard"]["top1_agreement"] == 1
    assert all(
        measured(r["kld_mean"]) and measured(r["perplexity"])
        for k, r in rows.items()
        if k != "standard"
    )
    assert "## Cache fidelity: KL divergence against standard" in run["markdown"]
    targets = {t["target"].split(" ")[0]: t for t in run["result"]["targets"]}
    assert targets["quantized:8"]["value"] == rows["quantized:8"]["kld_mean"]


def test_targets_and_markdown(run):
    result = run["result"]
    targets = result["targets"]
    assert len(targets) >= 4
    for t in targets:
        assert isinstance(t["met"], bool) and measured(t["value"]) and measured(t["limit"])
    md = run["markdown"]
    for title in (
        "## Classic",
        "## History sweep",
        "## Cache kinds",
        "## Persistence",
        "## Profile of one cached turn",
        "## Targets",
    ):
        assert title in md
    assert measured(result["total_s"])


def test_make_text_is_deterministic_and_sized(demo_model):
    from kvchat.bench import make_text

    tok = demo_model.tokenizer
    a, b = make_text(tok, 300, seed=3), make_text(tok, 300, seed=3)
    assert a == b and a != make_text(tok, 300, seed=4)
    n = len(tok.encode(a, add_special_tokens=False))
    assert 270 <= n <= 310


def test_ctrl_c_ends_the_run_with_what_it_measured(kvchat_dirs):
    """Ctrl-C in the second phase: the run ends there (status 130), and prints the first
    phase's figures, saying where it stopped; no targets, as most were not measured."""
    proc = subprocess.Popen(
        [*CLI, "bench", "--quick", "--json", "--model", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the sweep's first step: the classic turns are measured
            if "sweep 512" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "kvchat: stopped in sweep; what was measured before it follows." in err
    result = json.loads(out)
    assert result["interrupted"] == "sweep"
    assert "targets" not in result and "kinds" not in result
    assert [t["turn"] for t in result["classic"]["turns"]] == [1, 2]
    assert measured(result["classic"]["turns"][1]["speedup_prompt_eval"])
