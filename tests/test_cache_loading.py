"""kvchat's reader of mlx-lm's prompt-cache files: the same format, classes from an
explicit table."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    save_prompt_cache,
)

from kvchat.engine.caches.loading import CACHE_CLASSES, load_prompt_cache
from kvchat.engine.caches.rotated import RotatedKVCache


def filled(cache, n: int = 5):
    keys = mx.arange(n * 2 * 64, dtype=mx.float32).reshape(1, 2, n, 64) / 100
    cache.update_and_fetch(keys, -keys)
    return cache


def test_every_class_round_trips_with_its_state_and_metadata(tmp_path):
    recurrent = ArraysCache(2)
    recurrent[0], recurrent[1] = mx.ones((1, 3)), mx.full((1, 2), 7.0)
    caches = [
        filled(KVCache()),
        filled(QuantizedKVCache(bits=4)),
        filled(RotatedKVCache(bits=8)),
        filled(RotatingKVCache(max_size=4), 6),
        CacheList(filled(KVCache(), 3), filled(RotatedKVCache(bits=4), 3)),
        recurrent,
    ]
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches, {"kvchat_version": "x", "note": "é"})
    loaded, meta = load_prompt_cache(path)
    assert meta == {"kvchat_version": "x", "note": "é"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [type(c) for c in loaded[4].caches] == [KVCache, RotatedKVCache]
    assert loaded[1].bits == 4 and loaded[2].bits == 8 and loaded[1].offset == 5
    assert loaded[3].state[2:] == caches[3].state[2:]  # offset, keep, size and write slot
    for got, want in zip(loaded[:3], caches[:3]):
        leaves = zip(tree_flatten(got.state), tree_flatten(want.state), strict=True)
        assert all(
            mx.array_equal(a, b).item() if isinstance(b, mx.array) else a == b
            for (_, a), (_, b) in leaves
        )
    assert mx.array_equal(loaded[5][1], mx.full((1, 2), 7.0)).item()


def test_an_open_file_reads_like_a_path(tmp_path):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), [filled(RotatedKVCache(bits=4))], {"a": "b"})
    with open(path, "rb") as f:
        (cache,), meta = load_prompt_cache(f)
    assert type(cache) is RotatedKVCache and cache.offset == 5 and meta == {"a": "b"}


@pytest.mark.parametrize("name", ["make_prompt_cache", "_BaseCache", "BatchKVCache", "Nope"])
def test_a_class_outside_the_table_is_refused_by_name(tmp_path, name):
    """mlx-lm's reader would call whatever global of its module a file names."""
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [filled(KVCache())], {})
    arrays, meta = mx.load(path, return_metadata=True)
    mx.save_safetensors(path, arrays, {**meta, "1.0": name})
    assert name not in CACHE_CLASSES
    with pytest.raises(ValueError, match=f"unknown cache class '{name}'"):
        load_prompt_cache(path)
