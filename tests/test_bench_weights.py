"""``python -m kvchat.bench.weights`` on the tiny demo: every figure measured, and the
limits and ratios are what the figures give (never that anything is fast: the
machine running the tests may be busy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import mlx_lm
import pytest
from mlx.utils import tree_flatten
from test_experts import MOE

from kvchat.bench import weights
from kvchat.bench.common import rounded_ratio
from kvchat.engine.models import demo


def measured(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result(kvchat_dirs):
    argv = [sys.executable, "-m", "kvchat.bench.weights", "--shape", "demo"]
    argv += ["--variants", "float32,q4", "--prefill", "64", "--decode", "8", "--sessions", "2"]
    argv += ["--rounds", "2"]
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_each_variant_is_measured_in_its_own_process(result):
    rows = result["rows"]
    assert [r["model"] for r in rows] == ["demo", "demo@q4"]
    assert rows[0]["weights"] == "float32" and rows[1]["weights"].startswith("4-bit")
    for r in rows:
        for key in ("load_s", "resident_bytes", "prefill_tps", "decode_1_tps", "decode_2_tps"):
            assert measured(r[key]), (key, r)
        assert r["prefill_tokens"] >= 64
        # the variants took turns twice: each figure is the best of its two runs
        assert len(r["runs"]) == 2 and {run["model"] for run in r["runs"]} == {r["model"]}
        assert r["decode_1_tps"] == max(run["decode_1_tps"] for run in r["runs"])
        assert r["load_s"] == min(run["load_s"] for run in r["runs"])
        assert r["decode_2_vs_1"] == rounded_ratio(r["decode_2_tps"], r["decode_1_tps"])
    bandwidth = result["bandwidth"]
    assert bandwidth["before"]["array_bytes"] == 512 << 20
    assert bandwidth["gb_s"] == max(bandwidth["before"]["gb_s"], bandwidth["after"]["gb_s"]) > 0


def test_the_limit_is_the_bandwidth_over_the_weights_a_token_reads(result):
    for r in result["rows"]:
        model, _ = mlx_lm.load(str(demo.build_demo(demo.parse_demo_spec(r["model"]))))
        stored = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        assert r["read_per_token_bytes"] == stored  # tied: the embedding read once, as head
        assert r["limit_tps"] == round(result["bandwidth"]["gb_s"] * 1e9 / stored, 1)
        assert r["decode_of_limit"] == rounded_ratio(r["decode_1_tps"], r["limit_tps"])
    float32, q4 = result["rows"]
    assert q4["read_per_token_bytes"] < 0.2 * float32["read_per_token_bytes"]
    assert q4["vs_first_variant"]["of"] == "demo"
    assert q4["vs_first_variant"]["decode_1"] == rounded_ratio(
        q4["decode_1_tps"], float32["decode_1_tps"]
    )
    assert q4["vs_first_variant"]["resident"] == rounded_ratio(
        q4["resident_bytes"], float32["resident_bytes"]
    )
    text = weights.markdown(result)
    assert "| demo@q4 | 4-bit" in text and f"{result['bandwidth']['gb_s']:.1f} GB/s" in text


def test_a_mixture_of_experts_reads_only_its_chosen_share(tmp_path):
    tokenizer = demo.train_tokenizer()
    demo.write_model(tmp_path, demo.model_config(MOE, tokenizer), tokenizer, "q4")
    model, _ = mlx_lm.load(str(tmp_path))
    params = dict(tree_flatten(model.parameters()))
    experts = sum(v.nbytes for k, v in params.items() if ".switch_mlp." in k)
    rest = sum(v.nbytes for v in params.values()) - experts
    share = MOE["num_experts_per_tok"] / MOE["num_experts"]
    assert experts > rest
    assert weights.read_per_token(model) == int(rest + experts * share)
