"""kvchat's own attention, MLP and model body for llama-family models.

Each takes the place of mlx-lm's module (see :func:`kvchat.engine.cpu.prepare`),
holding the same submodules and parameters under the same names, and computes
what mlx-lm's ``llama``/``qwen2`` modules compute:

- :class:`Attention` sends the scores to numpy (:func:`.attention.sdpa`) while the
  model's :class:`~.FastPath` is on and to mlx-lm's attention otherwise, and reads a
  :class:`~kvchat.engine.caches.rotated.RotatedKVCache` through the cache's own
  ``attention`` (queries turned by its rotation, the output turned back) on any
  device;
- :class:`MLP` computes SwiGLU in numpy (:func:`.attention.swiglu`);
- :class:`Body` (the model's inner module) runs one token of a plain cache through
  the numpy decoding step (:mod:`.decode`), anything else layer by layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from kvchat.engine.caches.rotated import RotatedKVCache
from kvchat.engine.cpu import attention, decode

if TYPE_CHECKING:
    from kvchat.engine.cpu.fast_path import FastPath
    from kvchat.engine.cpu.rope import RopeForm


def _on(fast: FastPath | None) -> bool:
    return fast is not None and fast.on


class Attention(nn.Module):
    """mlx-lm's llama/qwen2 attention, computed through numpy while ``fast`` is on."""

    reads_rotated_cache = True  # what kvchat.engine.caches.rotated asks of a model's attention

    def __init__(
        self, stock: nn.Module, fast: FastPath | None, rope_form: RopeForm | str | None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves Module.__init__ bare
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"):
            setattr(self, name, stock[name])
        self.n_heads, self.n_kv_heads, self.scale = stock.n_heads, stock.n_kv_heads, stock.scale
        self.fast = fast  # the model's FastPath, or None (mlx's arithmetic on any device)
        self.rope_form = rope_form  # what the numpy decoding step needs of the RoPE

    def __call__(
        self, x: mx.array, mask: mx.array | str | None = None, cache: Any = None
    ) -> mx.array:
        b, length, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(b, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        if isinstance(cache, RotatedKVCache):
            out = cache.attention(queries, keys, values, self.scale, mask, self._sdpa)
        else:
            out = self._sdpa(queries, keys, values, cache, scale=self.scale, mask=mask)
        projected: mx.array = self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))
        return projected

    def _sdpa(
        self,
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if _on(self.fast) and sinks is None:
            out = attention.sdpa(queries, *_unpacked(keys, values, cache), scale, mask)
            if out is not None:
                return out
        # mlx-lm annotates mask as an array; it takes "causal" too, as its own models pass
        stock_mask = cast("mx.array | None", mask)
        return scaled_dot_product_attention(
            queries, keys, values, cache, scale=scale, mask=stock_mask, sinks=sinks
        )


def _unpacked(keys: Any, values: Any, cache: Any) -> tuple[mx.array, mx.array]:
    """A quantized cache's keys and values dequantized (to its scales' dtype: float32 for a
    float32 model), for numpy's attention: mlx's CPU ``quantized_matmul``, which mlx-lm's
    quantized attention uses, runs at about 3 GFLOP/s, and dequantizing 8k tokens of a
    layer takes about a millisecond. Other caches' arrays as they are."""
    if not hasattr(cache, "bits"):
        return keys, values
    key_array, value_array = (
        mx.dequantize(packed[0], packed[1], packed[2], group_size=cache.group_size, bits=cache.bits)
        for packed in (keys, values)
    )
    return key_array, value_array


class MLP(nn.Module):
    """mlx-lm's SwiGLU MLP, its activation through numpy while ``fast`` is on."""

    def __init__(self, stock: nn.Module, fast: FastPath | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves Module.__init__ bare
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, stock[name])
        self.fast = fast

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        out = attention.swiglu(gate, up) if _on(self.fast) else None
        down: mx.array = self.down_proj(swiglu(gate, up) if out is None else out)
        return down


class Body(nn.Module):
    """A llama-family model's inner module (``model.model``): embedding, blocks, norm."""

    def __init__(self, stock: nn.Module, fast: FastPath) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves Module.__init__ bare
        self.args = stock.args
        self.embed_tokens, self.layers, self.norm = stock.embed_tokens, stock.layers, stock.norm
        self.fast = fast

    @property
    def pipeline_layers(self) -> list[nn.Module]:
        """The layers this process runs (qwen2's ``Model.layers`` reads them): all of them."""
        layers: list[nn.Module] = self.layers
        return layers

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        if (
            input_embeddings is None
            and cache is not None
            and tuple(inputs.shape) == (1, 1)
            and self.fast.decodes
            and decode.takes(cache)
        ):
            token = cast(int, inputs.item())  # the one token id of an integer array
            rows = decode.hidden(self, [[token]], [cache])
            if rows is not None:
                return mx.array(rows[:, None])
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        normed: mx.array = self.norm(h)
        return normed
