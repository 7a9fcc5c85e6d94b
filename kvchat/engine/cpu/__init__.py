"""The CPU fast path: attention, SwiGLU and linear layers through numpy on the CPU backend.

mlx-lm's models take their attention function from ``mlx_lm.models.base``
and their SwiGLU from ``mlx_lm.models.activations``, by name at import time.
:func:`install` puts kvchat's functions in both places once (and in any model
module imported already); each calls :mod:`.attention` when the fast path is
active and falls back to mlx-lm's own otherwise, so Metal and CUDA, attention
sinks and other dtypes keep the stock path. Quantized caches are dequantized for
numpy's attention. Layers whose cache is a
:class:`~kvchat.engine.rotated.RotatedKVCache` go to that cache's ``attention``
on every device, which rotates around the same attention.
:func:`prepare` gives a loaded model numpy-backed linear layers and, for
Llama-family models, a decoding step computed in numpy (:mod:`.decode`).
``KVCHAT_CPU_FASTPATH=0`` turns all of it off.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.activations as activations
import mlx_lm.models.base as base

from ..rotated import RotatedKVCache
from . import attention, decode, linear, state

__all__ = ["hook", "install", "prepare", "describe", "set_active"]

_stock_sdpa = base.scaled_dot_product_attention
_stock_swiglu = activations.swiglu


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, through numpy when the fast path is active."""
    if isinstance(cache, RotatedKVCache):
        return cache.attention(queries, keys, values, scale, mask, _attend, sinks)
    return _attend(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _attend(queries, keys, values, cache, scale, mask, sinks=None):
    if state.active() and sinks is None:
        out = attention.sdpa(queries, *_unpacked(keys, values, cache), scale, mask)
        if out is not None:
            return out
    return _stock_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _unpacked(keys, values, cache) -> tuple:
    """A quantized cache's keys and values dequantized (to its scales' dtype: float32 for a
    float32 model), for numpy's attention: mlx's CPU ``quantized_matmul``, which mlx-lm's
    quantized attention uses, runs at about 3 GFLOP/s, and dequantizing 8k tokens of a
    layer takes about a millisecond. Other caches' arrays as they are."""
    if not hasattr(cache, "bits"):
        return keys, values
    return tuple(mx.dequantize(*packed, group_size=cache.group_size, bits=cache.bits)
                 for packed in (keys, values))


def swiglu(gate, x):
    """mlx-lm's SwiGLU, through numpy when the fast path is active."""
    if state.active():
        out = attention.swiglu(gate, x)
        if out is not None:
            return out
    return _stock_swiglu(gate, x)


def prepare(model: nn.Module, dequantize: bool) -> int:
    """Give ``model`` the CPU layers (:func:`.linear.prepare`) and the numpy decoding step
    where its architecture allows (:func:`.decode.attach`); returns how many quantized
    layers were dequantized."""
    dequantized = linear.prepare(model, dequantize)
    decode.attach(model)
    return dequantized


_modules_seen = 0  # len(sys.modules) at the last pass of hook()


def hook() -> None:
    """Put kvchat's functions in mlx-lm's place (idempotent); the fast path stays as it is.

    Model modules are patched as they appear: a call with no module imported since the
    last one returns at once (caches call this for every rotated layer they make).
    """
    global _modules_seen
    if len(sys.modules) == _modules_seen:
        return
    replacements = {
        "scaled_dot_product_attention": (_stock_sdpa, scaled_dot_product_attention),
        "swiglu": (_stock_swiglu, swiglu),
    }
    base.scaled_dot_product_attention = scaled_dot_product_attention
    activations.swiglu = swiglu
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        for attr, (stock, ours) in replacements.items():
            if getattr(module, attr, None) is stock:
                setattr(module, attr, ours)
    _modules_seen = len(sys.modules)


def install() -> bool:
    """Hook kvchat's functions into mlx-lm and turn the fast path on where it applies
    (the CPU backend, not disabled). Returns whether it is active."""
    hook()
    state.set_active(state.wanted())
    return state.active()


def set_active(on: bool) -> None:
    """Turn the fast path on or off at run time (tests and the bench compare both)."""
    state.set_active(on and state.wanted())


def describe() -> str:
    """One line for ``kvchat doctor``: whether models run with the fast path, and why not."""
    import os

    if os.environ.get(state.ENV, "1") == "0":
        return f"off ({state.ENV}=0)"
    if mx.default_device() != mx.cpu:
        return "off (MLX runs on the GPU: its own kernels are used)"
    if state.active() or state.wanted():
        return "on (numpy attention, SwiGLU, linear layers and decoding steps)"
    return "off"
