"""Cache kinds: the one place that maps a kind name to mlx-lm cache objects.

A kind is named in config, on the command line and in the UI by one of
``standard``, ``quantized:8``, ``quantized:4``, ``rotated:8``, ``rotated:4``,
``rotating:N``, ``chunked:N`` or ``concatenate``. :func:`parse_kind` turns such a name into a
:class:`CacheKind`; everything else here is a plain function over the list of
per-layer caches that mlx-lm's models take, in the style of
``mlx_lm.models.cache``.

The names themselves (families, sizes, the parser) are in :mod:`.families`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from kvchat.engine.caches import fit, rotated
from kvchat.engine.caches.families import (
    FAMILIES,
    OFFERED_KINDS,
    QUANT_GROUP_SIZE,
    CacheKind,
    CacheKindError,
    Family,
    parse_kind,
)
from kvchat.engine.caches.rotated import RotatedKVCache, rotate
from kvchat.engine.caches.trees import flatten

# The names of .families are re-exported: every user of cache kinds imports from here.
__all__ = [
    "FAMILIES",
    "OFFERED_KINDS",
    "QUANT_GROUP_SIZE",
    "CacheKind",
    "CacheKindError",
    "Family",
    "parse_kind",
    "after_turn",
    "allocated_bytes",
    "applicable_kinds",
    "cache_bytes",
    "cache_offset",
    "compacted",
    "convert_cache",
    "copy_cache",
    "group_size",
    "held_tokens",
    "known_applicable_kinds",
    "make_cache",
    "settle",
    "trim_to",
]


def make_cache(model: nn.Module, kind: CacheKind, keep: int = 0) -> list[Any]:
    """A fresh, empty prompt cache of ``kind`` for ``model``.

    Models that bring their own ``make_cache()`` (sliding-window or
    state-space layers) keep their own classes for those layers; the kind
    replaces only their plain ``KVCache`` layers, and a kind that could
    replace none says so. So does a kind the model's attention cannot take
    (:mod:`kvchat.engine.caches.fit` runs the model once on it to find out).
    """
    if kind.family == "standard":
        return make_prompt_cache(model)

    if not any(type(c) is KVCache for c in _own_cache(model)):
        raise CacheKindError(
            f"This model brings its own cache ({_class_names(_own_cache(model))}); "
            f"cache kind {kind.name!r} cannot apply to it. Use 'standard'."
        )
    group = group_size(model, kind)
    for need in kind.needs:
        failed = fit.backend_problem(need, kind.size or 8, group)
        if failed:
            raise CacheKindError(
                f"Cache kind {kind.name!r} is not available on this backend (MLX on "
                f"{fit.device()}): it cannot run {need} ({failed}). Use 'standard'."
            )
    if kind.family == "rotated" and (unread := rotated.unreadable(model)):
        raise _cannot(kind, unread)

    def made(keep: int) -> list[Any]:
        return [
            kind.make_layer(keep, group) if type(c) is KVCache else c for c in _own_cache(model)
        ]

    failed = fit.problem(model, kind.name, lambda: made(0))
    if failed:
        raise _cannot(kind, f"its attention cannot read a {kind.family} cache ({failed})")
    return made(keep)


def _own_cache(model: nn.Module) -> list[Any]:
    """A fresh cache as the model makes it (mlx-lm's ``KVCache`` per layer if it makes none)."""
    return model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]


def group_size(model: nn.Module, kind: CacheKind) -> int:
    """The group size of ``kind``'s quantized layers for ``model`` (raises
    :class:`CacheKindError` when the head size fits no group mlx quantizes)."""
    if not kind.quantized:
        return QUANT_GROUP_SIZE
    group = fit.group_size(model)
    if isinstance(group, str):
        raise _cannot(kind, group)
    return group


def _cannot(kind: CacheKind, why: str) -> CacheKindError:
    return CacheKindError(
        f"Cache kind {kind.name!r} cannot apply to this model: {why}. Use 'standard'."
    )


def applicable_kinds(model: nn.Module, names: list[str]) -> list[str]:
    """The kind names of ``names`` that can apply to ``model`` (each found out once per
    model: :mod:`kvchat.engine.caches.fit` keeps the answers)."""
    return [n for n in names if fit.once(model, f"applies {n}", partial(_applies, model, n))]


def known_applicable_kinds(model: nn.Module, names: list[str]) -> list[str] | None:
    """:func:`applicable_kinds` when every answer is known already (no model run), else
    None: finding them runs the model, work for a worker thread."""
    if all(fit.known(model, f"applies {n}") for n in names):
        return applicable_kinds(model, names)
    return None


def _applies(model: nn.Module, name: str) -> bool:
    try:
        make_cache(model, parse_kind(name))
    except CacheKindError:
        return False
    return True


def _class_names(cache: list[Any]) -> str:
    return ", ".join(sorted({type(c).__name__ for c in cache}))


def cache_offset(cache: list[Any]) -> int | None:
    """Tokens the cache has seen (its position), or None if no layer tracks it (a model
    whose every layer is recurrent state, such as Mamba: the ledger counts for it)."""
    offsets = [c.offset for c in _flat(cache) if hasattr(c, "offset")]
    return max(offsets) if offsets else None


def _flat(cache: list[Any]) -> list[Any]:
    """The layers, with the parts of a hybrid layer (a ``CacheList``: Falcon-H1's state
    and attention) one by one."""
    return [part for c in cache for part in (c.caches if isinstance(c, CacheList) else (c,))]


def cache_bytes(cache: list[Any]) -> int:
    """Bytes that the tokens held now take (what a save writes).

    mlx-lm's caches allocate in steps of 256 tokens and keep their buffers
    after a trim; :func:`allocated_bytes` counts those. Layers without a token
    axis (state-space layers) count whole.
    """
    total = 0
    for c in cache:
        slots = _slots(c)
        if slots is None:
            total += _allocated(c)
        elif slots:
            total += _allocated(c) * min(_held(c), slots) // slots
    return total


def allocated_bytes(cache: list[Any]) -> int:
    """Bytes held by the cache's buffers, free slots included."""
    return sum(_allocated(c) for c in cache)


def _allocated(c: Any) -> int:
    # mlx-lm's QuantizedKVCache.nbytes fails before its first update.
    return c.nbytes if getattr(c, "keys", ()) is not None else 0


def _slots(c: Any) -> int | None:
    """Token slots in a key/value layer's buffer (0 when empty); None for other layers."""
    if not hasattr(c, "offset") or not hasattr(c, "keys"):
        return None
    keys = c.keys
    if keys is None:
        return 0
    if isinstance(keys, (tuple, list)):  # quantized: (data, scales, biases)
        keys = keys[0]
    return int(keys.shape[-2])


def compacted(cache: list[Any]) -> list[Any]:
    """A view of ``cache`` whose buffers hold only the live tokens, for saving.

    Layers whose slots are not in token order (a rotating cache that has
    wrapped) and layers without a token axis are returned as they are.
    """
    out = []
    for c in cache:
        slots = _slots(c)  # None and 0 mean nothing to cut
        wrapped = isinstance(c, RotatingKVCache) and c.offset > c.max_size
        held = _held(c) if slots else 0
        if not slots or wrapped or held >= slots:
            out.append(c)
            continue
        state = list(c.state)
        state[0], state[1] = (_head(state[0], held), _head(state[1], held))
        out.append(type(c).from_state(tuple(state)))
    return out


def _head(x: Any, n: int) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(a[..., :n, :] for a in x)
    return x[..., :n, :]


def trim_to(cache: list[Any], n: int) -> bool:
    """Trim the cache in place so it holds exactly the first ``n`` tokens.

    Returns False when the cache cannot get there (a rotating cache that has
    wrapped, a chunked cache that dropped those tokens, a state-space layer);
    the caller must then rebuild, since the cache may be partly trimmed.
    """
    offset = cache_offset(cache)
    if offset is None or offset < n:  # it cannot hold tokens it never had (mlx-lm's
        return False  # trim of a negative count would move the offset up to ``n``)
    if offset == n:
        return True
    if any(not c.is_trimmable() for c in cache):
        return False
    if any(isinstance(c, ChunkedKVCache) and c.start_position > n for c in cache):
        return False
    trim_prompt_cache(cache, offset - n)
    for c in cache:
        # mlx-lm's ConcatenateKVCache.trim only moves its offset, and the next
        # update appends after the stale keys; cut them here.
        if isinstance(c, ConcatenateKVCache) and c.keys is not None and c.values is not None:
            c.keys, c.values = c.keys[..., :n, :], c.values[..., :n, :]
    return all(c.offset == n for c in cache if hasattr(c, "offset"))


def after_turn(cache: list[Any]) -> None:
    """Housekeeping between turns: chunked caches drop what fell out of their window."""
    for c in cache:
        if isinstance(c, ChunkedKVCache):
            c.maybe_trim_front()
    settle(cache)


def settle(cache: list[Any]) -> None:
    """Evaluate what is still lazy in the cache (a slice, a conversion, a copy) now.

    MLX streams belong to threads: an unevaluated array built on one thread
    fails when the next turn, on another thread, evaluates it.
    """
    mx.eval([v for c in cache for _, v in flatten(c.state) if isinstance(v, mx.array)])


def _copy_layer(src: Any, dst_kind: CacheKind, group: int) -> Any | None:
    """Convert one full-precision layer without recomputing, or None if not possible."""
    if type(src) not in (KVCache, ConcatenateKVCache):
        return None
    if src.keys is None:
        return dst_kind.make_layer(group_size=group)
    n = src.offset
    keys, values = src.keys[..., :n, :], src.values[..., :n, :]
    if dst_kind.quantized:
        bits = dst_kind.size
        dst = dst_kind.make_layer(group_size=group)
        if keys.shape[-1] % group or values.shape[-1] % group:
            return None
        if isinstance(dst, RotatedKVCache):
            keys, values = rotate(keys), rotate(values)
        dst.keys = mx.quantize(keys, group_size=group, bits=bits)
        dst.values = mx.quantize(values, group_size=group, bits=bits)
        dst.offset = n
        return dst
    if dst_kind.family in ("standard", "concatenate"):
        dst = dst_kind.make_layer()
        dst.update_and_fetch(keys, values)
        return dst
    return None


def convert_cache(
    cache: list[Any], src: CacheKind, dst: CacheKind, group: int = QUANT_GROUP_SIZE
) -> list[Any] | None:
    """Convert a live cache from kind ``src`` to ``dst`` without recomputing, where the data allows.

    Full-precision layers (standard, concatenate) convert to standard,
    concatenate, quantized or rotated exactly as their data stands; layers the model
    brought itself stay as they are. Anything else (dequantizing, a rotating
    or chunked target) returns None: the caller rebuilds from the
    transcript, which is exact. ``group`` is a quantized target's group size.
    """
    src_class = type(src.make_layer())
    out = []
    for layer in cache:
        if type(layer) is not src_class:
            out.append(layer)
            continue
        converted = _copy_layer(layer, dst, group)
        if converted is None:
            return None
        out.append(converted)
    return out


def held_tokens(cache: list[Any], default: int = 0) -> int:
    """Tokens whose keys and values the cache holds now (bounded for rotating and chunked kinds).

    The most any layer holds: a model's sliding-window layers hold fewer than
    its full-attention layers.
    """
    held = [_held(c) for c in _flat(cache) if hasattr(c, "offset")]
    return max(held) if held else default


def _held(c: Any) -> int:
    if isinstance(c, ChunkedKVCache):
        return int(c.offset - c.start_position)
    if isinstance(c, RotatingKVCache):
        return int(min(c.offset, c.max_size))
    return int(c.offset)


def copy_cache(cache: list[Any]) -> list[Any]:
    """An independent copy of a prompt cache (slices are new arrays; state is shared by none)."""
    return [type(c).from_state(_copy_state(c.state)) for c in cache]


def _copy_state(state: Any) -> Any:
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (tuple, list)):
        return type(state)(_copy_state(x) for x in state)
    return state
