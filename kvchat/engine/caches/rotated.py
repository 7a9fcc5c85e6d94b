"""The ``rotated:4`` and ``rotated:8`` cache kinds: quantized keys and values after a
fixed randomized Hadamard rotation over the head dimension.

Outliers in a few channels of the keys set the scale of every 64-value group
they fall in, and at 4 bits that costs the other values most of their precision.
Multiplying each key and value vector by an orthogonal matrix ``R`` (a Hadamard
matrix scaled to unit rows, its rows' signs flipped at random with a fixed seed)
spreads every channel over all of them before :class:`QuantizedKVCache`
quantizes them (llama.cpp PR #20995 does the same). Attention is unchanged up to
quantization: queries are rotated by the same ``R``, since ``(qR)(kR)ᵀ = qkᵀ``,
and the output, a mix of rotated values, is rotated back by ``Rᵀ``.

:meth:`RotatedKVCache.attention` needs the attention call itself: an attention
module that reads these caches (kvchat's own, :class:`kvchat.engine.cpu.layers.Attention`,
which llama-family models get on every device) says so with a true
``reads_rotated_cache``, and :func:`unreadable` names a model whose attention does
not (mlx-lm's own would read the rotated keys with unrotated queries). The rotation
is not part of the saved state (it depends only on the head dimension); a saved
cache is read back by :func:`kvchat.engine.caches.loading.load_prompt_cache`, which
knows this class by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

SEED = 20995


@cache
def rotation(dim: int) -> mx.array:
    """The fixed ``dim``×``dim`` orthogonal matrix (float32): a normalised Sylvester
    Hadamard matrix with seeded random row signs, or a seeded random orthogonal matrix
    when ``dim`` is not a power of two."""
    rng = np.random.default_rng(SEED)
    signs = rng.choice([-1.0, 1.0], size=dim)
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        h /= np.sqrt(dim)
    else:
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        h = q * np.sign(np.diag(r))
    return mx.array(signs[:, None] * h, dtype=mx.float32)


def rotate(x: mx.array) -> mx.array:
    return x @ rotation(x.shape[-1]).astype(x.dtype)


def unrotate(x: mx.array) -> mx.array:
    return x @ rotation(x.shape[-1]).T.astype(x.dtype)


def unreadable(model: nn.Module) -> str | None:
    """None when every attention layer of ``model`` reads a :class:`RotatedKVCache`, else
    why not, in a phrase."""
    for i, layer in enumerate(getattr(model, "layers", None) or []):
        attn = getattr(layer, "self_attn", None)
        if not getattr(attn, "reads_rotated_cache", False):
            name = type(attn).__name__ if attn is not None else "no attention module"
            return f"layer {i}'s attention ({name}) does not rotate its queries"
    return None


class RotatedKVCache(QuantizedKVCache):
    """A :class:`QuantizedKVCache` of rotated keys and values (see the module)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        keys, values = rotate(keys), rotate(values)
        # mlx-lm leaves QuantizedKVCache.update_and_fetch unannotated
        return super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]

    def attention(
        self,
        queries: mx.array,
        keys: Any,
        values: Any,
        scale: float,
        mask: mx.array | str | None,
        sdpa: Callable[..., mx.array],
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention over this cache's (rotated, quantized) ``keys`` and ``values``
        through ``sdpa`` (an attention for quantized caches: numpy's on the CPU fast
        path, mlx-lm's otherwise), for unrotated ``queries``."""
        out = sdpa(rotate(queries), keys, values, self, scale=scale, mask=mask, sinks=sinks)
        return unrotate(out)
