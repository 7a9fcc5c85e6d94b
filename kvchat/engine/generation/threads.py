"""Threads that run MLX work and end cleanly.

MLX keeps per-thread state (its streams and the cache of compiled functions, which
holds Python objects). A thread that ends with that state still in place has it
destroyed by C++ thread-local destructors after Python let go of the thread, and
when that happens while the interpreter shuts down the process aborts
("terminate called without an active exception"; ml-explore/mlx#3126). MLX's
answer is to call ``mx.clear_streams()`` at the end of every thread that used it:
:class:`MlxThreadPool` does so in each of its threads, as the thread ends, and
:func:`clear_mlx_at_thread_end` in any other thread (the generation core's, which ends
after 30 s idle: at the end of a test run, that can be as the interpreter shuts down).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import mlx.core as mx

_ending = threading.local()


class _ClearOnThreadEnd:
    """Held in a thread-local: Python drops it as its thread ends (with the GIL, before
    ``join`` returns), and it clears that thread's MLX state then."""

    def __del__(self) -> None:
        mx.clear_streams()


def clear_mlx_at_thread_end() -> None:
    """Have the calling thread clear its MLX state as it ends (call it first thing in a
    thread that uses MLX: the generation core's, a server's request threads)."""
    _ending.guard = _ClearOnThreadEnd()


class MlxThreadPool(ThreadPoolExecutor):
    """A thread pool (for an event loop's default executor: Textual's thread workers run
    there; a server's request threads) whose threads clear their MLX state when they end,
    at ``shutdown``."""

    def __init__(self, max_workers: int | None = None, name: str = "kvchat-worker") -> None:
        super().__init__(max_workers, thread_name_prefix=name, initializer=clear_mlx_at_thread_end)


@contextmanager
def mlx_event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new event loop whose default executor is an :class:`MlxThreadPool`; on leaving the
    block its threads have ended (each clearing its MLX state) and the loop is closed, so
    the interpreter can shut down normally afterwards."""
    loop = asyncio.new_event_loop()
    pool = MlxThreadPool()
    loop.set_default_executor(pool)
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        pool.shutdown(wait=True)
        asyncio.set_event_loop(None)
        loop.close()
