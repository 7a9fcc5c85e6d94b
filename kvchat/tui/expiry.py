"""Time to live and memory budget: idle tabs' caches go to disk (``SessionPool``), in a
worker that holds the model, so an offload never overlaps a reply or a job."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvchat.engine.generation.scheduler import Scheduler
from kvchat.runtime.pool import SessionPool


class Tab(Protocol):
    """An open tab as the ticker reads it (a :class:`~kvchat.tui.widgets.chat.Conversation`)."""

    session_name: str

    @property
    def owner(self) -> str: ...  # its name in the scheduler's queue

    @property
    def busy(self) -> bool: ...


class ExpiryTicker:
    """Offloads idle caches of ``pool`` in turn with the tabs (``scheduler``).

    ``tabs()`` lists the open tabs; ``run_worker(fn)`` runs ``fn`` in a worker thread,
    ``call_from_thread(fn, *args)`` runs ``fn`` back on the UI thread, where
    ``done(offloaded, error)`` gets the names offloaded and what failed, if anything.
    """

    def __init__(
        self,
        pool: SessionPool,
        scheduler: Scheduler,
        *,
        tabs: Callable[[], Iterable[Tab]],
        run_worker: Callable[[Callable[[], None]], Any],
        call_from_thread: Callable[..., Any],
        done: Callable[[list[str], str | None], None],
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.tabs = tabs
        self.run_worker = run_worker
        self.call_from_thread = call_from_thread
        self.done = done
        self.running = False  # a tick's worker has not reported back yet

    def tick(self) -> None:
        """Offload caches idle past ``ttl`` or over ``memory_budget``.

        The offload runs in a worker holding the model (the scheduler), so it never
        overlaps a reply or a job; tabs that are busy or queued are marked as just
        used first, so neither rule picks them.
        """
        if self.running or not self.pool.names():
            return
        if not (self.pool.ttl_s or self.pool.memory_budget_bytes):
            return
        self.running = True
        tabs = [(tab.owner, tab.session_name, tab.busy) for tab in self.tabs()]
        self.run_worker(lambda: self.offload(tabs))

    def offload(self, tabs: list[tuple[str, str, bool]]) -> None:
        """Worker thread: the offload itself, then the report to the UI thread."""
        offloaded: list[str] = []
        error = None
        try:
            with self.scheduler.turn("pool"):
                for owner, name, busy in tabs:
                    if (busy or self.scheduler.position(owner) is not None) and name in self.pool:
                        self.pool.touch(name)
                offloaded = self.pool.expire() + self.pool.enforce_budget()
        except Exception as exc:  # a failed save leaves the cache in memory
            error = f"Could not offload a session: {type(exc).__name__}: {exc}"
        try:
            self.call_from_thread(self.finished, offloaded, error)
        except RuntimeError:  # the app closed meanwhile
            pass

    def finished(self, offloaded: list[str], error: str | None) -> None:
        self.running = False
        self.done(offloaded, error)
