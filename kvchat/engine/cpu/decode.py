"""One decoding step of a Llama-family model in numpy, one hand-off to mlx a token.

Decoding runs the model on one token at a time. Through mlx-lm's modules
with the numpy layers of this package, that step hands data between mlx and
numpy about a hundred times (every linear layer, attention and SwiGLU
evaluates its input), and each hand-off costs tens of microseconds of
synchronisation, which is as much as the arithmetic of a small model. Here
the whole step of a ``qwen2`` or ``llama`` model (RMSNorm, linear layers,
rotary embedding, grouped-query attention, SwiGLU) runs in numpy on views of
mlx's own parameters and of the cache's keys and values; only the cache
update stays mlx's: once every layer has read its cache, the new keys and
values go to ``cache.update_and_fetch`` in one evaluation, so the cache, its
ledger, trimming and saving see nothing new. A quantized cache is updated
first, a layer at a time, and read back dequantized (one hand-off a layer),
so the token attends to its own key as stored, as in mlx-lm.

:func:`attach` gives a model's inner module (``model.model``) a ``__call__``
that takes this path for one token, batch 1, ``standard``, ``concatenate``,
``quantized:N`` and ``rotated:N`` caches, while the fast path is active;
anything else (prefill, other caches or architectures, a layer numpy cannot
take) goes through mlx-lm's own code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

from .. import rotated
from ..rotated import RotatedKVCache
from . import state
from .linear import CpuEmbedding, CpuLinear, param_view

MODEL_TYPES = ("qwen2", "llama")  # blocks of x + attn(norm(x)), h + mlp(norm(h)), SwiGLU
# caches whose single-token mask is None
CACHES = (KVCache, ConcatenateKVCache, QuantizedKVCache, RotatedKVCache)


def _eligible(inner: nn.Module) -> bool:
    """``inner`` has the shape this step computes (checked once, at :func:`attach`)."""
    args = getattr(inner, "args", None)
    if getattr(args, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(inner, "pipeline_size", 1) != 1 or not isinstance(inner.embed_tokens, CpuEmbedding):
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if (getattr(layer, "use_sliding", False) or type(attn.rope) is not nn.RoPE
                or not all(type(m) is CpuLinear for m in linears)
                or not all(type(n) is nn.RMSNorm for n in
                           (layer.input_layernorm, layer.post_attention_layernorm))):
            return False
    return type(inner.norm) is nn.RMSNorm


def attach(model: nn.Module) -> bool:
    """Give ``model.model`` the numpy decoding step if its architecture has the shape;
    returns whether it did."""
    inner = getattr(model, "model", None)
    if inner is None or not _eligible(inner):
        return False
    cls = type(inner)
    if cls not in _SUBCLASSES.values():
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _call,
                                                           "__module__": cls.__module__})
        inner.__class__ = _SUBCLASSES[cls]
    return True


_SUBCLASSES: dict[type, type] = {}  # mlx-lm's class -> the same with the numpy step


def _call(self, inputs, cache=None, input_embeddings=None):
    out = None
    if (state.active() and input_embeddings is None and tuple(inputs.shape) == (1, 1)
            and cache is not None and all(type(c) in CACHES for c in cache)):
        out = step(self, inputs, cache)
    if out is None:
        return super(type(self), self).__call__(inputs, cache, input_embeddings)
    return out


def _rms(x: np.ndarray, norm: nn.RMSNorm) -> np.ndarray:
    scale = np.float32(1) / np.sqrt(np.dot(x, x) / np.float32(x.size) + np.float32(norm.eps))
    return (x * scale) * param_view(norm)


def _linear(layer: CpuLinear, x: np.ndarray) -> np.ndarray:
    y = param_view(layer) @ x
    return y + param_view(layer, "bias") if "bias" in layer else y


def _rotation(rope: nn.RoPE, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """mlx's own cosines and sines at ``offset``: rope applied to ones and zeros."""
    half = rope.dims // 2
    probe = np.zeros(rope.dims, dtype=np.float32)
    probe[slice(0, None, 2) if rope.traditional else slice(0, half)] = 1  # first of each pair
    turned = np.asarray(rope(mx.array(probe).reshape(1, 1, 1, -1), offset=offset)).reshape(-1)
    if rope.traditional:
        return turned[0::2].copy(), turned[1::2].copy()
    return turned[:half].copy(), turned[half:].copy()


def _rope(x: np.ndarray, rope: nn.RoPE, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first ``rope.dims`` features of each row of ``x`` (heads × head dim)."""
    out = x.copy()
    if rope.traditional:
        a, b = x[:, 0:rope.dims:2], x[:, 1:rope.dims:2]
        out[:, 0:rope.dims:2] = a * cos - b * sin
        out[:, 1:rope.dims:2] = a * sin + b * cos
    else:
        half = rope.dims // 2
        a, b = x[:, :half], x[:, half:rope.dims]
        out[:, :half] = a * cos - b * sin
        out[:, half:rope.dims] = a * sin + b * cos
    return out


def _attention(layer: nn.Module, x: np.ndarray, cache, turn) -> tuple[np.ndarray, ...]:
    """The layer's attention output for one token, and its new key and value for the
    caller to hand to the cache (None when they are stored already: a quantized cache
    stores them first, so that the token attends to its own key as stored, as in
    mlx-lm); the keys and values before it are read from the cache."""
    attn = layer.self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    cos, sin = turn
    q = _rope(_linear(attn.q_proj, x).reshape(heads, -1), attn.rope, cos, sin)
    k = _rope(_linear(attn.k_proj, x).reshape(kv_heads, -1), attn.rope, cos, sin)
    v = _linear(attn.v_proj, x).reshape(kv_heads, -1)
    grouped = q.reshape(kv_heads, heads // kv_heads, -1) * np.float32(attn.scale)
    turned = None  # a rotated cache's rotation R: keys, values and queries times R
    if isinstance(cache, QuantizedKVCache):
        keys, values = _stored(cache, k, v)
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
    if span:
        np.matmul(keys, grouped.swapaxes(-1, -2), out=scores[:, :span])
    if own:
        scores[:, span] = np.matmul(grouped, k[:, :, None])[..., 0]
    scores -= scores.max(axis=1, keepdims=True)
    np.exp(scores, out=scores)
    weights = scores.swapaxes(-1, -2)  # (kv heads, group, span + own)
    out = np.zeros((kv_heads, grouped.shape[1], v.shape[-1]), dtype=np.float32)
    if span:
        np.matmul(weights[..., :span], values, out=out)
    if own:
        out += weights[..., span:] * v[:, None, :]
    out /= weights.sum(axis=-1, keepdims=True)
    if turned is not None:  # a mix of rotated values, rotated back
        out = out @ turned.T
    if not own:
        k = v = None
    return _linear(attn.o_proj, out.reshape(-1)), k, v


def _stored(cache: QuantizedKVCache, k: np.ndarray, v: np.ndarray):
    """Store a token's key and value in a quantized cache, then read every key and value
    it holds back, dequantized (float32 for a float32 model), as ``(kv heads, tokens,
    head dim)``: what mlx-lm's quantized attention computes with."""
    keys, values = cache.update_and_fetch(mx.array(k[None, :, None]), mx.array(v[None, :, None]))
    if cache.bits not in (4, 8):
        full = [mx.dequantize(*packed, group_size=cache.group_size, bits=cache.bits)
                for packed in (keys, values)]
        mx.eval(full)
        return np.asarray(full[0])[0], np.asarray(full[1])[0]
    mx.eval(keys, values)
    return _dequantized(keys, cache.group_size, cache.bits), \
        _dequantized(values, cache.group_size, cache.bits)


def _dequantized(packed, group_size: int, bits: int) -> np.ndarray:
    """mlx's affine ``dequantize`` of 8- or 4-bit values in numpy (bit for bit; 15-20%
    faster a decoding step at 2k tokens than mlx's): each uint32 holds 4 or 8 values,
    lowest bits first, and each group of ``group_size`` has a scale and a bias."""
    data, scales, biases = (np.asarray(x)[0] for x in packed)
    codes = data.view(np.uint8)
    if bits == 4:
        nibbles = np.empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=np.uint8)
        np.bitwise_and(codes, 15, out=nibbles[..., 0::2])
        np.right_shift(codes, 4, out=nibbles[..., 1::2])
        codes = nibbles
    out = codes.reshape(*codes.shape[:-1], -1, group_size).astype(scales.dtype)
    out *= scales[..., None]
    out += biases[..., None]
    return out.reshape(*codes.shape)


def _mlp(mlp: nn.Module, x: np.ndarray) -> np.ndarray:
    gate = _linear(mlp.gate_proj, x)
    up = _linear(mlp.up_proj, x)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for very negative gates: silu is -0
        act = gate / (np.float32(1) + np.exp(-gate))
    return _linear(mlp.down_proj, act * up)


def _numpy_inputs(inner: nn.Module, cache: list) -> bool:
    """Every parameter the step reads has a float32 numpy view and the caches hold
    float32 (checked before the step touches a cache, so a refusal leaves nothing
    half done)."""
    if any(c.keys is not None and _dtype(c.keys) != mx.float32 for c in cache):
        return False
    views = [param_view(inner.embed_tokens), param_view(inner.norm)]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj, layer.input_layernorm,
                       layer.post_attention_layernorm):
            views.append(param_view(module))
            if "bias" in module:
                views.append(param_view(module, "bias"))
    return all(v is not None for v in views)


def _dtype(stored) -> mx.Dtype:
    """The dtype of a cache's keys: a quantized cache's scales (its values' dtype)."""
    return stored[1].dtype if isinstance(stored, (tuple, list)) else stored.dtype


def step(inner: nn.Module, inputs: mx.array, cache: list) -> mx.array | None:
    """The final hidden state ``(1, 1, D)`` after ``inputs`` (one token), or None when
    numpy cannot take the parameters (another dtype)."""
    if not _numpy_inputs(inner, cache):
        return None
    x = param_view(inner.embed_tokens)[int(inputs.item())].copy()
    turns: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    new: list[tuple[np.ndarray, np.ndarray]] = []
    for layer, c in zip(inner.layers, cache):
        rope = layer.self_attn.rope
        key = (rope.dims, rope.traditional, rope.base, rope.scale, c.offset)
        if key not in turns:
            turns[key] = _rotation(rope, c.offset)
        out, k, v = _attention(layer, _rms(x, layer.input_layernorm), c, turns[key])
        new.append((k, v))
        x = x + out
        x = x + _mlp(layer.mlp, _rms(x, layer.post_attention_layernorm))
    # The caches grow once all layers have read them: one evaluation for the step.
    mx.eval([c.update_and_fetch(mx.array(k[None, :, None]), mx.array(v[None, :, None]))
             for c, (k, v) in zip(cache, new) if k is not None])
    return mx.array(_rms(x, inner.norm)[None, None])
