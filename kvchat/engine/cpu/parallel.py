"""Element-wise numpy work spread over the processor's cores.

numpy's ufuncs (``exp``, ``max``, the arithmetic of a softmax or SwiGLU) run on
the calling thread, while the matmuls around them run on all of BLAS's threads;
on two cores the softmax of a long attention was as long as its two matmuls
together. numpy releases the GIL inside a ufunc, so the same call over parts of
an array on several Python threads runs on several cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")

MIN_FLOATS = 1 << 16  # a part smaller than this costs more to hand over than it saves

_pool: ThreadPoolExecutor | None = None
_pool_made = threading.Lock()  # sessions of the server may answer on several threads at once


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def parts(items: int, floats_each: int) -> int:
    """Into how many parts to split ``items`` of ``floats_each`` floats: one per core,
    none smaller than :data:`MIN_FLOATS`, at least one."""
    return max(1, min(cores(), items, items * floats_each // MIN_FLOATS))


def bounds(items: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges covering ``range(items)``, as even as they go."""
    cuts = np.linspace(0, items, n + 1).astype(int)
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def run(fn: Callable[[T], R], pieces: Sequence[T]) -> list[R]:
    """``[fn(p) for p in pieces]``, the first on this thread and the others on a pool's."""
    global _pool
    if len(pieces) == 1:
        return [fn(pieces[0])]
    with _pool_made:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, cores() - 1), thread_name_prefix="kvchat-cpu")
    futures = [_pool.submit(fn, p) for p in pieces[1:]]
    first = fn(pieces[0])
    return [first, *(f.result() for f in futures)]
