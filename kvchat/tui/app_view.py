"""The app as its collaborators see it: :class:`AppView`, what the tab controller, the tab
actions, the model loader, the conflicts, the quitter and a sharded run use of
:class:`~kvchat.tui.app.KvChatApp`.

They are given the app typed as this Protocol (and each other, where one calls another,
as pieces passed in), never the app's class imported back: the app imports them, so
naming it here would close an import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel
    from textual.screen import Screen
    from textual.widgets import TabbedContent

    from kvchat.config import Config
    from kvchat.engine.generation.scheduler import Scheduler
    from kvchat.engine.models.model import LoadedModel
    from kvchat.engine.models.registry import ModelRegistry
    from kvchat.runtime.pool import SessionPool

    from .widgets.chat import Conversation


class AppView(Protocol):
    """The app's state its collaborators share, its tabs and the Textual calls they make."""

    config: Config
    lm: LoadedModel | None  # the app's model (for new tabs), once loaded
    resume: str | None  # the session ``--resume`` names
    picker_on_start: bool
    settings_flags: dict[str, Any]  # generation settings given on the command line
    keymap: dict[str, str]  # the [keymap] entries in use: binding id -> keys
    pool: SessionPool
    models: ModelRegistry
    scheduler: Scheduler

    @property
    def screen(self) -> Screen[object]: ...

    @property
    def main_screen(self) -> Screen:
        """The screen holding the tabs and the sidebar, whatever dialog is on top of it."""
        ...

    @property
    def tabs(self) -> TabbedContent: ...

    def conversations(self) -> list[Conversation]: ...

    def idle_conversation(self) -> Conversation | None:
        """The active conversation, or None (saying why) when it is busy or there is none."""
        ...

    def refresh_sidebar(self) -> None: ...

    def quitting(self) -> bool:
        """True once a quit has begun: from then on no message starts."""
        ...

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None: ...

    def push_screen(
        self, screen: Screen[Any], callback: Callable[[Any], Any] | None = None
    ) -> Any: ...

    def pop_screen(self) -> Any: ...

    def run_worker(
        self,
        work: Any,
        name: str | None = "",
        group: str = "default",
        *,
        exclusive: bool = False,
        thread: bool = False,
    ) -> Any: ...

    def call_from_thread(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def call_later(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> bool: ...

    def exit(self, result: Any = None, return_code: int = 0, message: Any = None) -> None: ...
