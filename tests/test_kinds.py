"""The kind parser and the functions over mlx-lm cache lists."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvchat.engine.caches.kinds import (
    OFFERED_KINDS,
    CacheKind,
    CacheKindError,
    cache_bytes,
    make_cache,
    parse_kind,
)
from kvchat.engine.caches.rotated import RotatedKVCache


@pytest.mark.parametrize(
    "name, cls",
    [
        ("standard", KVCache),
        ("quantized:8", QuantizedKVCache),
        ("quantized:4", QuantizedKVCache),
        ("rotated:8", RotatedKVCache),
        ("rotated:4", RotatedKVCache),
        ("rotating:4096", RotatingKVCache),
        ("chunked:2048", ChunkedKVCache),
        ("concatenate", ConcatenateKVCache),
    ],
)
def test_every_kind_makes_its_mlx_lm_class(demo_model, name, cls):
    kind = parse_kind(name)
    assert kind.name == name and str(kind) == name
    cache = make_cache(demo_model.model, kind, keep=10)
    assert len(cache) == len(demo_model.model.layers)
    assert all(type(c) is cls for c in cache)


@pytest.mark.quantized_attention
def test_kind_parameters_reach_the_cache(demo_model):
    q4 = make_cache(demo_model.model, parse_kind("quantized:4"))[0]
    assert (q4.bits, q4.group_size) == (4, 64)
    rot = make_cache(demo_model.model, parse_kind("rotating:256"), keep=12)[0]
    assert (rot.max_size, rot.keep) == (256, 12)
    # the kept system prompt never takes more than half of a rotating cache
    assert make_cache(demo_model.model, parse_kind("rotating:256"), keep=1000)[0].keep == 128


def test_the_families_make_the_picker_list_and_the_error_text():
    assert OFFERED_KINDS == (
        "standard",
        "quantized:8",
        "quantized:4",
        "rotated:8",
        "rotated:4",
        "rotating:4096",
        "chunked:2048",
        "concatenate",
    )
    with pytest.raises(CacheKindError) as error:
        parse_kind("bogus")
    assert str(error.value) == (
        "Unknown cache kind 'bogus'; use one of: standard, quantized:8|4, rotated:8|4, "
        "rotating:N, chunked:N, concatenate."
    )
    assert parse_kind("rotated:8").quantized and not parse_kind("rotating:64").quantized


def test_examples_parse_and_names_normalise():
    assert [parse_kind(k).name for k in OFFERED_KINDS] == list(OFFERED_KINDS)
    assert parse_kind("  Quantized:4 ").name == "quantized:4"


@pytest.mark.parametrize(
    "name, message",
    [
        ("bogus", "Unknown cache kind"),
        ("", "Unknown cache kind"),
        ("quantized", "needs a number"),
        ("quantized:3", "8 or 4 bits"),
        ("rotated:2", "8 or 4 bits"),
        ("rotating:abc", "needs a number"),
        ("rotating:16", "at least 64"),
        ("standard:5", "takes no number"),
    ],
)
def test_bad_names_are_clear_errors(name, message):
    with pytest.raises(CacheKindError, match=message):
        parse_kind(name)


@pytest.mark.parametrize(
    "name", ["standard", "quantized:8", "quantized:4", "rotating:256", "chunked:256", "concatenate"]
)
def test_an_empty_cache_holds_no_bytes(demo_model, name):
    assert cache_bytes(make_cache(demo_model.model, parse_kind(name))) == 0


def test_a_kind_built_without_its_size_says_which_size_it_needs():
    with pytest.raises(CacheKindError) as error:
        CacheKind("rotating").make_layer()
    assert str(error.value) == "Cache kind 'rotating' needs a size, e.g. rotating:4096."
