"""Linear layers for the CPU backend: matmuls through numpy's BLAS.

mlx's CPU matmul goes through whatever ``cblas_sgemm`` the process resolves
(Debian's OpenBLAS 0.3.21 here, see :mod:`kvchat.blas`), which is at its best
for large products but slow for the few rows of a cached turn and for the one
row of decoding: a matrix-vector product streams the weights at about 14 GB/s
against about 45 GB/s through numpy's bundled OpenBLAS. These layers take over
mlx-lm's (:func:`replace`, a tree walk as ``mlx.nn.quantize`` does): they hold
the same parameters (the same names and arrays, so loading, saving and
``update`` see nothing new) and compute ``x @ Wᵀ + b`` with numpy on a
zero-copy view of the weight while their model's :class:`~.FastPath` is on.

Quantized layers can be dequantized to float32 at load, since mlx's CPU
``quantized_matmul`` runs at about 3 GFLOP/s whatever the row count: a 4-bit
model then runs at its float32 twin's speed, in its memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path

from kvchat.engine.cpu import native
from kvchat.engine.cpu.attention import as_numpy

if TYPE_CHECKING:
    from kvchat.engine.cpu import FastPath

# Up to this many rows (a cached turn's new tokens, the short prompts a batched step
# takes), ``(W · xᵀ)ᵀ`` beats ``x · Wᵀ`` through numpy's OpenBLAS. qwen2.5-0.5b's
# projections on 2 cores, the two taking turns, medians of 5: 11–20% faster at 96 to 192
# rows (every time), about 10% at 256 and 384 (3 times in 5), level at 512 and 1024.
SKINNY_ROWS = 256
# From 2 to this many rows (a batched decoding step) the native kernel of rows.c reads the
# weights once for all rows. qwen2.5-0.5b's projections on 2 cores, numpy's OpenBLAS in the
# same run: 72 against 147 ms for 2 rows, 94–101 against 159 ms for 8, 114 against 185 for
# 9, 158–166 against 162–180 ms for 16 (level); one row's gemv, 62–64 ms, stays BLAS's.
KERNEL_ROWS = 16
Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def kernel() -> Kernel | None:
    """The native few-row kernel's ``matmul_t(w, x, out)`` (``out = x @ w.T``), or None
    where it was not built or is switched off (:mod:`.native`)."""
    rows = native.module("rows")
    return None if rows is None else cast(Kernel, rows.matmul_t)


# (id(module), name) -> (the array, its numpy view): kept beside the modules rather than
# written into them, since norms and embeddings are mlx-lm's own objects; an entry goes
# when its module does (weakref.finalize), and holding the array keeps its id unique.
VIEWS: dict[tuple[int, str], tuple[mx.array, np.ndarray | None]] = {}


def param_view(module: nn.Module, name: str = "weight") -> np.ndarray | None:
    """A numpy view of ``module``'s parameter ``name``, made once per array."""
    array = module[name]
    key = (id(module), name)
    cached = VIEWS.get(key)
    if cached is None:
        weakref.finalize(module, VIEWS.pop, key, None)
    if cached is None or cached[0] is not array:
        cached = VIEWS[key] = (array, as_numpy(array))
    return cached[1]


def _kernel_for(n: int) -> Kernel | None:
    """The native kernel where :func:`product` takes it for ``n`` rows (by a C-contiguous
    weight), else None."""
    return kernel() if 2 <= n <= KERNEL_ROWS else None


def through_kernel(n: int) -> bool:
    """Whether :func:`product` multiplies ``n`` rows (by a C-contiguous weight) with the
    native kernel, on OpenMP's threads, rather than with BLAS on its own."""
    return _kernel_for(n) is not None


def product(w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``rows @ wᵀ`` for ``(n, in)`` rows, by the fastest route for ``n``
    (see KERNEL_ROWS, SKINNY_ROWS)."""
    out: np.ndarray
    n = rows.shape[0]
    if n == 1:
        out = (w @ rows[0])[None]  # a matrix-vector product: BLAS gemv
    elif w.flags.c_contiguous and (matmul_t := _kernel_for(n)) is not None:
        out = np.empty((n, w.shape[0]), dtype=np.float32)
        matmul_t(w, np.ascontiguousarray(rows), out)
    elif n <= SKINNY_ROWS:
        out = (w @ rows.T).T  # the weight as the long side of the product
    else:
        out = rows @ w.T
    return out


def _matmul_t(x: mx.array, layer: nn.Module) -> mx.array | None:
    """``x @ layer.weightᵀ`` through numpy, or None when numpy cannot take it."""
    if not layer.fast.on:
        return None
    xn, w = as_numpy(x), param_view(layer)
    if xn is None or w is None:
        return None
    out = product(w, xn.reshape(-1, xn.shape[-1]))
    return mx.array(out.reshape(*xn.shape[:-1], w.shape[0]))


class CpuLinear(nn.Linear):
    """``nn.Linear`` whose product runs through numpy while ``fast`` is on."""

    def __init__(self, weight: mx.array, bias: mx.array | None, fast: FastPath):
        nn.Module.__init__(self)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self.fast = fast  # the model's FastPath (a plain attribute: not a child module)

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul_t(x, self)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class CpuOutput(CpuLinear):
    """The output projection (``lm_head``): through numpy for one row only.

    A prefill evaluates only the cache, so mlx never computes the logits of its
    rows as long as they stay lazy; numpy would compute them all (a third of a
    small model's prefill work). Decoding asks for one row, which numpy runs.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) != 1:
            return nn.Linear.__call__(self, x)
        return super().__call__(x)


class CpuEmbedding(nn.Embedding):
    """``nn.Embedding`` whose tied output projection runs like :class:`CpuOutput`."""

    def __init__(self, weight: mx.array, fast: FastPath):
        nn.Module.__init__(self)
        self.weight = weight
        self.fast = fast

    def as_linear(self, x: mx.array) -> mx.array:
        y = _matmul_t(x, self) if _rows(x) == 1 else None
        if y is not None:
            return y
        # mlx leaves nn.Embedding.as_linear unannotated
        out: mx.array = super().as_linear(x)  # type: ignore[no-untyped-call]
        return out


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


def _dequantized(layer: nn.Module) -> mx.array:
    return mx.dequantize(
        layer.weight,
        layer.scales,
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    ).astype(mx.float32)


def _cpu_layer(path: str, layer: nn.Module, dequantize: bool, fast: FastPath) -> nn.Module:
    """The CPU layer that takes ``layer``'s place (``layer`` itself when none does)."""
    output = path.rsplit(".", 1)[-1] == "lm_head"
    linear = CpuOutput if output else CpuLinear
    bias = layer.get("bias")
    if type(layer) is nn.Linear:
        return linear(layer.weight, bias, fast)
    if type(layer) is nn.Embedding:
        return CpuEmbedding(layer.weight, fast)
    if dequantize and type(layer) is nn.QuantizedLinear:
        return linear(_dequantized(layer), None if bias is None else bias.astype(mx.float32), fast)
    if dequantize and type(layer) is nn.QuantizedEmbedding:
        return CpuEmbedding(_dequantized(layer), fast)
    return layer


def replace(model: nn.Module, dequantize: bool, fast: FastPath) -> int:
    """Give ``model`` CPU linear layers (dequantizing packed ones if asked) that compute
    through numpy while ``fast.on``. Returns how many quantized layers were dequantized."""

    def packed() -> int:
        return sum(
            isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules()
        )

    before = packed()
    leaves = tree_map_with_path(
        lambda path, m: _cpu_layer(path, m, dequantize, fast),
        model.leaf_modules(),
        is_leaf=nn.Module.is_module,
    )
    model.update_modules(leaves)
    mx.eval(model.parameters())
    return before - packed()


def projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A llama-family decoder layer's seven linear layers: attention's, then the MLP's."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )
