"""Can a model take a quantized cache, and with which group size?

mlx quantizes a cache in groups of 32, 64 or 128 values along the head
dimension, so the group must divide the model's head size (Phi-3's is 96: 32
fits, mlx-lm's default 64 does not). And some models' attention reads the
keys and values itself rather than through mlx-lm's attention function, so it
cannot take a quantized cache at all (Gemma 2). Both are found out by running
the model on one token, once per model, and told in one sentence.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

GROUP_SIZES = (64, 32)  # preferred first: 64 is mlx-lm's default

# id(model) -> (a weak reference to it, {bits: group size, or the refusal})
_FOUND: dict[int, tuple[weakref.ref, dict[int, int | str]]] = {}


def quant_group_size(model: nn.Module, bits: int, name: str) -> int:
    """The group size a ``bits``-bit cache uses for ``model``.

    Raises ValueError with one sentence (about kind ``name``) when the model
    cannot take such a cache; nothing about the model changes either way.
    """
    key = id(model)
    ref, found = _FOUND.get(key, (None, None))
    if ref is None or ref() is not model:
        found = {}
        _FOUND[key] = (weakref.ref(model, lambda _: _FOUND.pop(key, None)), found)
    if bits not in found:
        found[bits] = _find(model, bits)
    result = found[bits]
    if isinstance(result, str):
        raise ValueError(f"Cache kind {name!r} cannot apply to this model: {result}. Use 'standard'.")
    return result


def _find(model: nn.Module, bits: int) -> int | str:
    """A group size that works, or why none does (a clause)."""
    probe = make_prompt_cache(model)
    _run(model, probe)
    dims = sorted({x.shape[-1] for c in probe if type(c) is KVCache for x in (c.keys, c.values)})
    group = next((g for g in GROUP_SIZES if all(d % g == 0 for d in dims)), None)
    if group is None:
        return (f"its head size {dims[0] if len(dims) == 1 else dims} is not a multiple of "
                f"{GROUP_SIZES[-1]}, the smallest group mlx quantizes")
    quantized = [QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
                 for c in make_prompt_cache(model)]
    try:
        _run(model, quantized)
    except Exception as exc:  # the model's own attention code fails in its own way
        return f"its attention cannot read a quantized cache ({type(exc).__name__})"
    return group


def _run(model: nn.Module, cache: list[Any]) -> None:
    mx.eval(model(mx.array([[0]]), cache=cache))
