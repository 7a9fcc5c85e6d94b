"""Time to live and memory budget: idle tabs' caches go to disk (``SessionPool``), in a
worker that holds the model, so an offload never overlaps a reply or a job.

A mixin of :class:`~kvchat.tui.app.KvChatApp`; its timer calls :meth:`expire_idle`.
"""

from __future__ import annotations

from textual import work


class ExpiryMixin:
    """Offloads idle caches for the app (``pool``, ``scheduler``, ``conversations``)."""

    def expire_idle(self) -> None:
        """The timer's tick: offload caches idle past ``ttl`` or over ``memory_budget``.

        The offload runs in a worker holding the model (the scheduler), so it never
        overlaps a reply or a job; tabs that are busy or queued are marked as just
        used first, so neither rule picks them.
        """
        if self.lm is None or self._maintaining or not self.pool.names():
            return
        if not (self.pool.ttl_s or self.pool.memory_budget_bytes):
            return
        self._maintaining = True
        tabs = [(c.owner, c.session_name, c.busy) for c in self.conversations()]
        self._expire_worker(tabs)

    @work(thread=True, group="pool")
    def _expire_worker(self, tabs: list[tuple[str, str, bool]]) -> None:
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
            self.call_from_thread(self._expired, offloaded, error)
        except RuntimeError:  # the app closed meanwhile
            pass

    def _expired(self, offloaded: list[str], error: str | None) -> None:
        self._maintaining = False
        if error:
            self.notify(error, severity="warning", markup=False)
        self.mark_offloaded(offloaded)

    def mark_offloaded(self, offloaded: list[str]) -> None:
        """The tabs whose caches went to disk are saved; the sidebar says offloaded."""
        for conversation in self.conversations():
            if conversation.session_name in offloaded:
                conversation.saved = True
        self.refresh_sidebar()
