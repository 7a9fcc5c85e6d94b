"""Reading a prompt-cache file written by mlx-lm's ``save_prompt_cache``, with kvchat's
cache classes among those it may name.

mlx-lm's own ``load_prompt_cache`` finds each layer's class by its name among the globals
of ``mlx_lm.models.cache``, so it cannot build a :class:`RotatedKVCache` (and would build
anything a file names there). This reader decodes the same format and takes each class
from :data:`CACHE_CLASSES`, an explicit table of mlx-lm's cache classes and kvchat's;
a name outside it is an error. Each layer is rebuilt through its class's public
``from_state``.
"""

from __future__ import annotations

from typing import Any, BinaryIO

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvchat.engine.caches.rotated import RotatedKVCache

CACHE_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        ConcatenateKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
        RotatedKVCache,
    )
}


def cache_class(name: str) -> type:
    """The cache class a file calls ``name``; ValueError for a name not in the table."""
    try:
        return CACHE_CLASSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"it names an unknown cache class {name!r}") from None


def build(name: str, state: Any) -> Any:
    """A cache of the class called ``name`` holding ``state`` (a :class:`CacheList`'s
    state lists its members' states and class names, rebuilt the same way)."""
    cls = cache_class(name)
    if cls is CacheList:
        return CacheList(*(build(member, inner) for inner, member in state))
    return cls.from_state(state)  # type: ignore[attr-defined]


def _scalar(array: mx.array, kind: str) -> Any:
    if kind == "scalar":
        return array.item()
    if kind == "string":
        codes: list[int] = array.tolist()  # type: ignore[assignment]
        return "".join(map(chr, codes))
    if kind == "none":
        return None
    raise ValueError(f"it marks a value with an unknown type {kind!r}")


def load_prompt_cache(file: str | BinaryIO) -> tuple[list[Any], dict[str, str]]:
    """The caches saved in ``file`` (a path or an open binary file) by mlx-lm's
    ``save_prompt_cache``, and the metadata saved with them."""
    loaded: tuple[dict[str, mx.array], dict[str, str]] = mx.load(  # type: ignore[assignment]
        file, return_metadata=True
    )
    arrays, flat_meta = loaded
    metadata, classes, scalars = tree_unflatten(list(flat_meta.items()))
    values: dict[str, Any] = dict(arrays)
    for pos, kind in scalars[1:]:  # the first entry only keeps the list from being empty
        values[pos] = _scalar(arrays[pos], kind)
    states = tree_unflatten(list(values.items())) if values else []
    if len(states) != len(classes):
        raise ValueError(f"it holds {len(states)} cache states for {len(classes)} classes")
    return [build(name, state) for name, state in zip(classes, states)], metadata
