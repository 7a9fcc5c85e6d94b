"""What the numpy decoding step (:mod:`.decode`) reads of a llama-family model, looked up
once a step.

A layer of the step multiplies by seven weights as stored (:class:`~.stored.Stored`),
scales by two norms' weights and adds the biases of the layers that have them; looked up
in mlx-lm's module tree where each is used, and again to check beforehand that numpy reads
them all, they cost about 0.5 ms of a 22 ms step of qwen2.5-0.5b at 4 bits. :func:`gather`
looks each up once, checking it as it goes, and hands the step plain objects; made once
for a model and kept while its module tree holds the same modules and arrays (made, they
cost 0.7-1.5 ms of a 12-17 ms step; checked, a few tens of µs).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvchat.engine.cpu.linear import param_view, projections
from kvchat.engine.cpu.stored import Stored, stored

# an RMSNorm as the step applies it: its weight as float32 and its epsilon
Norm = tuple[np.ndarray, float]


@dataclass(frozen=True)
class Linear:
    """A linear layer as the step applies it: its weight as stored, its bias as float32."""

    weights: Stored
    bias: np.ndarray | None


@dataclass(frozen=True)
class Whole:
    """A layer's seven matrices (q, k, v, o, gate, up, down) as the native kernels take them
    (:attr:`~.stored.Stored.kernel_args`) and their biases: what ``packed.layers`` computes
    a whole layer with (see :mod:`.decode`)."""

    matrices: tuple[tuple[np.ndarray | int, ...], ...]
    biases: tuple[np.ndarray | None, ...]


@dataclass(frozen=True)
class Layer:
    """What the step reads of one decoder layer; ``whole`` where the native kernels read
    all its matrices (none of them float32)."""

    attention_norm: Norm
    qkv: tuple[Linear, Linear, Linear]
    o: Linear
    mlp_norm: Norm
    gate_up: tuple[Linear, Linear]
    down: Linear
    whole: Whole | None


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
    linears = [_linear(m) for m in projections(layer)]
    whole = None
    if all(linear.weights.form != "float32" for linear in linears):
        whole = Whole(
            tuple(linear.weights.kernel_args for linear in linears),
            tuple(linear.bias for linear in linears),
        )
    q, k, v, o, gate, up, down = linears
    return Layer(
        _norm(layer.input_layernorm),
        (q, k, v),
        o,
        _norm(layer.post_attention_layernorm),
        (gate, up),
        down,
        whole,
    )


# what a module's entries may hold that the step reads: its arrays (None where it has none)
ARRAYS = ("weight", "bias", "scales", "biases")
MLP = ("gate_proj", "up_proj", "down_proj")


class _Made:
    """A model's Weights and every lookup in its module tree that made them: (module, key,
    what it held), each module a dict (``nn.Module``), checked again in a few tens of
    microseconds at each step (a module given a new array, a layer given a new module, a
    bias added, all make the Weights anew)."""

    def __init__(self, body: nn.Module, extra: tuple[nn.Module, ...], weights: Weights) -> None:
        self.weights, self.extra, self.layers = weights, extra, list(body.layers)
        self.modules: list[nn.Module] = []
        self.keys: list[str] = []
        self.held: list[Any] = []
        for module in extra:
            self._arrays(module)
        for name in ("embed_tokens", "norm"):
            self._arrays(self._child(body, name))
        for layer in self.layers:
            attn, mlp = self._child(layer, "self_attn"), self._child(layer, "mlp")
            for name in ("input_layernorm", "post_attention_layernorm"):
                self._arrays(self._child(layer, name))
            for parent, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, MLP)):
                for name in names:
                    self._arrays(self._child(parent, name))

    def _child(self, module: nn.Module, key: str) -> Any:
        self.modules.append(module)
        self.keys.append(key)
        self.held.append(dict.get(module, key))
        return self.held[-1]

    def _arrays(self, module: nn.Module) -> None:
        for key in ARRAYS:
            self._child(module, key)

    def holds(self, body: nn.Module, extra: tuple[nn.Module, ...]) -> bool:
        """Whether ``body`` (and ``extra``) hold what the Weights were made of."""
        return (
            len(extra) == len(self.extra)
            and all(map(operator.is_, extra, self.extra))
            and len(body.layers) == len(self.layers)
            and all(map(operator.is_, body.layers, self.layers))
            and all(map(operator.is_, map(dict.get, self.modules, self.keys), self.held))
        )


# id(body) -> what gather made of it: dropped with the body
_MADE: dict[int, _Made] = {}


def gather(
    body: nn.Module, caches: list[list[Any]], extra: tuple[nn.Module, ...] = ()
) -> Weights | None:
    """What the step reads of ``body``, or None where numpy does not read it all (a weight
    of another form, a norm's weight or a bias with no float32 form, in ``body`` or among
    the ``extra`` modules' weights) or a cache holds other than float32: checked before
    the step touches a cache, so a refusal leaves nothing half done."""
    if any(c.keys is not None and _dtype(c.keys) != mx.float32 for row in caches for c in row):
        return None
    made = _MADE.get(id(body))
    if made is not None and made.holds(body, extra):
        return made.weights
    try:
        for module in extra:
            matrix(module)
        weights = Weights(
            matrix(body.embed_tokens), [_layer(layer) for layer in body.layers], _norm(body.norm)
        )
    except Unread:
        return None
    if made is None:
        weakref.finalize(body, _MADE.pop, id(body), None)
    _MADE[id(body)] = _Made(body, extra, weights)
    return weights


def _dtype(keys: mx.array | tuple[mx.array, ...]) -> mx.Dtype:
    """The dtype of a cache's keys: a quantized cache's scales (its values' dtype)."""
    return keys[1].dtype if isinstance(keys, (tuple, list)) else keys.dtype
