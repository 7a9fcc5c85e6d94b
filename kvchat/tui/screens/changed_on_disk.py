"""The session changed on disk: another kvchat saved it since this tab loaded it."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from .dialogs import UnpromptedDialog


class ConflictDialog(UnpromptedDialog):
    """Another kvchat saved this tab's session since the tab loaded it: keep both, as
    branches of the session (reloaded), or as a new session; or decide later."""

    PRIMARY = "#conflict-reload"

    def __init__(self, name: str, new_name: str) -> None:
        super().__init__()
        self.session_name = name
        self.new_name = new_name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="conflict-dialog") as box:
            box.border_title = "Session changed on disk"
            yield Static(
                f"Another kvchat saved {self.session_name!r} since this tab loaded it; "
                "nothing was overwritten. Reload it (its turns shown, this tab's kept as a "
                f"branch), or save this tab as a new session {self.new_name!r}?",
                markup=False,
            )
            with Horizontal(classes="row buttons"):
                yield Button("Reload", id="conflict-reload", variant="primary")
                yield Button("New session", id="conflict-fork")
                yield Button("Later", id="conflict-later")

    @on(Button.Pressed, "#conflict-reload")
    def _reload(self) -> None:
        self.dismiss("reload")

    @on(Button.Pressed, "#conflict-fork")
    def _fork(self) -> None:
        self.dismiss("fork")

    @on(Button.Pressed, "#conflict-later")
    def _later(self) -> None:
        self.dismiss(None)
