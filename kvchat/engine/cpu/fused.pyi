"""Types of the native fused kernels (fused.c, an optional build)."""

import numpy as np

def swiglu(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(g) * u`` for C-contiguous 2-D float32 arrays of one shape."""

def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keys: list[np.ndarray | None],
    values: list[np.ndarray | None],
    spans: list[int],
    scale: float,
    out: np.ndarray,
) -> None:
    """Each row's one-token grouped-query attention: ``q``/``out`` ``(rows, heads, dim)``,
    ``k``/``v`` ``(rows, kv heads, dim)`` (its own key and value, attended last), over
    the first ``spans[r]`` keys and values of ``keys[r]``/``values[r]`` ``(1, kv heads,
    capacity, dim)`` (None where the span is 0)."""
