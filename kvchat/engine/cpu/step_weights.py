"""What the numpy decoding step (:mod:`.decode`) reads of a llama-family model, looked up
once a step.

A layer of the step multiplies by seven weights as stored (:class:`~.stored.Stored`),
scales by two norms' weights and adds the biases of the layers that have them; looked up
in mlx-lm's module tree where each is used, and again to check beforehand that numpy reads
them all, they cost about 0.5 ms of a 22 ms step of qwen2.5-0.5b at 4 bits. :func:`gather`
looks each up once, checking it as it goes, and hands the step plain objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvchat.engine.cpu.linear import param_view
from kvchat.engine.cpu.stored import Stored, stored

# an RMSNorm as the step applies it: its weight as float32 and its epsilon
Norm = tuple[np.ndarray, float]


@dataclass(frozen=True)
class Linear:
    """A linear layer as the step applies it: its weight as stored, its bias as float32."""

    weights: Stored
    bias: np.ndarray | None


@dataclass(frozen=True)
class Layer:
    """What the step reads of one decoder layer."""

    attention_norm: Norm
    qkv: tuple[Linear, Linear, Linear]
    o: Linear
    mlp_norm: Norm
    gate_up: tuple[Linear, Linear]
    down: Linear


@dataclass(frozen=True)
class Weights:
    """What the step reads of a model's body: its embedding, layers and final norm."""

    embedding: Stored
    layers: list[Layer]
    norm: Norm


class Unread(Exception):
    """A weight, norm or bias has no form numpy reads."""


def matrix(module: nn.Module) -> Stored:
    """A linear layer's or embedding's weight as stored; :class:`Unread` where numpy does
    not read it."""
    weights = stored(module)
    if weights is None:
        raise Unread(f"{type(module).__name__}'s weight is not one numpy reads")
    return weights


def _vector(module: nn.Module, name: str = "weight") -> np.ndarray:
    array = param_view(module, name)
    if array is None:
        raise Unread(f"{type(module).__name__}.{name} has no float32 numpy form")
    return array


def _norm(module: nn.Module) -> Norm:
    return _vector(module), float(module.eps)


def _linear(module: nn.Module) -> Linear:
    return Linear(matrix(module), _vector(module, "bias") if "bias" in module else None)


def _layer(layer: nn.Module) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return Layer(
        _norm(layer.input_layernorm),
        (_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)),
        _linear(attn.o_proj),
        _norm(layer.post_attention_layernorm),
        (_linear(mlp.gate_proj), _linear(mlp.up_proj)),
        _linear(mlp.down_proj),
    )


def gather(
    body: nn.Module, caches: list[list[Any]], extra: tuple[nn.Module, ...] = ()
) -> Weights | None:
    """What the step reads of ``body``, or None where numpy does not read it all (a weight
    of another form, a norm's weight or a bias with no float32 form, in ``body`` or among
    the ``extra`` modules' weights) or a cache holds other than float32: checked before
    the step touches a cache, so a refusal leaves nothing half done."""
    if any(c.keys is not None and _dtype(c.keys) != mx.float32 for row in caches for c in row):
        return None
    try:
        for module in extra:
            matrix(module)
        return Weights(
            matrix(body.embed_tokens), [_layer(layer) for layer in body.layers], _norm(body.norm)
        )
    except Unread:
        return None


def _dtype(keys: mx.array | tuple[mx.array, ...]) -> mx.Dtype:
    """The dtype of a cache's keys: a quantized cache's scales (its values' dtype)."""
    return keys[1].dtype if isinstance(keys, (tuple, list)) else keys.dtype
