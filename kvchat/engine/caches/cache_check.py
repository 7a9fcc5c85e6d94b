"""Is a prompt cache read from disk fit for a model? Checked before it is ever used.

A cache file can be rewritten together with the checksum and fingerprint
beside it, so its arrays are checked against what the model itself makes:
a fresh cache made for the session that has seen one token. That reference
carries every layer's class, array structure, ranks, dtypes and sizes (keys
and values may differ, quantized layers hold packed ``uint32`` data with
scales and biases, a model may bring its own layer classes), so nothing is
read from the model's config. Only the token axis of key/value layers may
differ in length; positions must fit the buffers and agree across layers;
what the cache holds must be finite, and keys and values no larger than
attention ever makes them (a flipped exponent bit makes a finite 1e36 that
overflows the next turn into NaN).
"""

from __future__ import annotations

import copy
from functools import cached_property
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, ChunkedKVCache, RotatingKVCache

from kvchat.engine.caches.kinds import held_tokens, settle
from kvchat.engine.caches.trees import flatten

# Settings of a layer that must be what this kind makes for this model.
_FIXED = ("bits", "group_size", "max_size", "chunk_size", "keep")
_MAX_POSITION = 1 << 40
MAX_KV_MAGNITUDE = 1e6  # keys and values of real models stay far below (fp16 tops out at 65504)
TOKEN_AXIS = 2  # of the rank-4 (batch, heads, tokens, dims) arrays of key/value layers


class Reference:
    """What ``model`` makes of one token on a copy of ``fresh``, an unused cache made for
    the session (by ``make_cache``; not changed): the cache, and the logits there, that a
    cache and log-probabilities read from disk are checked against. The model runs once,
    the first time either is asked for, so a load checks both for the price of one step."""

    def __init__(self, fresh: list[Any], model: nn.Module) -> None:
        self._fresh, self._model = fresh, model

    @cached_property
    def _ran(self) -> tuple[list[Any], mx.array]:
        cache = copy.deepcopy(self._fresh)
        logits = self._model(mx.array([[0]]), cache=cache)[0, -1]
        settle(cache)
        return cache, logits

    @property
    def cache(self) -> list[Any]:
        return self._ran[0]

    @property
    def logits(self) -> mx.array:
        return self._ran[1]


def logprobs_problem(x: Any, reference: Reference) -> str | None:
    """None when ``x``, log-probabilities read from disk, could be the model's (its shape
    and dtype, finite, summing to 1), else why not, as a clause."""
    ref = reference.logits
    if not isinstance(x, mx.array) or (x.shape, x.dtype) != (ref.shape, ref.dtype):
        return "its log-probabilities are not the model's"
    if not (mx.isfinite(x).all() & (mx.abs(mx.logsumexp(x)) < 1e-2)).item():
        return "its log-probabilities are not finite ones that sum to 1"
    return None


def cache_problem(cache: list[Any], reference: Reference) -> str | None:
    """None when ``cache`` can stand in for the reference's fresh cache, else why not, as
    a clause for a sentence."""
    expected = reference.cache
    if len(cache) != len(expected):
        return f"it has {len(cache)} layers, the model {len(expected)}"
    offsets: list[int] = []
    live: list[tuple[mx.array, float]] = []  # (held part of an array, largest magnitude allowed)
    for i, (saved, ref) in enumerate(zip(cache, expected)):
        problem = _layer_problem(saved, ref, offsets, live)
        if problem:
            return f"layer {i} {problem}"
    if len(set(offsets)) > 1:
        return f"its layers disagree on the position (from {min(offsets)} to {max(offsets)})"
    return _implausible(live)


def checkpoint_problem(layers: list[Any], refs: list[Any], tokens: int) -> str | None:
    """None when ``layers``, a checkpoint at ``tokens`` read from disk, can stand in for
    ``refs``, the same layers of a cache :func:`cache_problem` found fit; else why not."""
    offsets: list[int] = []
    live: list[tuple[mx.array, float]] = []
    for saved, ref in zip(layers, refs, strict=True):
        problem = _layer_problem(saved, ref, offsets, live)
        if problem:
            return f"its {type(ref).__name__} {problem}"
    wrong = [o for o in offsets if o != tokens]
    if wrong:
        return f"a layer is at token {wrong[0]}, not {tokens}"
    return _implausible(live)


def _implausible(live: list[tuple[mx.array, float]]) -> str | None:
    if live and not mx.stack([_sound(x, limit) for x, limit in live]).all().item():
        return (
            f"it holds values that are not finite or implausibly large (NaN, infinity or "
            f"keys and values beyond {MAX_KV_MAGNITUDE:g})"
        )
    return None


def _sound(x: mx.array, limit: float) -> mx.array:
    return (mx.abs(x) <= limit).all() if limit < mx.inf else mx.isfinite(x).all()


def _layer_problem(
    saved: Any, ref: Any, offsets: list[int], live: list[tuple[mx.array, float]]
) -> str | None:
    """Check one layer; collect its position in ``offsets`` and its held float arrays in ``live``."""
    if type(saved) is not type(ref):
        return f"is a {type(saved).__name__}, the model makes a {type(ref).__name__}"
    if isinstance(ref, CacheList):
        if len(saved.caches) != len(ref.caches):
            return f"holds {len(saved.caches)} caches, the model {len(ref.caches)}"
        for j, (s, r) in enumerate(zip(saved.caches, ref.caches)):
            problem = _layer_problem(s, r, offsets, live)
            if problem:
                return f"part {j} {problem}"
        return None

    kv = hasattr(ref, "offset") and hasattr(ref, "keys")
    have, want = flatten(saved.state), flatten(ref.state)
    if [p for p, _ in have] != [p for p, _ in want]:
        return "does not hold the arrays the model's cache holds"
    lengths, floats = set(), []
    for (path, s), (_, r) in zip(have, want):
        name = _name(path) if kv else f"state {path}"
        problem = _leaf_problem(name, s, r, kv)
        if problem:
            return problem
        if isinstance(r, mx.array):
            if kv:
                lengths.add(s.shape[TOKEN_AXIS])
            if mx.issubdtype(s.dtype, mx.floating):
                floats.append(s)
    for attr in _FIXED:
        if getattr(saved, attr, None) != getattr(ref, attr, None):
            return f"has {attr} {getattr(saved, attr, None)}, expected {getattr(ref, attr, None)}"
    if not kv:
        live.extend((x, mx.inf) for x in floats)
        return None

    if len(lengths) > 1:
        return f"holds keys and values of different lengths ({sorted(lengths)})"
    length = lengths.pop() if lengths else 0
    if isinstance(saved, ChunkedKVCache) and saved.start_position > saved.offset:
        return f"starts at token {saved.start_position}, after its position {saved.offset}"
    held = held_tokens([saved])
    if held > length:
        return f"claims {held} tokens but its buffer holds {length}"
    if isinstance(saved, RotatingKVCache) and (slot := saved.state[-1]) > length:
        return f"writes at slot {slot} of a {length}-slot buffer"
    offsets.append(saved.offset)
    live.extend((x[..., :held, :], MAX_KV_MAGNITUDE) for x in floats if held)
    return None


def _leaf_problem(name: str, saved: Any, ref: Any, kv: bool) -> str | None:
    if isinstance(ref, mx.array):
        if not isinstance(saved, mx.array):
            return f"has no array for its {name}"
        if saved.ndim != ref.ndim:
            return f"has rank-{saved.ndim} {name}, the model makes rank {ref.ndim}"
        if saved.dtype != ref.dtype:
            return f"has {name} of {_dtype(saved.dtype)}, the model makes {_dtype(ref.dtype)}"
        free = TOKEN_AXIS if kv else None
        if any(a != b for i, (a, b) in enumerate(zip(saved.shape, ref.shape)) if i != free):
            return f"has {name} of shape {_shape(saved.shape, free)}, the model makes {_shape(ref.shape, free)}"
        return None
    if isinstance(ref, bool) or not isinstance(ref, int):
        if type(saved) is not type(ref):
            return f"has {type(saved).__name__} for its {name}, expected {type(ref).__name__}"
        return None
    if isinstance(saved, bool) or not isinstance(saved, int) or not 0 <= saved < _MAX_POSITION:
        shown = repr(saved)
        shown = shown if len(shown) <= 24 else shown[:20] + "..."
        return f"has {shown} for its {name}, expected a whole number"
    return None


def _name(path: str) -> str:
    """``0`` -> keys, ``1.2`` -> values[2], ``2`` -> offset; later parts by number."""
    head, _, rest = path.partition(".")
    base = {"0": "keys", "1": "values", "2": "offset"}.get(head, f"state {head}")
    return f"{base}[{rest}]" if rest else base


def _dtype(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _shape(shape: tuple[int, ...], free: int | None) -> str:
    return "(" + ", ".join("n" if i == free else str(n) for i, n in enumerate(shape)) + ")"
