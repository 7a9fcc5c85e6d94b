"""Rename a tab's session."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input

from .dialogs import Dialog


class RenameDialog(Dialog):
    """A new name for the session (it is also the name it is saved under)."""

    AUTO_FOCUS = "#rename-input"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.session_name = name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="rename-dialog") as box:
            box.border_title = "Rename session"
            yield Input(value=self.session_name, id="rename-input")
            with Horizontal(classes="row buttons"):
                yield Button("Rename", id="rename-ok", variant="primary")
                yield Button("Cancel", id="rename-cancel")

    @on(Button.Pressed, "#rename-ok")
    @on(Input.Submitted, "#rename-input")
    def _ok(self) -> None:
        self.dismiss(self.query_one("#rename-input", Input).value.strip() or None)

    @on(Button.Pressed, "#rename-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
