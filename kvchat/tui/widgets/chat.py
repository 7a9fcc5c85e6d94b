"""One conversation tab: its transcript view, its input and the worker that runs its turns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import ProgressBar, Static

from kvchat import drafts, history, store
from kvchat.engine.conversation.session import Chunk, Prefill, Session, SessionError, TurnDone
from kvchat.engine.conversation.stats import CacheFigures
from kvchat.engine.generation.scheduler import Cancelled

from .branching import BranchNavigator
from .chat_input import ChatInput
from .jobs import JobRunner, Progress
from .messages import (
    AssistantMessage,
    BranchBar,
    MessageAction,
    NoticeMessage,
    Selectable,
    UserMessage,
    Welcome,
    rebuild_note,
)
from .status import holder_name, state_text
from .transcript import selectable, show_branches_from, transcript_widgets
from .turn_events import (
    Changed,
    JobFinished,
    PrefillProgress,
    ReplyChunk,
    SessionConflict,
    Started,
    TurnFinished,
    Waiting,
)

if TYPE_CHECKING:
    from kvchat.engine.generation.scheduler import Scheduler
    from kvchat.pool import SessionPool

    from ..app import KvChatApp


class Conversation(Vertical):
    """One tab: a session, its transcript, its input and a status line.

    ``state`` is ``idle``, ``waiting`` (queued behind another tab), ``answering``
    or a short label of a running job (``rebuilding``...). Its message actions are its
    ``branches`` (a :class:`~kvchat.tui.widgets.branching.BranchNavigator`), its jobs
    its ``jobs`` (a :class:`~kvchat.tui.widgets.jobs.JobRunner`).
    """

    BINDINGS = [
        Binding(
            "ctrl+up,alt+up",
            "select_last",
            "Select message",
            id="select_message",
            show=False,
            tooltip="Select the newest message; Up/Down move, then Enter edits, r "
            "regenerates, ←/→ switch branch, c/y copy, d deletes.",
        ),
    ]

    state: reactive[str] = reactive("idle")

    def __init__(self, session: Session, name: str, scheduler: Scheduler, *, id: str) -> None:
        super().__init__(id=id, classes="conversation")
        self.session = session
        self.session_name = name
        self.scheduler = scheduler
        self.saved = False
        self.figures: CacheFigures | None = None  # the session's, as its running turn began
        self.autosave = False
        self.pool: SessionPool | None = None  # set by the app: where the cache may be offloaded
        self._reply: AssistantMessage | None = None
        self._pending_text: str | None = None
        self._user_widget: UserMessage | None = None
        self._reply_index = -1  # where the reply being written goes in the transcript
        self._redraw: int | None = None  # an edit or regenerate point: redraw from there
        self._then: Callable[[TurnDone], Any] | None = None  # for the running turn's end
        self.branches = BranchNavigator(self)
        self.jobs = JobRunner(self)
        # the running turn's prompt evaluation: tokens done, of how many (for the sidebar)
        self.prefill: tuple[int, int] | None = None

    @property
    def owner(self) -> str:
        return self.id or self.session_name

    @property
    def busy(self) -> bool:
        return self.state != "idle"

    @property
    def offloaded(self) -> bool:
        """True while the pool holds this tab's cache on disk only."""
        pool = self.pool
        return (
            pool is not None
            and self.session_name in pool
            and not pool.entry(self.session_name).in_memory
        )

    def ensure_cache(self, progress: Progress | None = None) -> None:
        """Worker thread, holding the model: load the cache back if it was offloaded."""
        pool = self.pool
        if pool is not None and self.session_name in pool:
            pool.get(self.session_name, progress)

    def touch_pool(self) -> None:
        if self.pool is not None and self.session_name in self.pool:
            self.pool.touch(self.session_name)

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="log"):
            yield from transcript_widgets(self.session)
        yield Static("", classes="status", markup=False)
        yield ProgressBar(total=100, show_eta=False, classes="progress")
        yield ChatInput(
            self.prompt_history,
            self.count_tokens,
            lambda: self.busy,
            classes="input",
            placeholder="Message (Enter sends, Ctrl+J new line)",
        )

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` adds to a message, by this tab's tokenizer."""
        return len(self.session.lm.tokenizer.encode(text, add_special_tokens=False))

    def prompt_history(self) -> list[str]:
        """What Up walks: this tab's messages, newest first, then the saved prompt history."""
        own = [m["content"] for m in reversed(self.session.messages) if m["role"] == "user"]
        return history.merged(own, history.load())

    @property
    def unsaved(self) -> bool:
        """True when the tab has changes that its saved copy lacks (see
        :meth:`SessionPool.unsaved`; messages, undo, trim, kind, settings)."""
        pool = self.pool
        if pool is not None and self.session_name in pool:
            return pool.unsaved(self.session_name)
        return any(m["role"] == "user" for m in self.session.messages) and not self.saved

    @property
    def log(self) -> VerticalScroll:  # type: ignore[override]  # the transcript, over Textual's logger
        return self.query_one(".log", VerticalScroll)

    @property
    def input(self) -> ChatInput:
        return self.query_one(ChatInput)

    def focus_input(self) -> None:
        self.input.focus()

    def selectable(self) -> list[Selectable]:
        """The messages shown that can be selected, in order."""
        return selectable(self.log)

    def action_select_last(self) -> None:
        self.branches.select_last()

    @on(MessageAction)
    async def _message_action(self, event: MessageAction) -> None:
        event.stop()
        await self.branches.handle(event)

    def watch_state(self, state: str) -> None:
        tabs = (
            {}
            if state != "waiting"
            else {t.owner: t.session_name for t in self.screen.query(Conversation)}
        )
        holder = holder_name(self.scheduler.running, tabs)
        self.query_one(".status", Static).update(state_text(state, holder))
        if state == "idle":
            self.query_one(".progress", ProgressBar).display = False
        self.post_message(Changed(self))

    def refuse_if_busy(self) -> bool:
        """True, with a notice saying what to do, when a reply or a job is running here."""
        if not self.busy:
            return False
        if self.state in ("answering", "waiting"):
            self.notify("Busy: press Esc to stop the reply first.", severity="warning")
        else:
            self.notify(f"Busy {self.state}; try again when it is done.", severity="warning")
        return True

    async def reload(self) -> None:
        """Redraw the transcript from the session (after undo, trim or resume)."""
        log = self.log
        await log.remove_children()
        widgets = transcript_widgets(self.session)
        if widgets:
            await log.mount_all(widgets)
        log.scroll_end(animate=False)
        self.post_message(Changed(self))

    async def add_notice(self, text: str, kind: str = "info") -> None:
        await self.log.mount(NoticeMessage(text, kind))
        self.log.scroll_end(animate=False)

    # ------------------------------------------------------------- sending

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        await self.send(event.text)

    async def send(self, text: str) -> bool:
        """Start a turn with ``text``; False (and a notice) if it cannot start now."""
        if self.refuse_if_busy() or cast("KvChatApp", self.app).quitter.underway:
            return False
        if (
            self.pool is not None
            and self.session_name in self.pool
            and self.pool.changed_elsewhere(self.session_name)
        ):
            self.post_message(SessionConflict(self))  # the message stays in the box
            return False
        try:
            events = self.session.send(text)
        except SessionError as error:
            self.notify(str(error), severity="warning", markup=False)
            return False
        try:  # on disk before its prefill starts: a crash from now on loses no message
            drafts.keep(self.session_name, text)
        except (store.StoreError, OSError) as error:
            self.notify(
                f"The message could not be kept on disk while it is sent: {error}",
                severity="warning",
                markup=False,
            )
        self.input.clear()
        self.input.remember(text)
        await self.start_turn(events, text=text)
        return True

    async def regenerate(self, then: Callable[[TurnDone], Any] | None = None) -> bool:
        """F5: a new version of the last reply (the old one stays as a branch); ``then``
        gets the turn's end when it has one."""
        if self.refuse_if_busy():
            return False
        try:
            events = self.session.regenerate()
        except SessionError as error:
            self.notify(str(error), severity="warning", markup=False)
            return False
        await self.start_turn(events, upto=len(self.session.messages) - 1, then=then)
        return True

    async def start_turn(
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
        self._then = then
        # Busy from here on, before the first await: a Ctrl+Q or Esc that comes while the
        # transcript is being drawn stops this turn instead of quitting past it.
        self.state = "waiting" if self.scheduler.running else "answering"
        self._redraw = upto
        if upto is not None:
            for widget in [*self.selectable(), *self.log.query(BranchBar)]:
                if widget.index >= upto:
                    await widget.remove()
            self.focus_input()  # the selected message may be gone: what is typed next goes here
        at = len(self.session.messages) if upto is None else upto
        self._pending_text = text
        self._user_widget = None if text is None else UserMessage(text, at)
        self._reply_index = at + (text is not None)
        self._reply = None
        self.prefill = None
        if self._user_widget is not None:
            await self.log.query(Welcome).remove()
            await self.log.mount(self._user_widget)
        self.log.scroll_end(animate=False)
        self._run_turn(events)

    def stop(self) -> bool:
        """Stop the running reply, or withdraw a queued one. True if there was one."""
        if self.state == "waiting" and self.scheduler.cancel(self.owner):
            return True
        if self.state in ("waiting", "answering"):  # waiting, but not queued yet: stop it
            self.session.stop()  # as soon as it starts
            return True
        return False

    @work(thread=True, group="turn")
    def _run_turn(self, events) -> None:
        """Worker thread: wait for the model, stream the turn, report back by messages."""
        post = self.post_message

        def waiting(ahead: int) -> None:
            post(Waiting(ahead))

        def loading(done: int, total: int) -> None:
            post(PrefillProgress(done, total, "loading"))

        try:
            # Loading an offloaded cache must have the model to itself; the reply then
            # decodes in the model's generation core, beside the other tabs' replies.
            with self.scheduler.turn(self.owner, on_wait=waiting):
                self.ensure_cache(loading)
                figures = self.session.figures()
            if self._pending_text is not None:  # the message this turn adds counts already
                figures = replace(figures, user_turns=figures.user_turns + 1)
            post(Started(figures))
            done = None
            for event in events:
                if isinstance(event, Prefill):
                    post(PrefillProgress(event.done, event.total, "prefill"))
                elif isinstance(event, Chunk):
                    post(ReplyChunk(event.text))
                elif isinstance(event, TurnDone):
                    done = event
            if done is not None and self.autosave:
                with self.scheduler.turn(self.owner):
                    try:
                        self.save_now()
                    except store.SessionChanged:
                        pass  # save_now asked the app what to do; the turn itself is done
            post(TurnFinished(done, None))
        except Cancelled:
            events.close()
            post(TurnFinished(None, None, cancelled=True))
        except Exception as error:  # the session stays consistent; show why
            post(TurnFinished(None, f"{type(error).__name__}: {error}"))

    def save_now(self) -> None:
        """Worker thread, holding the model: save the session (through the pool, which
        then knows it is clean)."""
        if self.pool is not None and self.session_name in self.pool:
            try:
                self.pool.save(self.session_name)  # the pool then knows it is clean
            except store.SessionChanged:  # another kvchat saved it: nothing was written
                self.post_message(SessionConflict(self))
                raise
        else:
            store.save(self.session, self.session_name)
        self.saved = True
        drafts.clear(self.session_name)  # the message it was sending is in the saved copy

    def save(self, then: Callable[[Any], Any] | None = None) -> bool:
        """Save the session in the tab's worker (in turn with the other tabs), then call
        ``then(None)``; False (and a notice) if the tab is busy."""
        return self.run_job("saving", lambda progress: self.save_now(), then, needs_cache=False)

    @on(Waiting)
    def _waiting(self, event: Waiting) -> None:
        event.stop()
        self.state = "waiting"
        self.watch_state("waiting")

    @on(Started)
    def _started(self, event: Started) -> None:
        event.stop()
        self.figures = event.figures
        self.state = "answering"

    @on(PrefillProgress)
    def _progress(self, event: PrefillProgress) -> None:
        event.stop()
        bar = self.query_one(".progress", ProgressBar)
        # a prefill of a few tokens is over before the bar could be read
        bar.display = event.total >= 64 and event.done < event.total
        bar.update(total=max(1, event.total), progress=event.done)
        if bar.display:
            self.query_one(".status", Static).update(
                Text(f"{event.label.capitalize()}: {event.done:,} of {event.total:,} tokens")
            )
        if event.label == "prefill":
            self.prefill = (event.done, event.total)
            self.post_message(Changed(self))

    @on(ReplyChunk)
    async def _chunk(self, event: ReplyChunk) -> None:
        event.stop()
        if self._reply is None:  # the first words: the whole prompt is evaluated
            total = self.prefill[1] if self.prefill else 0
            self.prefill = (total, total)
            self.post_message(Changed(self))
            self._reply = AssistantMessage(index=self._reply_index)
            await self.log.mount(self._reply)
        await self._reply.write(event.text)
        self.log.scroll_end(animate=False)

    @on(TurnFinished)
    async def _finished(self, event: TurnFinished) -> None:
        event.stop()
        # The message is in the session (or back in the box): no longer in flight. (An app
        # ended by a signal mid-turn never gets here: its draft stays unless it was saved.)
        drafts.clear(self.session_name)
        if event.cancelled:
            if self._user_widget is not None:
                await self._user_widget.remove()
            if not any(m["role"] == "user" for m in self.session.messages):
                await self.log.mount(Welcome(), before=0)
            if self._pending_text is not None and not self.input.text:
                self.input.text = self._pending_text
            self.notify("Cancelled before it started.")
        elif event.error:
            await self.add_notice(event.error, "error")
        elif event.done is not None:
            if self._reply is None:
                self._reply = AssistantMessage(index=self._reply_index)
                await self.log.mount(self._reply)
            await self._reply.finish(
                event.done.reply, event.done.stopped, rebuild_note(event.done.stats.rebuilt)
            )
            if self._then is not None:
                self._then(event.done)
        self._reply = None
        self._user_widget = None
        self._pending_text = None
        if self._redraw is not None:  # the branches of the messages changed
            upto, self._redraw = self._redraw, None
            if event.done is not None and not (event.cancelled or event.error):
                await show_branches_from(self.log, self.session, upto)
            else:  # no reply: the transcript as the session has it, from the start
                await self.reload()
        self.log.scroll_end(animate=False)
        self.touch_pool()
        self.state = "idle"

    # ---------------------------------------------------------------- jobs

    def run_job(
        self,
        label: str,
        job: Callable[[Progress], Any],
        then: Callable[[Any], Any] | None = None,
        *,
        needs_cache: bool = True,
    ) -> bool:
        """Run ``job(progress)`` in the tab's worker (see :meth:`JobRunner.run`)."""
        return self.jobs.run(label, job, then, needs_cache=needs_cache)

    @on(JobFinished)
    async def _job_finished(self, event: JobFinished) -> None:
        event.stop()
        await self.jobs.finished(event)
