"""Work that must have the model to itself, first come, first served.

Replies do not come here: they run together in their model's generation core
(:mod:`kvchat.engine.generation`). What must run alone does: a model load or
unload, a session's rebuild, trim or kind switch, a save, the pool's offloads.
A caller asks with :meth:`Scheduler.turn`; while its ticket runs it holds the
device gate (:data:`~kvchat.engine.generation.gate.GATE`) exclusively, so the
cores pause between two steps and resume after. A reply started while the
gate is held by the same thread (a sharded run's, a test's) runs there, alone.
The scheduler knows nothing about terminals: the TUI's worker threads call it
and show "waiting" while :meth:`Scheduler.position` says they are queued.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count

from kvchat.engine.generation.gate import GATE


class Cancelled(Exception):
    """The request was withdrawn before its turn came."""


@dataclass(eq=False)
class Ticket:
    """One request for the model, held by ``owner`` (a session name, a tab id...)."""

    owner: str
    number: int
    cancelled: threading.Event = field(default_factory=threading.Event)
    holds_gate: bool = False


class Scheduler:
    """A FIFO lock over the device gate: one ticket runs, the others wait in order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._running: Ticket | None = None
        self._numbers = count(1)

    # ------------------------------------------------------------------ views

    @property
    def running(self) -> str | None:
        """The owner whose turn runs now, or None."""
        with self._cond:
            return self._running.owner if self._running else None

    def waiting(self) -> list[str]:
        """Owners queued behind the running one, first to run first."""
        with self._cond:
            return [t.owner for t in self._queue]

    def position(self, owner: str) -> int | None:
        """0 while ``owner`` runs, n when n requests are ahead of it, None if it asked nothing."""
        with self._cond:
            if self._running and self._running.owner == owner:
                return 0
            for i, ticket in enumerate(self._queue):
                if ticket.owner == owner:
                    return i + 1
            return None

    # ---------------------------------------------------------------- actions

    def request(self, owner: str) -> Ticket:
        """Queue a request; it runs when :meth:`wait` returns."""
        ticket = Ticket(owner, next(self._numbers))
        with self._cond:
            self._queue.append(ticket)
            self._promote()
        return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None) -> None:
        """Block until ``ticket`` runs; raise :class:`Cancelled` if it was withdrawn,
        TimeoutError after ``timeout`` seconds (it then leaves the queue)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._running is ticket or ticket.cancelled.is_set(), timeout
            )
            if ticket.cancelled.is_set() and self._running is not ticket:
                self._remove(ticket)
                raise Cancelled(ticket.owner)
            if not ok:
                self._remove(ticket)
                raise TimeoutError(f"{ticket.owner} waited {timeout} s for the model")
        if not ticket.holds_gate:
            GATE.acquire()  # the cores finish their current step first
            ticket.holds_gate = True

    def done(self, ticket: Ticket) -> None:
        """Give the model back (or leave the queue); the next request runs."""
        if ticket.holds_gate:
            ticket.holds_gate = False
            GATE.release()
        with self._cond:
            self._remove(ticket)

    def cancel(self, owner: str) -> bool:
        """Withdraw ``owner``'s queued requests; True if one was waiting. A running
        turn is not touched: stop it through its session."""
        with self._cond:
            found = False
            for ticket in list(self._queue):
                if ticket.owner == owner:
                    ticket.cancelled.set()
                    self._queue.remove(ticket)
                    found = True
            self._cond.notify_all()
            return found

    @contextmanager
    def turn(self, owner: str, on_wait: Callable[[int], None] | None = None) -> Iterator[Ticket]:
        """Hold the model for the ``with`` block, waiting for it first.

        ``on_wait(ahead)`` is called once, before blocking, when others are
        ahead of this request.
        """
        ticket = self.request(owner)
        try:
            ahead = self._ahead(ticket)
            if ahead and on_wait is not None:
                on_wait(ahead)
            self.wait(ticket)
            yield ticket
        finally:
            self.done(ticket)

    # --------------------------------------------------------------- internal

    def _ahead(self, ticket: Ticket) -> int:
        with self._cond:
            if self._running is ticket:
                return 0
            before = list(self._queue).index(ticket) if ticket in self._queue else 0
            return before + (self._running is not None)

    def _remove(self, ticket: Ticket) -> None:
        if self._running is ticket:
            self._running = None
        elif ticket in self._queue:
            self._queue.remove(ticket)
        self._promote()

    def _promote(self) -> None:
        if self._running is None and self._queue:
            self._running = self._queue.popleft()
        self._cond.notify_all()
