"""Mixture-of-experts layers on the CPU: only the experts a step's tokens chose are read.

mlx-lm's ``SwitchGLU`` holds every expert of a layer stacked in one array per
projection (``(experts, out, in)``, packed by ``QuantizedSwitchLinear`` or as
stored by ``SwitchLinear``) and multiplies through ``gather_qmm`` / ``gather_mm``,
which on the CPU widen what they read at about 3 GFLOP/s. :class:`Experts` takes
its place (:func:`replace`, a tree walk with ``update_modules`` as ``nn.quantize``
does; the same parameter names and arrays): the rows are grouped by the expert
they chose, and each chosen expert's three matrices are multiplied as stored
(:class:`~kvchat.engine.cpu.stored.Stored`, a view of expert ``e``'s slice of the
stacked arrays), so a decoding step reads the chosen experts' weights and no
others. Activations are float32.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

from kvchat.engine.cpu.attention import as_numpy, swiglu_rows
from kvchat.engine.cpu.stored import Stored, products, stored

if TYPE_CHECKING:
    from kvchat.engine.cpu.fast_path import FastPath

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # Slices' order


class Experts(SwitchGLU):
    """``SwitchGLU`` whose chosen experts are multiplied through :class:`Stored` while
    its model's ``fast`` is on; mlx's own ``gather_qmm`` otherwise."""

    def __init__(self, stock: SwitchGLU, fast: FastPath) -> None:
        nn.Module.__init__(self)
        self.gate_proj = stock.gate_proj
        self.up_proj = stock.up_proj
        self.down_proj = stock.down_proj
        self.activation = stock.activation
        self.fast = fast  # the model's FastPath (a plain attribute: not a child module)
        self.views = Slices(*(_stacked(stock[name]) for name in PROJECTIONS))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        xn = as_numpy(x if x.dtype == mx.float32 else x.astype(mx.float32))
        if not self.fast.on or xn is None:
            out: mx.array = super().__call__(x, indices)
            return out
        chosen = np.asarray(indices).astype(np.int64)
        rows = xn.reshape(-1, xn.shape[-1])
        return mx.array(self.views.apply(rows, chosen).reshape(*chosen.shape, rows.shape[1]))


class Slices:
    """A layer's three stacked projections as stored, sliced into one :class:`Stored`
    per expert on first use (views of the stacked arrays, no copy)."""

    def __init__(self, *whole: Stored | None) -> None:
        assert all(w is not None for w in whole)
        self.whole = [w for w in whole if w is not None]
        self.experts = int(self.whole[0].data.shape[0])
        self.made: dict[tuple[int, int], Stored] = {}

    def expert(self, p: int, e: int) -> Stored:
        """Projection ``p`` (gate, up, down) of expert ``e``."""
        made = self.made.get((p, e))
        if made is None:
            whole = self.whole[p]
            made = self.made[(p, e)] = dataclasses.replace(
                whole,
                data=whole.data[e],
                scales=None if whole.scales is None else whole.scales[e],
                biases=None if whole.biases is None else whole.biases[e],
            )
        return made

    def apply(self, rows: np.ndarray, chosen: np.ndarray) -> np.ndarray:
        """Each row through each expert it chose: ``rows`` ``(n, dim)`` float32 and
        ``chosen`` ``(..., k)`` expert ids, n · k in all; gives ``(n · k, dim)``, the
        rows' choices in order. The choices are sorted by expert (as mlx-lm's
        ``SwitchGLU`` sorts many), so each chosen expert is read once, for its run of
        rows, and the activation is one call for all."""
        k = chosen.shape[-1]
        flat = chosen.reshape(-1)  # choice c is row c // k's (c % k)-th
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=self.experts)
        ends = np.cumsum(counts).tolist()
        runs = [(e, ends[e] - int(counts[e]), ends[e]) for e in np.flatnonzero(counts).tolist()]
        h = rows[order // k]  # the rows in their choices' order
        hidden = int(self.whole[0].data.shape[1])
        gate = np.empty((flat.size, hidden), dtype=np.float32)
        up = np.empty_like(gate)
        for e, lo, hi in runs:  # gate and up in one native call where the kernels take both
            pair, x = (self.expert(0, e), self.expert(1, e)), h[lo:hi]
            gate[lo:hi], up[lo:hi] = products(pair, x) or [w.product(x) for w in pair]
        act = swiglu_rows(gate, up)
        done = np.empty((flat.size, rows.shape[1]), dtype=np.float32)
        for e, lo, hi in runs:
            done[lo:hi] = self.expert(2, e).product(act[lo:hi])
        out = np.empty_like(done)
        out[order] = done
        return out


def _stacked(layer: nn.Module) -> Stored | None:
    """A stacked expert projection ``(experts, out, in)`` as :class:`Stored` (its ``data``,
    ``scales`` and ``biases`` keep the experts' axis), or None when no kernel reads it."""
    whole = stored(layer)
    return whole if whole is not None and whole.data.ndim == 3 else None


def replace(model: nn.Module, fast: FastPath) -> int:
    """Give ``model`` :class:`Experts` in place of each ``SwitchGLU`` (SwiGLU activation,
    every projection in a form :class:`Stored` reads); returns how many."""
    found = [
        (parent, name, child)
        for _, parent in model.named_modules()
        for name, child in parent.children().items()
        if type(child) is SwitchGLU and isinstance(child.activation, SwiGLU)
    ]
    swapped = 0
    for parent, name, child in found:
        if all(_stacked(child[p]) is not None for p in PROJECTIONS):
            parent.update_modules({name: Experts(child, fast)})
            swapped += 1
    return swapped
