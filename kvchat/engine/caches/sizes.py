"""What a cache kind costs a model: the bytes one token adds to its cache, from the
model's shape (no cache is made)."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvchat.engine.caches.kinds import group_size, parse_kind


def model_kv_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, bytes per element) of a model's attention cache."""
    args = getattr(model, "args", None)
    layers = len(getattr(model, "layers", []))
    heads: int = getattr(args, "num_key_value_heads", 0) or getattr(args, "num_attention_heads", 1)
    head_dim: int = getattr(args, "head_dim", None) or (
        getattr(args, "hidden_size", 0) // max(1, getattr(args, "num_attention_heads", 1))
    )
    size = 4
    # (path, array) pairs: mlx's annotation also allows the dict it fills when given one
    for _, value in cast(list[tuple[str, Any]], tree_flatten(model.parameters())):
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            size = value.dtype.size
            break
    return layers, heads, head_dim, size


def kind_bytes_per_token(model: nn.Module, kind_name: str) -> float:
    """Bytes one token adds to a cache of ``kind_name``, computed from the model's shape:
    layers × kv heads × head dim × 2 (keys and values) × bytes per element; quantized
    and rotated kinds store ``bits/8`` bytes per element plus a scale and a bias per group
    (of 64, or 32 where the head size needs it)."""
    layers, heads, head_dim, size = model_kv_shape(model)
    elements = layers * heads * head_dim * 2
    kind = parse_kind(kind_name)
    if kind.quantized and kind.size is not None:  # its family takes a size: it has one
        return elements * (kind.size / 8 + 2 * size / group_size(model, kind))
    return float(elements * size)
