"""The decoding step's attention in numpy, a row at a time, for the rows the native kernel
does not read (:mod:`.decode`: a quantized or rotated cache, or no kernel built): one new
token over a row's cache of any of the step's kinds, or several new tokens (causal among
them) over a plain ``KVCache``.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvchat.engine.caches import rotated
from kvchat.engine.caches.rotated import RotatedKVCache
from kvchat.engine.cpu.quantized_reads import stored_and_read
from kvchat.engine.cpu.rope import RopeForm, Turn, rotate


def one_token(
    attn: nn.Module,
    form: RopeForm,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cache: Any,
    turn: Turn,
) -> tuple[np.ndarray, Turn | None]:
    """One row's attention output for one token, and its new key and value for the caller
    to hand to the cache (None when they are stored already: a quantized cache stores them
    first, so that the token attends to its own key as stored, as in mlx-lm); the keys and
    values before it are read from the cache."""
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    q = rotate(q.reshape(heads, -1), form, *turn)
    k = rotate(k.reshape(kv_heads, -1), form, *turn)
    v = v.reshape(kv_heads, -1)
    grouped = q.reshape(kv_heads, heads // kv_heads, -1) * np.float32(attn.scale)
    turned = None  # a rotated cache's rotation R: keys, values and queries times R
    keys: np.ndarray | None
    values: np.ndarray | None
    if isinstance(cache, QuantizedKVCache):
        keys, values = stored_and_read(cache, k, v)
        own, span = False, keys.shape[1]
        if isinstance(cache, RotatedKVCache):
            turned = np.asarray(rotated.rotation(keys.shape[-1]))
            grouped = grouped @ turned
    else:
        own, span = True, cache.offset
        keys = np.asarray(cache.keys)[0, :, :span] if span else None  # (kv heads, span, dim)
        values = np.asarray(cache.values)[0, :, :span] if span else None
    # Scores as (kv heads, keys, group), the token's own key last: the cached keys are
    # the long side of the product, which BLAS streams twice as fast as grouped·keysᵀ.
    scores = np.empty((kv_heads, span + own, grouped.shape[1]), dtype=np.float32)
    if span and keys is not None:  # keys and values are there whenever span is
        np.matmul(keys, grouped.swapaxes(-1, -2), out=scores[:, :span])
    if own:
        scores[:, span] = np.matmul(grouped, k[:, :, None])[..., 0]
    scores -= scores.max(axis=1, keepdims=True)
    np.exp(scores, out=scores)
    weights = scores.swapaxes(-1, -2)  # (kv heads, group, span + own)
    out = np.zeros((kv_heads, grouped.shape[1], v.shape[-1]), dtype=np.float32)
    if span and values is not None:
        np.matmul(weights[..., :span], values, out=out)
    if own:
        out += weights[..., span:] * v[:, None, :]
    out /= weights.sum(axis=-1, keepdims=True)
    if turned is not None:  # a mix of rotated values, rotated back
        out = out @ turned.T
    return out.reshape(-1), ((k, v) if own else None)


def several_tokens(
    attn: nn.Module,
    form: RopeForm,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cache: KVCache,
    turn: Turn,
) -> tuple[np.ndarray, Turn]:
    """One row's attention outputs ``(tokens, features)`` for several new tokens on a plain
    cache: each attends to the cached keys and values and to the new ones up to its own
    (causal); and their keys and values ``(kv heads, tokens, head dim)`` for the caller
    to hand to the cache."""
    n, heads, kv_heads = q.shape[0], attn.n_heads, attn.n_kv_heads
    cos, sin = (t[:, None, :] for t in turn)
    q = rotate(q.reshape(n, heads, -1), form, cos, sin)
    k = rotate(k.reshape(n, kv_heads, -1), form, cos, sin).transpose(1, 0, 2)
    v = v.reshape(n, kv_heads, -1).transpose(1, 0, 2)
    group, dim = heads // kv_heads, q.shape[-1]
    # (kv heads, tokens × group, head dim): query t's group of heads at rows t·group…
    grouped = q.reshape(n, kv_heads, group, dim).transpose(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    grouped = grouped * np.float32(attn.scale)
    span = cache.offset
    scores = np.empty((kv_heads, n * group, span + n), dtype=np.float32)
    if span:  # the cached keys and values, then the new ones (causal among them)
        keys = np.asarray(cache.keys)[0, :, :span]
        np.matmul(grouped, keys.swapaxes(-1, -2), out=scores[:, :, :span])
    np.matmul(grouped, k.swapaxes(-1, -2), out=scores[:, :, span:])
    later = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)  # token t sees new ≤ t
    scores[:, :, span:] += np.repeat(later, group, axis=0)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores[:, :, span:], v)
    if span:
        out += np.matmul(scores[:, :, :span], np.asarray(cache.values)[0, :, :span])
    out = out.reshape(kv_heads, n, group, -1).transpose(1, 0, 2, 3)
    return out.reshape(n, -1), (k, v)
