"""The device gate: forward passes of the process take turns through it.

Every step of a :class:`~kvchat.engine.generation.core.GenerationCore` holds it
shared-free (one step at a time, whichever model), and work that must run alone
(a model load, a session's rebuild or kind switch, a save) holds it
exclusively between two steps. Exclusive requests go first: a step waits while
one is queued, so maintenance is never starved by a busy batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Gate:
    """One holder at a time; exclusive requests before steps; re-entrant for its holder."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: int | None = None  # thread id
        self._depth = 0
        self._exclusive_waiting = 0

    def held_here(self) -> bool:
        """Whether the calling thread holds the gate."""
        with self._cond:
            return self._holder == threading.get_ident()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Hold the gate for one step (waits while exclusive work is queued or runs)."""
        with self._hold(exclusive=False):
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate for a piece of work that must run alone, between two steps."""
        with self._hold(exclusive=True):
            yield

    def acquire(self) -> None:
        """:meth:`exclusive` without a ``with`` block: hold until :meth:`release`."""
        self._take(exclusive=True)

    def release(self) -> None:
        """Let go of one hold taken by this thread."""
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("the device gate is not held by this thread")
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._cond.notify_all()

    @contextmanager
    def _hold(self, exclusive: bool) -> Iterator[None]:
        self._take(exclusive)
        try:
            yield
        finally:
            self.release()

    def _take(self, exclusive: bool) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                return
            if exclusive:
                self._exclusive_waiting += 1
            try:
                self._cond.wait_for(
                    lambda: self._holder is None and (exclusive or self._exclusive_waiting == 0)
                )
            finally:
                if exclusive:
                    self._exclusive_waiting -= 1
            self._holder, self._depth = me, 1


GATE = Gate()
