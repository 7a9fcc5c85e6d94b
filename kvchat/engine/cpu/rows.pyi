"""Types of the native few-row kernel (rows.c, an optional build)."""

import numpy as np

def matmul_t(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ w.T`` for C-contiguous float32 ``w (n, k)``, ``x (rows, k)`` with 1 to
    64 rows and ``out (rows, n)``, each weight row read once for all rows."""
