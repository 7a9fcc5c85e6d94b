"""A conversation tab as its runners see it: :class:`TabView`, what the turn runner, the
job runner and the branch navigator use of :class:`~kvchat.tui.widgets.chat.Conversation`.

The tab makes them and imports them; they are given the tab typed as this Protocol (and
each other, where one calls another), never the tab's class imported back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from textual.app import App
    from textual.containers import VerticalScroll
    from textual.message import Message
    from textual.widgets import ProgressBar, Static

    from kvchat.engine.conversation.session import Session
    from kvchat.engine.conversation.stats import CacheFigures
    from kvchat.engine.generation.scheduler import Scheduler
    from kvchat.runtime.pool import SessionPool

    from ..widgets.chat_input import ChatInput
    from ..widgets.messages import Selectable

Progress = Callable[[int, int], None]


class TabView(Protocol):
    """A tab's session and state, its parts on screen and the calls its runners make."""

    session: Session
    session_name: str
    scheduler: Scheduler
    pool: SessionPool | None
    autosave: bool
    state: str  # idle, waiting, answering or a running job's label
    figures: CacheFigures | None  # the session's, as its running turn began
    prefill: tuple[int, int] | None  # the running turn's prompt evaluation: done, of how many
    streamed: tuple[int, float] | None  # the running reply's tokens and seconds so far
    quitting: Callable[[], bool]  # True once the app is quitting: no message starts

    @property
    def app(self) -> App[Any]:
        """The app: its notices (``notify``), screens and clipboard."""
        ...

    @property
    def owner(self) -> str:
        """The tab's name in the scheduler's queue."""
        ...

    @property
    def log(self) -> VerticalScroll:
        """The transcript."""
        ...

    @property
    def input(self) -> ChatInput: ...

    @property
    def status_line(self) -> Static: ...

    @property
    def progress_bar(self) -> ProgressBar: ...

    def selectable(self) -> list[Selectable]: ...

    def focus_input(self) -> None: ...

    def refuse_if_busy(self) -> bool:
        """True, with a notice saying what to do, when a reply or a job is running here."""
        ...

    def ensure_cache(self, progress: Progress | None = None) -> None:
        """Worker thread, holding the model: load the cache back if it was offloaded."""
        ...

    def touch_pool(self) -> None: ...

    def save_now(self) -> None: ...

    async def reload(self) -> None: ...

    async def add_notice(self, text: str, kind: str = "info") -> None: ...

    def watch_state(self, state: str) -> None:
        """Draw ``state`` in the status line (the reactive's watcher, also called at once)."""
        ...

    def report_changed(self) -> None:
        """Tell the app the session or the state changed (the sidebar redraws)."""
        ...

    def report_conflict(self) -> None:
        """Tell the app another kvchat saved this session meanwhile (it asks what to do)."""
        ...

    def post_message(self, message: Message) -> bool: ...

    def run_worker(
        self,
        work: Any,
        name: str | None = "",
        group: str = "default",
        *,
        thread: bool = False,
    ) -> Any: ...
