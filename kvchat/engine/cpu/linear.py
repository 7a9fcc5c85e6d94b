"""Linear and embedding layers for the CPU backend: products through numpy, weights as
stored.

mlx's CPU matmul goes through whatever ``cblas_sgemm`` the process resolves
(Debian's OpenBLAS 0.3.21 here, see :mod:`kvchat.blas`), which is at its best
for large products but slow for the few rows of a cached turn and for the one
row of decoding (a matrix-vector product streams the weights at about 14 GB/s
against about 45 GB/s through numpy's bundled OpenBLAS), and its
``quantized_matmul`` runs at about 3 GFLOP/s whatever the row count. These layers
take over mlx-lm's (:func:`replace`, a tree walk as ``mlx.nn.quantize`` does):
subclasses of ``nn.Linear``, ``nn.Embedding`` and their quantized twins that hold
the same parameters (the same names and arrays, so loading, saving and ``update``
see nothing new) and, while their model's :class:`~.FastPath` is on, compute with
the weight as stored (:mod:`.stored`): float32 through numpy's BLAS and the native
few-row kernel, 16-bit and packed weights through :class:`~.stored.Stored`'s
kernels, which never widen a whole weight. Their outputs are float32, so a 16-bit
or packed model's activations and KV cache are float32 as a float32 model's are.
A packed mode no kernel reads (``mxfp4``, ``nvfp4``, ``mxfp8``) keeps mlx-lm's layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path

from kvchat.engine.cpu import native
from kvchat.engine.cpu.attention import as_numpy
from kvchat.engine.cpu.stored import Stored, per_array, products, stored

if TYPE_CHECKING:
    from kvchat.engine.cpu.fast_path import FastPath

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
PACKED = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # mlx-lm's own packed layers


def kernel() -> Kernel | None:
    """The native few-row kernel's ``matmul_t(w, x, out)`` (``out = x @ w.T``), or None
    where it was not built or is switched off (:mod:`.native`)."""
    rows = native.module("rows")
    return None if rows is None else cast(Kernel, rows.matmul_t)


# (id(module), name) -> (the array, its float32 numpy form): kept beside the modules rather
# than written into them, since norms are mlx-lm's own objects; an entry goes when its
# module does (weakref.finalize), and holding the array keeps its id unique.
VIEWS: dict[tuple[int, str], tuple[mx.array, np.ndarray | None]] = {}


def param_view(module: nn.Module, name: str = "weight") -> np.ndarray | None:
    """``module``'s parameter ``name`` as float32 numpy, made once per array: a view of a
    float32 array; a widened copy of a 16-bit vector (a norm's weight, a bias: a few KiB,
    never a matrix); None for anything else."""
    array = module[name]
    return per_array(VIEWS, module, (id(module), name), array, lambda: _float32(array))


def _float32(array: mx.array) -> np.ndarray | None:
    if array.ndim == 1 and array.dtype in (mx.float16, mx.bfloat16):
        return np.asarray(array.astype(mx.float32))
    return as_numpy(array)


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


def multiply(weights: Stored, rows: np.ndarray) -> np.ndarray:
    """``rows @ Wᵀ`` for float32 rows ``(n, in)``: a float32 weight by :func:`product`'s
    routes, any other as stored (:meth:`Stored.product`)."""
    return product(weights.data, rows) if weights.form == "float32" else weights.product(rows)


def multiply_each(weights: Sequence[Stored], rows: np.ndarray) -> list[np.ndarray]:
    """``rows @ Wᵀ`` for each of several weights that share their rows: in one native call
    where the kernels take them all (:func:`~.stored.products`), else one by one
    (:func:`multiply`); the same figures either way."""
    together = products(weights, rows)
    return together if together is not None else [multiply(w, rows) for w in weights]


def _product(layer: nn.Module, x: mx.array) -> mx.array | None:
    """``x @ layer.weightᵀ`` (plus its bias) through numpy, or None where numpy does not
    take it: the fast path off, an output projection given several tokens a row (see
    :class:`CpuOutput`), an input other than float32, a weight no kernel reads."""
    if not layer.fast.on or (layer.head and _several(x)):
        return None
    weights, xn = stored(layer), as_numpy(x)
    if weights is None or xn is None:
        return None
    out = multiply(weights, xn.reshape(-1, xn.shape[-1]))
    y = mx.array(out.reshape(*xn.shape[:-1], weights.out_features))
    return y + layer["bias"] if "bias" in layer else y


def _lookup(layer: nn.Module, ids: mx.array) -> mx.array | None:
    """An embedding's rows for token ``ids`` as float32, gathered from the weight as stored
    (only those rows widened); None for a float32 weight (mlx's own lookup copies nothing)
    or where numpy does not take it."""
    weights = stored(layer) if layer.fast.on else None
    if weights is None or weights.form == "float32":
        return None
    try:
        at = np.asarray(ids)
    except (ValueError, RuntimeError, TypeError):  # a tracer inside mx.compile
        return None
    rows = weights.gather(at.reshape(-1))
    return mx.array(rows.reshape(*at.shape, weights.in_features))


class CpuLinear(nn.Linear):
    """``nn.Linear`` (weights of any float dtype) whose product runs through numpy while
    ``fast`` is on."""

    head = False  # an output projection (see CpuOutput)

    def __init__(self, weight: mx.array, bias: mx.array | None, fast: FastPath):
        nn.Module.__init__(self)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self.fast = fast  # the model's FastPath (a plain attribute: not a child module)

    def __call__(self, x: mx.array) -> mx.array:
        return _either(_product(self, x), super().__call__, x)


class CpuOutput(CpuLinear):
    """The output projection (``lm_head``): through numpy for one token a row.

    A prefill evaluates only the cache, so mlx never computes the logits of its
    tokens as long as they stay lazy; numpy would compute them all (a third of a
    small model's prefill work). A decoding step asks for one token a row (of one
    sequence or of a batch), which numpy runs.
    """

    head = True


class CpuQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (affine mode) whose product reads the packed weight through
    :class:`~.stored.Stored` while ``fast`` is on; ``layer``'s own arrays and settings."""

    head = False

    def __init__(self, layer: nn.QuantizedLinear, fast: FastPath):
        nn.Module.__init__(self)
        _hold_packed(self, layer)
        if "bias" in layer:
            self.bias = layer.bias
        self.fast = fast
        self.freeze()  # as nn.QuantizedLinear is

    def __call__(self, x: mx.array) -> mx.array:
        return _either(_product(self, x), super().__call__, x)


class CpuQuantizedOutput(CpuQuantizedLinear):
    """A packed output projection: through numpy for one token a row (see CpuOutput)."""

    head = True


def _hold_packed(layer: nn.Module, stock: nn.Module) -> None:
    """Give ``layer`` ``stock``'s packed weight, scales and biases and its settings."""
    layer.group_size, layer.bits, layer.mode = stock.group_size, stock.bits, stock.mode
    layer.weight, layer.scales, layer.biases = stock.weight, stock.scales, stock.biases


class CpuEmbedding(nn.Embedding):
    """``nn.Embedding`` (weights of any float dtype): 16-bit rows gathered and widened to
    float32, and its tied output projection, like :class:`CpuOutput`, through numpy."""

    head = True  # as_linear is the output projection

    def __init__(self, weight: mx.array, fast: FastPath):
        nn.Module.__init__(self)
        self.weight = weight
        self.fast = fast

    def __call__(self, x: mx.array) -> mx.array:
        return _either(_lookup(self, x), super().__call__, x)

    def as_linear(self, x: mx.array) -> mx.array:
        return _either(_product(self, x), super().as_linear, x)


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` (affine mode): the rows of a lookup dequantized from the
    packed weight to float32 as they are gathered, its tied output projection through
    :class:`~.stored.Stored` like :class:`CpuQuantizedOutput`."""

    head = True

    def __init__(self, layer: nn.QuantizedEmbedding, fast: FastPath):
        nn.Module.__init__(self)
        _hold_packed(self, layer)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.fast = fast
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return _either(_lookup(self, x), super().__call__, x)

    def as_linear(self, x: mx.array) -> mx.array:
        return _either(_product(self, x), super().as_linear, x)


def _either(ours: mx.array | None, stock: Callable[[mx.array], Any], x: mx.array) -> mx.array:
    """``ours`` where numpy computed it, else mlx's own ``stock(x)`` (mlx-lm's layer's
    method: the fast path off, or an input numpy does not take)."""
    out: mx.array = stock(x) if ours is None else ours
    return out


def _several(x: mx.array) -> bool:
    """Whether ``x`` ``(…, tokens, features)`` holds several tokens a row (a prompt)."""
    return x.ndim >= 2 and x.shape[-2] > 1


def _cpu_layer(path: str, layer: nn.Module, fast: FastPath) -> nn.Module:
    """The CPU layer that takes ``layer``'s place (``layer`` itself when none does: a
    packed mode no kernel reads stays mlx-lm's)."""
    output = path.rsplit(".", 1)[-1] == "lm_head"
    if type(layer) is nn.Linear:
        return (CpuOutput if output else CpuLinear)(layer.weight, layer.get("bias"), fast)
    if type(layer) is nn.Embedding:
        return CpuEmbedding(layer.weight, fast)
    if type(layer) is nn.QuantizedLinear and stored(layer) is not None:
        return (CpuQuantizedOutput if output else CpuQuantizedLinear)(layer, fast)
    if type(layer) is nn.QuantizedEmbedding and stored(layer) is not None:
        return CpuQuantizedEmbedding(layer, fast)
    return layer


def replace(model: nn.Module, fast: FastPath) -> list[str]:
    """Give ``model`` CPU linear and embedding layers that compute through numpy while
    ``fast.on``, each holding the arrays mlx-lm loaded (nothing widened or copied).
    Returns the packed modes of the layers left to MLX's own kernels (``mxfp4``...)."""
    leaves = tree_map_with_path(
        lambda path, m: _cpu_layer(path, m, fast),
        model.leaf_modules(),
        is_leaf=nn.Module.is_module,
    )
    model.update_modules(leaves)
    kept = {m.mode for m in model.modules() if type(m) in PACKED}
    return sorted(kept)


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
