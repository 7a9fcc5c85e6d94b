"""One conversation tab: its transcript view, its input and status line, and the
collaborators that act on its session (its turns, jobs and message actions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import ProgressBar, Static, TextArea

from kvchat import drafts, store
from kvchat.engine.conversation.stats import CacheFigures
from kvchat.tui import prompt_history as history

from ..tab.branching import BranchNavigator
from ..tab.events import JobFinished, PrefillProgress, ReplyChunk, Started, TurnFinished, Waiting
from ..tab.jobs import JobRunner
from ..tab.turns import TurnRunner
from .chat_input import ChatInput
from .messages import (
    MessageAction,
    NoticeMessage,
    Selectable,
)
from .status import holder_name, state_text
from .transcript import selectable, transcript_widgets

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.generation.scheduler import Scheduler
    from kvchat.runtime.pool import SessionPool

    from ..tab.view import Progress


class Changed(Message):
    """The conversation's session or state changed: the sidebar should redraw."""

    def __init__(self, conversation: Conversation) -> None:
        super().__init__()
        self.conversation = conversation


class SessionConflict(Message):
    """A save of the conversation was refused: another kvchat saved its session since
    this tab loaded or saved it. The app asks what to do (nothing was overwritten)."""

    def __init__(self, conversation: Conversation) -> None:
        super().__init__()
        self.conversation = conversation


class Conversation(Vertical):
    """One tab: a session, its transcript, its input and a status line.

    ``state`` is ``idle``, ``waiting`` (queued behind another tab), ``answering``
    or a short label of a running job (``rebuilding``...). Its message actions are its
    ``branches`` (a :class:`~kvchat.tui.tab.branching.BranchNavigator`), its jobs
    its ``jobs`` (a :class:`~kvchat.tui.tab.jobs.JobRunner`), its turns its ``turns``
    (a :class:`~kvchat.tui.tab.turns.TurnRunner`: ``turns.send(text)``,
    ``turns.regenerate()``, ``turns.stop()``).
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
    TYPED_DRAFT_S = 0.5  # the message box goes to disk this long after its last change

    def __init__(
        self,
        session: Session,
        name: str,
        scheduler: Scheduler,
        *,
        keymap: dict[str, str] | None = None,
        quitting: Callable[[], bool] = bool,
        id: str,
    ) -> None:
        """``keymap``: the app's [keymap] entries in use (binding id -> keys), for the
        message box's own keys; ``quitting()``: True once the app is quitting."""
        super().__init__(id=id, classes="conversation")
        self.session = session
        self.session_name = name
        self.scheduler = scheduler
        self.saved = False
        self.figures: CacheFigures | None = None  # the session's, as its running turn began
        self.autosave = False
        self.pool: SessionPool | None = None  # set by the app: where the cache may be offloaded
        self.keymap = {} if keymap is None else keymap
        self.quitting = quitting
        self.jobs = JobRunner(self)
        self.turns = TurnRunner(self, self.jobs)
        self.branches = BranchNavigator(self, self.turns, self.jobs)
        # the running turn's prompt evaluation: tokens done, of how many (for the sidebar)
        self.prefill: tuple[int, int] | None = None
        # the running reply's tokens so far and seconds since its first (for the sidebar)
        self.streamed: tuple[int, float] | None = None
        self._typed_timer: Timer | None = None  # the message box's next keeping on disk
        self._typed_as: str | None = None  # the name its text was last kept under
        self._typed_text = ""  # the message box's text, as of its last change

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
            keymap=self.keymap,
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

    @property
    def status_line(self) -> Static:
        return self.query_one(".status", Static)

    @property
    def progress_bar(self) -> ProgressBar:
        return self.query_one(".progress", ProgressBar)

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
        self.status_line.update(state_text(state, holder))
        if state == "idle":
            self.progress_bar.display = False
        self.report_changed()

    def report_changed(self) -> None:
        self.post_message(Changed(self))

    def report_conflict(self) -> None:
        self.post_message(SessionConflict(self))

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
        self.report_changed()

    async def add_notice(self, text: str, kind: str = "info") -> None:
        await self.log.mount(NoticeMessage(text, kind))
        self.log.scroll_end(animate=False)

    # ------------------------------------------------------------- sending

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        await self.turns.send(event.text)

    @on(Waiting)
    def _waiting(self, event: Waiting) -> None:
        event.stop()
        self.turns.waiting()

    @on(Started)
    def _started(self, event: Started) -> None:
        event.stop()
        self.turns.started(event)

    @on(PrefillProgress)
    def _progress(self, event: PrefillProgress) -> None:
        event.stop()
        self.turns.progress(event)

    @on(ReplyChunk)
    async def _chunk(self, event: ReplyChunk) -> None:
        event.stop()
        await self.turns.chunk(event)

    @on(TurnFinished)
    async def _finished(self, event: TurnFinished) -> None:
        event.stop()
        await self.turns.finished(event)

    # -------------------------------------------------------------- saving

    def save_now(self) -> None:
        """Worker thread, holding the model: save the session (through the pool, which
        then knows it is clean)."""
        if self.pool is not None and self.session_name in self.pool:
            try:
                self.pool.save(self.session_name)  # the pool then knows it is clean
            except store.SessionChanged:  # another kvchat saved it: nothing was written
                self.report_conflict()
                raise
        else:
            store.save(self.session, self.session_name)
        self.saved = True
        drafts.clear(self.session_name)  # the message it was sending is in the saved copy

    # ------------------------------------------------------- the message box

    @on(TextArea.Changed, ".input")
    def _box_changed(self, event: TextArea.Changed) -> None:
        """Keep the message box on disk a moment after it changes (:mod:`kvchat.drafts`):
        quitting with a message typed, or held back by a dialog, loses nothing."""
        self._typed_text = event.text_area.text
        if self._typed_timer is not None:
            self._typed_timer.stop()
        self._typed_timer = self.set_timer(self.TYPED_DRAFT_S, self._keep_typed)

    def _keep_typed(self) -> None:
        self._typed_timer = None
        text = self._typed_text
        self.run_worker(
            lambda: self.keep_typed_now(text),
            thread=True,
            group="typed-draft",
            exclusive=True,
        )

    def keep_typed_now(self, text: str) -> None:
        """Write the message box's ``text`` as this session's typed draft (under its current
        name: a renamed tab's old draft goes)."""
        name = self.session_name
        try:
            if self._typed_as not in (None, name):
                drafts.keep_typed(self._typed_as, "")
            drafts.keep_typed(name, text)
            self._typed_as = name
        except (store.StoreError, OSError):
            pass  # the box still holds it; the next change tries again

    def on_unmount(self) -> None:
        """A change not yet kept (the app quits within :data:`TYPED_DRAFT_S` of a key) is
        kept now."""
        if self._typed_timer is not None:
            self._typed_timer.stop()
            self.keep_typed_now(self._typed_text)

    def save(self, then: Callable[[Any], Any] | None = None) -> bool:
        """Save the session in the tab's worker (in turn with the other tabs), then call
        ``then(None)``; False (and a notice) if the tab is busy."""
        return self.jobs.run("saving", lambda progress: self.save_now(), then, needs_cache=False)

    # ---------------------------------------------------------------- jobs

    @on(JobFinished)
    async def _job_finished(self, event: JobFinished) -> None:
        event.stop()
        await self.jobs.finished(event)
