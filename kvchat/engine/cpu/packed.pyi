"""Types of the native packed-weight kernels (packed.c, an optional build)."""

import numpy as np

def affine_t(
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    kind: int,
    bits: int,
    group_size: int,
    x: np.ndarray,
    out: np.ndarray,
    /,
) -> None:
    """``out = x @ Wᵀ`` for MLX's affine packed ``W``: ``w`` uint32 ``(out, in · bits / 32)``,
    ``scales``/``biases`` ``(out, in / group_size)`` float32 (``kind`` 0) or the uint16
    bits of float16 (1) or bfloat16 (2); ``x`` float32 ``(n, in)``, ``out`` float32
    ``(n, out)``. Each weight is read once for all rows."""

def half_t(w: np.ndarray, kind: int, x: np.ndarray, out: np.ndarray, /) -> None:
    """``out = x @ Wᵀ`` for ``w`` the uint16 bits ``(out, in)`` of float16 (``kind`` 1) or
    bfloat16 (2) weights."""

def affine_rows(
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    kind: int,
    bits: int,
    group_size: int,
    ids: np.ndarray,
    out: np.ndarray,
    /,
) -> None:
    """``out[i] = W[ids[i]]`` widened to float32: ``ids`` int64 ``(m,)``, ``out`` ``(m, in)``."""

def half_rows(w: np.ndarray, kind: int, ids: np.ndarray, out: np.ndarray, /) -> None:
    """``out[i] = W[ids[i]]`` widened to float32 for 16-bit ``w``."""

def avx2(on: bool = ..., /) -> bool:
    """Whether the float tiles' products and rows widened run in AVX2's own kernels
    (packed_avx2.h), as they do where the CPU has AVX2 but not AVX-512; ``avx2(True)``
    where it has both, to compare them, ``avx2(False)`` the tiles' own clones."""

def lookup(on: bool = ..., /) -> bool:
    """Whether the float tiles' 4-bit codes pick their values from their groups' tables of 16,
    as they do where the CPU has AVX-512; ``lookup(False)`` scales them as other widths' are
    (as on other CPUs), ``lookup(True)`` the tables."""

def integer(on: bool = ..., /) -> bool:
    """Whether 4 and 8-bit products (groups of 32, 64 or 128) run in 8-bit integers, as they do
    where the CPU has AVX-512 VNNI; ``integer(False)`` the float tiles instead (to compare
    them), ``integer(True)`` back."""

def threads() -> int:
    """The threads a product's parallel region takes now: the cores this process may run on
    while the calling thread gets a core whenever it wants one, 1 while other programs keep
    the cores busy."""
