"""A tab's jobs: one engine call that uses the model (undo, trim, a kind switch, a save…),
run in a worker thread in turn with the other tabs, its result handed to a callback on
the UI thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvchat.engine.conversation.events import SessionError

from .events import JobFinished, PrefillProgress

if TYPE_CHECKING:
    from .view import Progress, TabView


class JobRunner:
    """Runs ``conversation``'s jobs: it uses the tab's scheduler, owner, state, cache
    (loaded back when offloaded) and notices."""

    def __init__(self, conversation: TabView) -> None:
        self.conversation = conversation
        self.stopping: threading.Event | None = None  # the running job's stop, if it takes one

    def run(
        self,
        label: str,
        job: Callable[[Progress], Any],
        then: Callable[[Any], Any] | None = None,
        *,
        needs_cache: bool = True,
        stop: threading.Event | None = None,
        unit: str = "tokens",
    ) -> bool:
        """Run ``job(progress)`` in a worker thread, in turn with the other tabs; call
        ``then(result)`` on the UI thread afterwards. With ``needs_cache`` an offloaded
        cache is loaded back from disk first; a job given ``stop`` is stopped by Esc
        (:meth:`stop` sets it: the job looks at it); its progress counts ``unit``. False
        (and a notice) if the tab is busy."""
        tab = self.conversation
        if tab.refuse_if_busy():
            return False
        tab.state = label
        self.stopping = stop
        tab.run_worker(
            partial(self.work, label, job, then, needs_cache, unit),
            name="job",
            group="job",
            thread=True,
        )
        return True

    def stop(self) -> bool:
        """Esc: ask the running job to stop, where it takes a stop. True if asked."""
        if self.stopping is None or self.stopping.is_set():
            return False
        self.stopping.set()
        return True

    def work(
        self,
        label: str,
        job: Callable[[Progress], Any],
        then: Callable | None,
        needs_cache: bool,
        unit: str,
    ) -> None:
        """Worker thread: wait for the model, run the job, report back by a message."""
        tab = self.conversation
        post = tab.post_message

        def progress(done: int, total: int, what: str = label) -> None:
            post(PrefillProgress(done, total, what, unit if what == label else "tokens"))

        try:
            with tab.scheduler.turn(tab.owner):
                if needs_cache:
                    tab.ensure_cache(partial(progress, what="loading"))
                result = job(progress)
        except SessionError as error:  # a refusal, such as a sharded run's: nothing was done
            post(JobFinished(label, None, None, None, refusal=str(error)))
        except Exception as error:
            post(JobFinished(label, None, f"{type(error).__name__}: {error}", None))
        else:
            post(JobFinished(label, result, None, then))

    async def finished(self, event: JobFinished) -> None:
        """UI thread: the job's end (its callback, or why it failed)."""
        tab = self.conversation
        tab.touch_pool()
        tab.state = "idle"
        self.stopping = None
        if event.refusal:
            tab.app.notify(event.refusal, severity="warning", markup=False)
        elif event.error:
            await tab.add_notice(f"{event.label.capitalize()} failed: {event.error}", "error")
        elif event.then is not None:
            outcome = event.then(event.result)
            if hasattr(outcome, "__await__"):
                await outcome
        tab.report_changed()
