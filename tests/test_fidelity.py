"""KL divergence of each cache kind against standard on held-out text."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kvchat.bench.fidelity import DEFAULT_KINDS, evaluate, heldout_text, logprobs
from kvchat.engine.caches.families import OFFERED_KINDS
from kvchat.engine.caches.kinds import parse_kind
from kvchat.engine.models import demo

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


@pytest.fixture(scope="module")
def rows(demo_model):
    return {f.kind: f for f in evaluate(demo_model)}


def test_the_heldout_text_was_never_trained_on():
    trained, held = demo.corpus_parts()
    assert held.startswith(demo.HELDOUT_TITLE) and held.strip() not in trained
    assert len(held) > 1000


@pytest.mark.quantized_attention
def test_standard_against_itself_and_the_figures_of_each_kind(demo_model, rows):
    n = len(demo_model.tokenizer.encode(heldout_text(), add_special_tokens=False)) - 1
    assert list(rows) == list(DEFAULT_KINDS)
    assert all(r.tokens == n for r in rows.values())
    std = rows["standard"]
    assert (std.kld_mean, std.kld_p99, std.top1_agreement) == (0.0, 0.0, 1.0)
    assert math.isfinite(std.perplexity) and std.perplexity > 1
    # 8 bits barely move the text's perplexity
    assert abs(math.log(rows["quantized:8"].perplexity / std.perplexity)) < 0.05
    for name in DEFAULT_KINDS[1:]:
        r = rows[name]
        assert r.kld_mean > 0 and r.kld_p99 > 0 and 0 < r.top1_agreement <= 1, name
        assert r.perplexity > 1
    assert rows["quantized:8"].kld_mean < 0.002  # the target kvchat holds it to
    assert rows["quantized:8"].kld_mean < rows["quantized:4"].kld_mean
    assert rows["rotated:8"].kld_mean < rows["rotated:4"].kld_mean
    assert rows["quantized:8"].top1_agreement > 0.97


def test_the_demo_knows_its_corpus(demo_model):
    """Trained, not random: on its own corpus the demo's perplexity is a few, not ~2,048.
    (It has learned that corpus nearly by heart, so on the held-out text it is far worse.)"""
    trained, _ = demo.corpus_parts()
    [std] = evaluate(demo_model, ["standard"], text=trained[:3000], max_tokens=512)
    assert 1 < std.perplexity < 20


@pytest.mark.quantized_attention
def test_kld_is_computed_from_the_distributions(demo_model):
    """One kind's mean KLD recomputed by hand from the two runs' log-probabilities."""
    tokens = demo_model.tokenizer.encode(heldout_text(), add_special_tokens=False)[:65]
    ref = logprobs(demo_model, tokens[:-1], parse_kind("standard"))
    q4 = logprobs(demo_model, tokens[:-1], parse_kind("quantized:4"))
    assert ref.shape == q4.shape == (64, demo.VOCAB_SIZE)
    assert np.allclose(np.exp(ref).sum(-1), 1, atol=1e-5)
    want = float(np.mean(np.sum(np.exp(ref) * (ref - q4), axis=-1)))
    got = evaluate(demo_model, ["quantized:4"], max_tokens=64)[1]
    assert got.kind == "quantized:4" and got.tokens == 64
    assert got.kld_mean == pytest.approx(want, rel=1e-6)


@pytest.mark.quantized_attention
def test_eval_cache_cli(kvchat_dirs):
    proc = subprocess.run(
        [*CLI, "eval-cache", "--kinds", "quantized:8", "--max-tokens", "48", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [r["kind"] for r in out] == ["standard", "quantized:8"]
    assert out[0]["kld_mean"] == 0 and out[1]["tokens"] == 48
    bad = subprocess.run(
        [*CLI, "eval-cache", "--kinds", "quantized:3"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "8 or 4 bits" in bad.stderr
    every = subprocess.run(  # by default: each quantized kind the kind picker offers
        [*CLI, "eval-cache", "--max-tokens", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert every.returncode == 0, every.stderr[-2000:]
    offered = [k for k in OFFERED_KINDS if k.split(":")[0] in ("quantized", "rotated")]
    assert [r["kind"] for r in json.loads(every.stdout)] == ["standard", *offered]
    assert offered == ["quantized:8", "quantized:4", "rotated:8", "rotated:4"]


@pytest.mark.quantized_attention
def test_rotation_spreads_outlier_key_channels(kvchat_dirs):
    """Qwen-family models have a few key channels far larger than the rest (from a large
    ``k_proj`` bias); the trained demo has none, which is why rotated:4 barely beats
    quantized:4 on it. Given such channels (the two lowest-frequency RoPE channels of every
    key head offset by 20, which leaves the model's own predictions almost unchanged),
    4-bit groups lose their resolution to them and the rotation spreads them out."""
    from kvchat.engine.models.model import load_model

    lm = load_model("demo")
    tokens = lm.tokenizer.encode(heldout_text(), add_special_tokens=False)[:161]
    before = logprobs(lm, tokens, parse_kind("standard"))
    for layer in lm.model.model.layers:
        attn = layer.self_attn
        bias = np.array(attn.k_proj.bias)
        dim = bias.size // attn.n_kv_heads
        for head in range(attn.n_kv_heads):
            bias[[head * dim + dim // 2 - 1, head * dim + dim - 1]] += 20.0
        attn.k_proj.bias = mx.array(bias)
    rows = {f.kind: f for f in evaluate(lm, ("quantized:4", "rotated:4"), max_tokens=160)}
    after = logprobs(lm, tokens, parse_kind("standard"))
    shift = (np.exp(before) * (before - after)).sum(axis=-1).mean()
    assert shift < 0.1 * rows["quantized:4"].kld_mean  # the model itself barely moved
    assert rows["rotated:4"].kld_mean <= 0.5 * rows["quantized:4"].kld_mean
