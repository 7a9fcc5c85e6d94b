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
    counts: list[int],
    scale: float,
    out: np.ndarray,
    spread: bool = True,
    /,
) -> None:
    """Each row's grouped-query attention of its ``counts[r]`` new tokens: ``q``/``out``
    ``(tokens, heads, dim)``, ``k``/``v`` ``(tokens, kv heads, dim)`` (the rows' new keys
    and values, one row's after another), over the first ``spans[r]`` keys and values of
    ``keys[r]``/``values[r]`` ``(1, kv heads, capacity, dim)`` (None where the span is 0),
    then over the row's new ones up to the token's own (causal). Over the cores, unless
    ``spread`` is false (the caller's next products go through BLAS: see fused.c)."""
