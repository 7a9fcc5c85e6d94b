"""The rotated:4 and rotated:8 kinds: quantized keys and values after a randomized Hadamard
rotation, attention rotated around them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import turn
from mlx_lm.models import base

from kvchat import store
from kvchat.engine.caches import rotated
from kvchat.engine.caches.kinds import convert_cache, copy_cache, make_cache, parse_kind, trim_to
from kvchat.engine.caches.loading import load_prompt_cache
from kvchat.engine.caches.rotated import RotatedKVCache, rotation
from kvchat.engine.caches.sizes import kind_bytes_per_token
from kvchat.engine.conversation.session import GenerationSettings, Session

SYSTEM = "You are terse."
TEXTS = ["Hello there.", "What is a cache?", "Why is the sky blue?"]


def settings(n: int = 24) -> GenerationSettings:
    return GenerationSettings(max_tokens=n, ignore_eos=True)


def logits_of(lm, tokens: list[int], kind: str) -> mx.array:
    cache = make_cache(lm.model, parse_kind(kind))
    out = [
        lm.model(mx.array(tokens[i : i + 16])[None], cache=cache)[0]
        for i in range(0, len(tokens), 16)
    ]
    return mx.concatenate(out)


def prompt(lm) -> list[int]:
    return lm.tokenizer.encode(
        "The wind came in from the west before dawn, and by the time "
        "the kettle had boiled the whole island was humming with it."
    )


@pytest.mark.parametrize("dim", [64, 128, 80])
def test_the_rotation_is_orthogonal_and_fixed(dim):
    r = np.array(rotation(dim))
    assert np.allclose(r @ r.T, np.eye(dim), atol=1e-5)
    assert not np.allclose(np.abs(r), np.eye(dim))  # it mixes every channel
    if dim == 64:  # a Hadamard matrix: every entry ±1/8, the signs of its rows seeded
        assert set(np.unique(np.abs(r))) == {0.125}
        assert np.array_equal(r, np.array(rotation.__wrapped__(64)))


@pytest.mark.quantized_attention
def test_identity_rotation_equals_quantized_exactly(demo_model, monkeypatch):
    """The plumbing: with R = I, rotated:4 is quantized:4 bit for bit."""
    tokens = prompt(demo_model)
    want = logits_of(demo_model, tokens, "quantized:4")
    monkeypatch.setattr(rotated, "rotation", lambda dim: mx.eye(dim))
    got = logits_of(demo_model, tokens, "rotated:4")
    assert mx.array_equal(got, want).item()


@pytest.mark.quantized_attention
def test_attention_matches_standard_within_tolerance():
    """One attention call over keys with four outlier channels (×12): the largest error
    against full precision is under 0.05 at 8 bits and 0.5 at 4 bits (outputs of size ~1),
    less than half of plain quantization's at either width."""
    rng = np.random.default_rng(1)
    q, k, v = (
        mx.array(rng.standard_normal(s), dtype=mx.float32)
        for s in [(1, 2, 8, 64), (1, 1, 40, 64), (1, 1, 40, 64)]
    )
    k = k * mx.array(np.where(np.arange(64) % 16 == 3, 12.0, 1.0), dtype=mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    errors = {}
    for name in ("quantized:8", "quantized:4", "rotated:8", "rotated:4"):
        cache = parse_kind(name).make_layer()
        keys, values = cache.update_and_fetch(k, v)
        # a copy: mlx-lm's quantized attention scales its queries in place; a rotated
        # cache turns the queries for it and the output back (as kvchat's attention asks)
        if isinstance(cache, RotatedKVCache):
            got = cache.attention(
                mx.array(q), keys, values, 0.125, None, base.scaled_dot_product_attention
            )
        else:
            got = base.scaled_dot_product_attention(
                mx.array(q), keys, values, cache, scale=0.125, mask=None
            )
        errors[name] = mx.abs(got - want).max().item()
    assert errors["rotated:8"] < 0.05 and errors["rotated:4"] < 0.5
    assert errors["rotated:8"] < errors["quantized:8"] / 2
    assert errors["rotated:4"] < errors["quantized:4"] / 2


@pytest.mark.parametrize("kind", ["rotated:4", "rotated:8"])
def test_saves_and_resumes_with_the_cache(demo_model, home, kind):
    session = Session(demo_model, kind=kind, system=SYSTEM, settings=settings())
    for text in TEXTS[:2]:
        turn(session, text)
    store.save(session, "rot")
    loaded = store.load("rot", demo_model)
    assert loaded.resumed_from_disk and loaded.notice is None
    assert all(type(c) is RotatedKVCache and c.bits == int(kind[-1]) for c in loaded.session.cache)
    assert loaded.session.ledger == session.ledger
    resumed, live = turn(loaded.session, TEXTS[2]), turn(session, TEXTS[2])
    assert resumed.stats.evaluated_tokens == live.stats.evaluated_tokens < 40
    assert resumed.tokens == live.tokens


@pytest.mark.quantized_attention
def test_mlx_lm_cache_module_is_left_as_mlx_lm_made_it(demo_model, tmp_path):
    """kvchat reads its own class back without adding a name to mlx-lm's module."""
    import mlx_lm.models.cache as mlx_cache

    session = Session(demo_model, kind="rotated:4", system=SYSTEM, settings=settings())
    turn(session, TEXTS[0])
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, session.cache, {"who": "test"})
    loaded, meta = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [RotatedKVCache] * len(session.cache)
    assert meta == {"who": "test"}
    assert "RotatedKVCache" not in vars(mlx_cache)
    assert not [
        v for v in vars(mlx_cache).values() if getattr(v, "__module__", "").startswith("kvchat")
    ]
    with pytest.raises(KeyError, match="RotatedKVCache"):
        mlx_cache.load_prompt_cache(path)  # mlx-lm alone does not know kvchat's class


@pytest.mark.quantized_attention
def test_undo_and_trim_keep_the_cached_data(demo_model):
    session = Session(demo_model, kind="rotated:4", system=SYSTEM, settings=settings())
    turn(session, TEXTS[0])
    before = [[mx.array(x) for x in c.keys] for c in session.cache]
    n = session.cache[0].offset
    turn(session, TEXTS[1])
    session.undo()
    held = len(session.ledger)  # the first turn's tokens and the template after its reply
    assert session.ledger == session.render(session.messages, False)
    assert n <= held < n + 8 and all(c.offset == held for c in session.cache)
    for layer, saved in zip(session.cache, before):
        for x, y in zip(layer.keys, saved):
            assert mx.array_equal(x[..., :n, :], y[..., :n, :]).item()
    assert turn(session, TEXTS[1]).stats.rebuilt is None
    copied = copy_cache(session.cache)
    assert trim_to(copied, 5) and all(type(c) is RotatedKVCache and c.offset == 5 for c in copied)


@pytest.mark.quantized_attention
def test_converts_from_standard_like_a_fresh_prefill(demo_model):
    tokens = prompt(demo_model)
    cache = make_cache(demo_model.model, parse_kind("standard"))
    demo_model.model(mx.array(tokens)[None], cache=cache)
    converted = convert_cache(cache, parse_kind("standard"), parse_kind("rotated:4"))
    fresh = make_cache(demo_model.model, parse_kind("rotated:4"))
    demo_model.model(mx.array(tokens)[None], cache=fresh)
    for a, b in zip(converted, fresh):
        assert type(a) is RotatedKVCache and a.offset == b.offset == len(tokens)
    # layer 0's keys and values do not depend on the cache kind: the same bits either way
    # (later layers read attention outputs, which the kind changes)
    a, b = converted[0], fresh[0]
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert mx.array_equal(x[..., : a.offset, :], y[..., : b.offset, :]).item()
    session = Session(demo_model, kind="standard", system=SYSTEM, settings=settings(8))
    turn(session, TEXTS[0])
    assert session.set_kind("rotated:4") is None  # converted in place, not rebuilt
    assert turn(session, TEXTS[1]).stats.rebuilt is None


@pytest.mark.quantized_attention
def test_picker_bytes_per_token_equal_quantized(demo_model):
    for bits in (4, 8):
        assert kind_bytes_per_token(demo_model.model, f"rotated:{bits}") == kind_bytes_per_token(
            demo_model.model, f"quantized:{bits}"
        )
    session = Session(demo_model, kind="rotated:4", settings=settings(8))
    other = Session(demo_model, kind="quantized:4", settings=settings(8))
    turn(session, TEXTS[0]), turn(other, TEXTS[0])
    assert session.cache_bytes == other.cache_bytes > 0
