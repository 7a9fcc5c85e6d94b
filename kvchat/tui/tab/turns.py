"""A tab's turns: sending a message or regenerating a reply, running the session's turn
in a worker thread in turn with the other tabs, and drawing what it reports (the wait,
the prefill's progress, the reply's words, its end) on the UI thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kvchat import drafts, store
from kvchat.engine.conversation.events import Chunk, Prefill, SessionError, TurnDone
from kvchat.engine.generation.scheduler import Cancelled

from ..widgets.messages import AssistantMessage, BranchBar, UserMessage, Welcome, rebuild_note
from ..widgets.status import progress_text, streaming_text
from ..widgets.transcript import show_branches_from
from .events import PrefillProgress, ReplyChunk, Started, TurnFinished, Waiting

if TYPE_CHECKING:
    from .jobs import JobRunner
    from .view import TabView

LIVE_S = 0.25  # a streaming reply's count and rate are drawn at most this often
# A reply's words reach the UI thread at most this often: what comes sooner waits for the
# next word after it (a word after a pause goes at once). One message a token cost the
# UI thread more than its drawing: qwen2.5-0.5b@q4 streamed at 38 tok/s in the TUI
# against 89 decoding alone, on 2 cores.
CHUNK_S = 0.03


class TurnRunner:
    """Runs ``conversation``'s turns: one at a time, its state (``waiting``,
    ``answering``, ``idle``) kept on the tab, the reply drawn as it comes."""

    def __init__(self, conversation: TabView, jobs: JobRunner) -> None:
        self.conversation = conversation
        self.jobs = jobs  # the tab's: Esc stops a job that takes a stop
        self.reply: AssistantMessage | None = None  # the reply being written
        self.pending_text: str | None = None  # the message the running turn adds
        self.user_widget: UserMessage | None = None
        self.reply_index = -1  # where the reply being written goes in the transcript
        self.redraw: int | None = None  # an edit or regenerate point: redraw from there
        self.then: Callable[[TurnDone], Any] | None = None  # for the running turn's end
        self.since: float | None = None  # when the prefill, then the reply, began (monotonic)
        self.shown = 0.0  # when the live figures were last drawn

    # ------------------------------------------------------------- starting

    async def send(self, text: str) -> bool:
        """Start a turn with ``text``; False (and a notice) if it cannot start now."""
        tab = self.conversation
        if tab.refuse_if_busy() or tab.quitting():
            return False
        if (
            tab.pool is not None
            and tab.session_name in tab.pool
            and tab.pool.changed_elsewhere(tab.session_name)
        ):
            tab.report_conflict()  # the message stays in the box
            return False
        try:
            events = tab.session.send(text)
        except SessionError as error:
            tab.app.notify(str(error), severity="warning", markup=False)
            return False
        try:  # on disk before its prefill starts: a crash from now on loses no message
            drafts.keep(tab.session_name, text)
        except (store.StoreError, OSError) as error:
            tab.app.notify(
                f"The message could not be kept on disk while it is sent: {error}",
                severity="warning",
                markup=False,
            )
        tab.input.clear()
        tab.input.remember(text)
        await self.start(events, text=text)
        return True

    async def regenerate(self, then: Callable[[TurnDone], Any] | None = None) -> bool:
        """F5: a new version of the last reply (the old one stays as a branch); ``then``
        gets the turn's end when it has one."""
        tab = self.conversation
        if tab.refuse_if_busy():
            return False
        try:
            events = tab.session.regenerate()
        except SessionError as error:
            tab.app.notify(str(error), severity="warning", markup=False)
            return False
        await self.start(events, upto=len(tab.session.messages) - 1, then=then)
        return True

    async def start(
        self,
        events,
        text: str | None = None,
        upto: int | None = None,
        then: Callable[[TurnDone], Any] | None = None,
    ) -> None:
        """Show a turn starting and run it: ``text`` is the new message, if any; ``upto``
        cuts the transcript shown to that many messages first (an edit or a regenerate:
        the new messages get their branches when the turn ends); ``then`` gets the turn's
        end, if it has one."""
        tab = self.conversation
        self.then = then
        # Busy from here on, before the first await: a Ctrl+Q or Esc that comes while the
        # transcript is being drawn stops this turn instead of quitting past it.
        tab.state = "waiting" if tab.scheduler.running else "answering"
        self.redraw = upto
        if upto is not None:
            for widget in [*tab.selectable(), *tab.log.query(BranchBar)]:
                if widget.index >= upto:
                    await widget.remove()
            tab.focus_input()  # the selected message may be gone: what is typed next goes here
        at = len(tab.session.messages) if upto is None else upto
        self.pending_text = text
        self.user_widget = None if text is None else UserMessage(text, at)
        self.reply_index = at + (text is not None)
        self.reply = None
        tab.prefill = tab.streamed = None
        self.since = None
        if self.user_widget is not None:
            await tab.log.query(Welcome).remove()
            await tab.log.mount(self.user_widget)
        tab.log.scroll_end(animate=False)
        tab.run_worker(partial(self.work, events), name="turn", group="turn", thread=True)

    def stop(self) -> bool:
        """Stop the running reply, or withdraw a queued one, or ask a stoppable job to
        stop. True if there was one."""
        tab = self.conversation
        if tab.state == "waiting" and tab.scheduler.cancel(tab.owner):
            return True
        if tab.state in ("waiting", "answering"):  # waiting, but not queued yet: stop it
            tab.session.stop()  # as soon as it starts
            return True
        return self.jobs.stop()  # a job that takes a stop (checking cache kinds)

    # ------------------------------------------------------- worker thread

    def work(self, events) -> None:
        """Worker thread: wait for the model, stream the turn, report back by messages."""
        tab = self.conversation
        post = tab.post_message

        def waiting(ahead: int) -> None:
            post(Waiting(ahead))

        def loading(done: int, total: int) -> None:
            post(PrefillProgress(done, total, "loading"))

        try:
            # Loading an offloaded cache must have the model to itself; the reply then
            # decodes in the model's generation core, beside the other tabs' replies.
            with tab.scheduler.turn(tab.owner, on_wait=waiting):
                tab.ensure_cache(loading)
                figures = tab.session.figures()
            if self.pending_text is not None:  # the message this turn adds counts already
                figures = replace(figures, user_turns=figures.user_turns + 1)
            post(Started(figures))
            done = None
            words = Words(post)
            for event in events:
                if isinstance(event, Prefill):
                    post(PrefillProgress(event.done, event.total, "prefill"))
                elif isinstance(event, Chunk):
                    words.add(event.text, event.tokens)
                elif isinstance(event, TurnDone):
                    done = event
            words.flush()
            if done is not None and tab.autosave:
                with tab.scheduler.turn(tab.owner):
                    try:
                        tab.save_now()
                    except store.SessionChanged:
                        pass  # save_now asked the app what to do; the turn itself is done
            post(TurnFinished(done, None))
        except Cancelled:
            events.close()
            post(TurnFinished(None, None, cancelled=True))
        except Exception as error:  # the session stays consistent; show why
            post(TurnFinished(None, f"{type(error).__name__}: {error}"))

    # ------------------------------------------------------------ UI thread

    def ending(self) -> bool:
        """The app is ending (a signal ended it mid-turn): its widgets are being removed, so
        the turn's events change no widget (its messages are in the session, saved after)."""
        return self.conversation.app.return_code is not None

    def waiting(self) -> None:
        if self.ending():
            return
        tab = self.conversation
        tab.state = "waiting"
        tab.watch_state("waiting")

    def started(self, event: Started) -> None:
        if self.ending():
            return
        tab = self.conversation
        tab.figures = event.figures
        tab.state = "answering"

    def progress(self, event: PrefillProgress) -> None:
        if self.ending():
            return
        tab = self.conversation
        bar = tab.progress_bar
        # a prefill of a few tokens is over before the bar could be read
        bar.display = (event.total >= 64 or event.unit != "tokens") and event.done < event.total
        bar.update(total=max(1, event.total), progress=event.done)
        if event.done == 0 or self.since is None:
            self.since = time.monotonic()
        if bar.display:
            elapsed = time.monotonic() - self.since
            status = progress_text(event.label, event.done, event.total, elapsed, event.unit)
            tab.status_line.update(status)
        if event.label == "prefill":
            tab.prefill = (event.done, event.total)
            tab.report_changed()

    async def chunk(self, event: ReplyChunk) -> None:
        if self.ending():
            return
        tab = self.conversation
        if self.reply is None:  # the first words: the whole prompt is evaluated
            total = tab.prefill[1] if tab.prefill else 0
            tab.prefill = (total, total)
            tab.report_changed()
            self.reply = AssistantMessage(index=self.reply_index)
            self.since = self.shown = time.monotonic()
            await tab.log.mount(self.reply)
        await self.reply.write(event.text)
        # Once the log overflows, it stays at its end as the reply grows (Textual keeps an
        # anchored scroll at the bottom as it lays the log out) until the user scrolls up
        # to read; back at the bottom it follows again. (A scroll_end every chunk laid the
        # log out once more each time, 5% of the 0.5B model's rate on 2 cores, and pulled a
        # reader back down.) Not before it overflows, nor between turns: an anchored log
        # shorter than its view sits at the bottom of it.
        if not tab.log.is_anchored and tab.log.max_scroll_y > 0:
            tab.log.anchor()
        now = time.monotonic()
        if now - self.shown >= LIVE_S or event.tokens == 1:  # a few times a second
            self.shown = now
            tab.streamed = (event.tokens, now - (self.since or now))
            tab.status_line.update(streaming_text(*tab.streamed))
            tab.report_changed()

    async def finished(self, event: TurnFinished) -> None:
        tab = self.conversation
        if self.ending():  # its draft stays: dropped when the session is next opened, if
            return  # the save after the app ended (tui/run.py) holds the message
        # The message is in the session (or back in the box): no longer in flight.
        drafts.clear(tab.session_name)
        if event.cancelled:
            if self.user_widget is not None:
                await self.user_widget.remove()
            if not any(m["role"] == "user" for m in tab.session.messages):
                await tab.log.mount(Welcome(), before=0)
            if self.pending_text is not None and not tab.input.text:
                tab.input.put(self.pending_text)
            tab.app.notify("Cancelled before it started.")
        elif event.error:
            await tab.add_notice(event.error, "error")
        elif event.done is not None:
            if self.reply is None:
                self.reply = AssistantMessage(index=self.reply_index)
                await tab.log.mount(self.reply)
            await self.reply.finish(
                event.done.reply, event.done.stopped, rebuild_note(event.done.stats.rebuilt)
            )
            if self.then is not None:
                self.then(event.done)
        self.reply = None
        self.user_widget = None
        self.pending_text = None
        if self.redraw is not None:  # the branches of the messages changed
            upto, self.redraw = self.redraw, None
            if event.done is not None and not (event.cancelled or event.error):
                await show_branches_from(tab.log, tab.session, upto)
            else:  # no reply: the transcript as the session has it, from the start
                await tab.reload()
        tab.log.scroll_end(animate=False)
        tab.log.anchor(False)
        tab.touch_pool()
        tab.state = "idle"


class Words:
    """A reply's streamed words on their way to the UI thread, in ReplyChunk messages at
    most every CHUNK_S seconds (see there)."""

    def __init__(self, post: Callable[[Any], Any]) -> None:
        self.post = post
        self.text = ""
        self.tokens = 0
        self.sent = -CHUNK_S  # when the last message went

    def add(self, text: str, tokens: int) -> None:
        self.text += text
        self.tokens = tokens
        now = time.monotonic()
        if now - self.sent >= CHUNK_S:
            self.sent = now
            self.flush()

    def flush(self) -> None:
        """Send what waits, if anything."""
        if self.text:
            self.post(ReplyChunk(self.text, self.tokens))
            self.text = ""
