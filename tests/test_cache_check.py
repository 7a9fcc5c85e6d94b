"""Crafted cache files, forged consistently (checksum in session.json rewritten to match),
are never used: each load gives a notice and rebuilds, and the next turn's reply is the
reply of a session that was never saved. Plus the check itself on models that bring
their own cache layers (sliding-window attention, state-space)."""

from __future__ import annotations

import hashlib
import json
import tempfile

import mlx.core as mx
import pytest
from helpers import turn
from mlx_lm.models import gemma3_text, mamba
from mlx_lm.models.cache import save_prompt_cache

from kvchat import store
from kvchat.engine.caches.cache_check import Reference, cache_problem
from kvchat.engine.caches.kinds import compacted, make_cache, parse_kind
from kvchat.engine.caches.loading import load_prompt_cache
from kvchat.engine.conversation.session import GenerationSettings, Session

SYSTEM = "You are terse."
FIRST = ["Hello there.", "What is a cache?"]
NEXT = "And why is it fast?"


def conversation(lm, kind: str) -> Session:
    session = Session(lm, kind=kind, system=SYSTEM, settings=GenerationSettings(max_tokens=10))
    for text in FIRST:
        turn(session, text)
    return session


_reference: dict[str, str] = {}


def never_saved_reply(lm, kind: str) -> str:
    if kind not in _reference:
        _reference[kind] = turn(conversation(lm, kind), NEXT).reply
    return _reference[kind]


def _with(arrays: dict, key: str, fn) -> dict:
    return {**arrays, key: fn(arrays[key])}


def _nan(x: mx.array) -> mx.array:
    x = mx.array(x)
    x[..., 0, 0] = float("nan")
    return x


def _scalar(value):
    return lambda _: mx.array(value)


# (kind, crafted arrays of the safetensors file, words the notice must hold).
# Layer 0's keys are "0.0", its values "0.1", its scalars "0.2" (offset) and on.
CRAFTED = {
    "twice-kv-heads": (
        "standard",
        lambda a: {
            **a,
            "0.0": mx.concatenate([a["0.0"]] * 2, axis=1),
            "0.1": mx.concatenate([a["0.1"]] * 2, axis=1),
        },
        "keys of shape (1, 2, n, 64)",
    ),
    "int8-keys": (
        "standard",
        lambda a: _with(a, "0.0", lambda x: x.astype(mx.int8)),
        "keys of int8, the model makes float32",
    ),
    "float16-values": (
        "standard",
        lambda a: _with(a, "1.1", lambda x: x.astype(mx.float16)),
        "layer 1 has values of float16",
    ),
    "nan-keys": ("standard", lambda a: _with(a, "1.0", _nan), "not finite"),
    "inf-quantized-scales": (
        "quantized:8",
        lambda a: _with(a, "0.0.1", lambda x: x / 0),
        "not finite",
    ),
    "huge-values": ("standard", lambda a: _with(a, "1.1", lambda x: x * 1e30), "implausibly large"),
    "huge-quantized-scales": (
        "quantized:8",
        lambda a: _with(a, "0.1.1", lambda x: x + 4e36),
        "implausibly large",
    ),
    "half-head-dim": (
        "standard",
        lambda a: _with(a, "0.0", lambda x: x[..., :32]),
        "keys of shape (1, 1, n, 32)",
    ),
    "rank-2": (
        "standard",
        lambda a: _with(a, "0.1", lambda x: x.reshape(-1, x.shape[-1])),
        "rank-2 values",
    ),
    "batch-of-2": (
        "concatenate",
        lambda a: _with(a, "0.0", lambda x: mx.concatenate([x, x])),
        "keys of shape (2, 1, n, 64)",
    ),
    "renamed-key": (
        "standard",
        lambda a: {**{k: v for k, v in a.items() if k != "0.0"}, "0.keys": a["0.0"]},
        "has no array for its keys",
    ),
    "keys-longer-than-values": (
        "concatenate",
        lambda a: _with(a, "0.0", lambda x: mx.concatenate([x, x], axis=2)),
        "different lengths",
    ),
    "offset-beyond-length": (
        "standard",
        lambda a: _with(a, "0.2", lambda x: x + 100),
        "but its buffer holds",
    ),
    "quantized-offset-beyond": (
        "quantized:8",
        lambda a: _with(a, "1.2", lambda x: x + 1),
        "but its buffer holds",
    ),
    "quantized-half-packed": (
        "quantized:4",
        lambda a: _with(a, "0.0.0", lambda x: x[..., :4]),
        "keys[0] of shape (1, 1, n, 4), the model makes (1, 1, n, 8)",
    ),
    "quantized-bits": ("quantized:8", lambda a: _with(a, "0.4", _scalar(4)), "bits 4, expected 8"),
    "quantized-offset-float": (
        "quantized:8",
        lambda a: _with(a, "0.2", lambda x: x.astype(mx.float32) + 0.5),
        "expected a whole number",
    ),
    "negative-offset": (
        "standard",
        lambda a: _with(a, "0.2", lambda x: x * 0 - 5),
        "expected a whole number",
    ),
    "rotating-slot-beyond": (
        "rotating:256",
        lambda a: _with(a, "0.5", lambda x: x + 1000),
        "writes at slot",
    ),
    "rotating-keep": ("rotating:256", lambda a: _with(a, "0.3", _scalar(1)), "keep 1, expected"),
    "chunked-start-after-offset": (
        "chunked:256",
        lambda a: _with(a, "1.4", lambda x: x + 10**6),
        "after its position",
    ),
}


def _forge(folder, craft) -> None:
    """Rewrite cache.safetensors with ``craft`` applied to its arrays (metadata kept),
    and session.json's checksum and size to match, as an attacker would."""
    path = folder / "cache.safetensors"
    arrays, metadata = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), craft(arrays), metadata)
    json_path = folder / "session.json"
    data = json.loads(json_path.read_text())
    data["cache"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    data["cache"]["bytes"] = path.stat().st_size
    json_path.write_text(json.dumps(data))


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_cache_is_rebuilt_never_used(demo_model, home, case):
    kind, craft, words = CRAFTED[case]
    session = conversation(demo_model, kind)
    folder = store.save(session, "chat")
    _forge(folder, craft)

    loaded = store.load("chat", demo_model)
    assert not loaded.resumed_from_disk
    assert loaded.notice.startswith("The saved cache was not used (")
    assert words in loaded.notice and "\n" not in loaded.notice
    assert loaded.session.messages == session.messages
    assert loaded.session.ledger == session.render(session.messages, False)  # rebuilt
    assert turn(loaded.session, NEXT).reply == never_saved_reply(demo_model, kind)


@pytest.mark.parametrize(
    "kind",
    [
        "standard",
        "quantized:8",
        "quantized:4",
        "rotated:4",
        "rotating:64",
        "chunked:64",
        "concatenate",
    ],
)
def test_sound_caches_pass_and_layer_count_is_checked(demo_model, kind):
    session = Session(
        demo_model, kind=kind, system=SYSTEM, settings=GenerationSettings(max_tokens=40)
    )
    for text in FIRST * 3:  # past 64 tokens: rotating and chunked layers have wrapped or dropped
        turn(session, text)
    fresh = Session(demo_model, kind=kind, system=SYSTEM).cache
    loaded = _round_trip(session.cache)
    reference = Reference(fresh, demo_model.model)
    assert cache_problem(loaded, reference) is None
    assert cache_problem(loaded[:1], reference) == "it has 1 layers, the model 2"
    assert all(c.keys is None for c in fresh)  # the reference is a copy: fresh is left alone


def _round_trip(cache: list) -> list:
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/cache.safetensors"
        save_prompt_cache(path, compacted(cache), {})
        return load_prompt_cache(path)[0]


def _gemma() -> gemma3_text.Model:
    """A tiny real Gemma 3: every other layer a 16-token sliding window (RotatingKVCache)."""
    model = gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=2,
            head_dim=64,
            vocab_size=64,
            num_key_value_heads=1,
            sliding_window=16,
            sliding_window_pattern=2,
        )
    )
    mx.eval(model.parameters())
    return model


def _mamba() -> mamba.Model:
    """A tiny real Mamba: state-space layers (ArraysCache), no keys or values at all."""
    model = mamba.Model(
        mamba.ModelArgs(
            model_type="mamba",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            state_size=8,
            num_hidden_layers=2,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            time_step_rank=4,
        )
    )
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    "build, kind",
    [(_gemma, "standard"), (_gemma, "quantized:8"), (_gemma, "concatenate"), (_mamba, "standard")],
)
def test_models_with_their_own_cache_layers(build, kind):
    model = build()
    cache = make_cache(model, parse_kind(kind))
    model(mx.arange(40)[None] % 64, cache=cache)
    for token in range(3):
        model(mx.array([[token]]), cache=cache)
    fresh = make_cache(model, parse_kind(kind))
    loaded = _round_trip(cache)
    reference = Reference(fresh, model)
    assert cache_problem(loaded, reference) is None

    layer = loaded[0]
    if hasattr(layer, "offset"):  # the sliding-window layer: one position for all layers
        layer.offset += 1
        assert cache_problem(loaded, reference).startswith("its layers disagree on the position")
    else:  # a state-space layer: its whole state has a fixed shape
        layer.cache[1] = layer.cache[1][..., :4]
        assert "state 0.1 of shape" in cache_problem(loaded, reference)
        layer.cache[1] = None
        assert cache_problem(loaded, reference) == "layer 0 has no array for its state 0.1"
