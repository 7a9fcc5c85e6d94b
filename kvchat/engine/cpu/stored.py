"""Weights as their layers hold them, multiplied without ever being widened in memory.

A checkpoint's weights are float32, float16, bfloat16, or MLX's affine packed format
(``mx.quantize``: 2 to 8 bits a value, as one little-endian bit stream in ``uint32``
words, each group of ``group_size`` values along a row with its own scale and bias, so
that a value is ``scale · q + bias``). :class:`Stored` is one such matrix ``(out, in)``
seen through numpy views of the layer's own arrays (16-bit floats as their ``uint16``
bits, since numpy has no bfloat16), and :func:`stored` makes it once per array.

Its products take float32 rows and give float32 rows: decoding's few rows through the
native kernels (:mod:`.native`'s ``packed``, dequantizing in registers, the weights read
once for all rows), a prompt's many rows a tile of weight rows at a time (widened into a
small float32 buffer, then BLAS); several weights' products of the same rows (a layer's
q, k and v) in one call of the kernels (:func:`products`). Where the kernels were not
built, the tiles serve every row count: correct, and slower (``kvchat doctor`` says so).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvchat.engine.cpu import native

SCALE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}  # the kernels' codes
# A widened tile of weight rows, at most 16 MiB, the rows split evenly: 512 rows by
# qwen2.5-0.5b's 4864×896 at q4 took 19-24 ms (widening 1.5 ms of it) against 15 ms in
# float32; in tiles of ¼ Mi floats, 33-79 ms.
TILE_FLOATS = 1 << 22
# Up to this many rows the native kernel multiplies (the weights read once, widened in
# registers); more widen a tile of weight rows at a time for BLAS. qwen2.5-0.5b's
# 4864×896 and 896×4864 at q4 and bf16, 2 busy cores, best of 5: the kernel 1.2-3× faster
# at 16-128 rows, as often faster as slower at 256, 1.2-1.5× slower at 512.
KERNEL_ROWS = 256


@dataclass(frozen=True, eq=False)
class Stored:
    """One weight matrix ``(out, in)`` as stored: ``form`` is ``"float32"``, ``"float16"``,
    ``"bfloat16"`` or ``"affine"`` (packed ``bits`` a value, groups of ``group_size``;
    ``scales`` and ``biases`` ``(out, in / group_size)`` in ``scale_form``)."""

    data: np.ndarray  # float32 (out, in) | uint16 (out, in) | uint32 (out, in · bits / 32)
    form: str
    in_features: int
    bits: int = 0
    group_size: int = 0
    scales: np.ndarray | None = None  # float32, or uint16 bits of float16 / bfloat16
    biases: np.ndarray | None = None
    scale_form: str = "float32"

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes read to multiply by it once (the weights, scales and biases)."""
        extra = sum(a.nbytes for a in (self.scales, self.biases) if a is not None)
        return int(self.data.nbytes) + extra

    def describe(self, brief: bool = False) -> str:
        """How it is held, in a phrase: ``4-bit, groups of 64, kept packed``; ``brief``, in
        a narrow panel's words: ``4-bit packed``, ``bfloat16``."""
        if self.form == "affine":
            if brief:
                return f"{self.bits}-bit packed"
            return f"{self.bits}-bit, groups of {self.group_size}, kept packed"
        return self.form if self.form == "float32" or brief else f"{self.form}, kept as stored"

    def widened(self, lo: int, hi: int) -> np.ndarray:
        """Weight rows ``lo … hi − 1`` as float32 ``(hi − lo, in)``, in a new array."""
        return self.gather(np.arange(lo, hi, dtype=np.int64))

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Weight rows ``ids`` as float32 ``(len(ids), in)`` (an embedding's lookup)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        kernels = native.module("packed")
        if kernels is None or self.form == "float32":
            return self._gathered(ids)
        out = np.empty((len(ids), self.in_features), dtype=np.float32)
        widen = kernels.affine_rows if self.form == "affine" else kernels.half_rows
        widen(*self.kernel_args, ids, out)
        return out

    def product(self, x: np.ndarray) -> np.ndarray:
        """``x @ Wᵀ`` for float32 rows ``x`` ``(n, in)``: ``(n, out)`` float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        kernels = native.module("packed")
        if kernels is not None and self.form != "float32" and 0 < x.shape[0] <= KERNEL_ROWS:
            multiply = kernels.affine_t if self.form == "affine" else kernels.half_t
            multiply(*self.kernel_args, x, out)
            return out
        tiles = -(-self.out_features * self.in_features // TILE_FLOATS)  # even tiles
        step = max(1, -(-self.out_features // max(1, tiles)))
        for lo in range(0, self.out_features, step):
            hi = min(lo + step, self.out_features)
            np.matmul(x, self.widened(lo, hi).T, out=out[:, lo:hi])
        return out

    @functools.cached_property
    def kernel_args(self) -> tuple[np.ndarray | int, ...]:
        """The native kernels' first arguments, the matrix and how it is held: ``affine_t``'s
        six (a packed matrix), ``half_t``'s two (a 16-bit one)."""
        if self.form != "affine":
            return self.data, SCALE_KINDS[self.form]
        assert self.scales is not None and self.biases is not None
        kind = SCALE_KINDS[self.scale_form]
        return self.data, self.scales, self.biases, kind, self.bits, self.group_size

    def _gathered(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`gather` in numpy (the kernels' reference, and their fallback)."""
        if self.form == "float32":
            return np.asarray(self.data[ids], dtype=np.float32)
        if self.form != "affine":
            return _widen(self.data[ids], self.form)
        assert self.scales is not None and self.biases is not None
        codes = _codes(self.data[ids], self.bits).astype(np.float32)
        groups = codes.reshape(len(ids), -1, self.group_size)
        scales = _widen(self.scales[ids], self.scale_form)[..., None]
        biases = _widen(self.biases[ids], self.scale_form)[..., None]
        out: np.ndarray = (groups * scales + biases).reshape(len(ids), self.in_features)
        return out


def products(weights: Sequence[Stored], x: np.ndarray) -> list[np.ndarray] | None:
    """``x @ Wᵀ`` for each of several weights that share their rows ``x`` (a layer's q, k
    and v; its gate and up) in one call of the native kernels, which wakes their threads
    once (each result the same, bit for bit, as :meth:`Stored.product`'s); None where the
    kernels do not take them all (not built, a float32 weight, too many rows)."""
    kernels = native.module("packed")
    n = x.shape[0]
    if kernels is None or not 0 < n <= KERNEL_ROWS or any(w.form == "float32" for w in weights):
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    outs = [np.empty((n, w.out_features), dtype=np.float32) for w in weights]
    kernels.products_t([w.kernel_args for w in weights], x, outs)
    return outs


def _widen(bits16: np.ndarray, form: str) -> np.ndarray:
    """float16 or bfloat16 values given as their ``uint16`` bits (or float32 already), as
    float32."""
    if form == "float32":
        return np.asarray(bits16, dtype=np.float32)
    if form == "float16":
        return bits16.view(np.float16).astype(np.float32)
    wide: np.ndarray = (bits16.astype(np.uint32) << 16).view(np.float32)
    return wide


def _codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The ``bits``-bit values of each row of ``packed`` (``uint32``, one little-endian
    bit stream a row), as ``uint8`` ``(rows, values)``."""
    raw = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 8:
        return raw
    if bits == 4:
        out = np.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=np.uint8)
        np.bitwise_and(raw, 15, out=out[..., 0::2])
        np.right_shift(raw, 4, out=out[..., 1::2])
        return out
    stream = np.unpackbits(raw, axis=-1, bitorder="little")
    stream = stream.reshape(*raw.shape[:-1], -1, bits)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    values: np.ndarray = (stream * weights).sum(axis=-1, dtype=np.uint8)
    return values


def _bits16(array: mx.array) -> np.ndarray:
    """A numpy view of a 16-bit float array's bits (``uint16``)."""
    return np.asarray(array.view(mx.uint16))


def _numpy(array: mx.array) -> tuple[np.ndarray, str] | None:
    """A numpy view of ``array`` and its form, or None for a dtype no kernel reads."""
    if array.dtype == mx.float32:
        return np.asarray(array), "float32"
    if array.dtype in (mx.float16, mx.bfloat16):
        return _bits16(array), "float16" if array.dtype == mx.float16 else "bfloat16"
    return None


# id(module) -> (the weight array it was made from, the Stored), kept by per_array as
# linear.VIEWS is.
_MADE: dict[int, tuple[mx.array, Stored | None]] = {}


def stored(module: nn.Module) -> Stored | None:
    """``module``'s weight (an ``nn.Linear``'s, an ``nn.Embedding``'s, or their quantized
    twins', affine mode) as :class:`Stored`, made once per array; None for a format no
    kernel reads (``mxfp4``, ``nvfp4``, ``mxfp8``, another dtype)."""
    return per_array(_MADE, module, id(module), module["weight"], lambda: _make(module))


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def per_array(
    table: dict[K, tuple[mx.array, V]],
    module: nn.Module,
    key: K,
    array: mx.array,
    make: Callable[[], V],
) -> V:
    """``make()``, kept in ``table`` under ``key`` for the ``array`` that ``module`` holds:
    made again when the module holds another array, the entry dropped when the module
    goes (kept beside the modules, not written into them: some are mlx-lm's own)."""
    made = table.get(key)
    if made is None:
        weakref.finalize(module, table.pop, key, None)
    if made is None or made[0] is not array:
        made = table[key] = (array, make())
    return made[1]


def _make(module: nn.Module) -> Stored | None:
    weight = module["weight"]
    if weight.dtype != mx.uint32:
        seen = _numpy(weight)
        return None if seen is None else Stored(seen[0], seen[1], int(weight.shape[-1]))
    if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
        return None
    scales, biases = _numpy(module["scales"]), _numpy(module["biases"])
    if scales is None or biases is None:
        return None
    bits, group = int(module.bits), int(module.group_size)
    return Stored(
        np.asarray(weight),
        "affine",
        int(weight.shape[-1]) * 32 // bits,
        bits=bits,
        group_size=group,
        scales=scales[0],
        biases=biases[0],
        scale_form=scales[1],
    )


def kernels() -> str:
    """How :meth:`Stored.product` multiplies decoding's rows here, for ``kvchat doctor``."""
    module = native.module("packed")
    if module is not None and module.integer():
        return (
            "native kernels (dequantized in registers; 4 and 8-bit in 8-bit integers, AVX-512 VNNI)"
        )
    if module is not None and module.avx2():
        return "native kernels (dequantized in registers, AVX2)"
    if module is not None:
        return "native kernels (dequantized in registers)"
    return "numpy tiles (slow: kvchat's native kernels were not built)"
