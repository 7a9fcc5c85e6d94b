"""A file's name, for the message box's Insert file (Ctrl+F)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Static

from .dialogs import Dialog


class FileDialog(Dialog):
    """The path of a text file whose text goes into the message at the cursor."""

    AUTO_FOCUS = "#file-input"

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="file-dialog") as box:
            box.border_title = "Insert a file"
            yield Static(
                "Its text goes into the message at the cursor (not sent); "
                "UTF-8 text, at most 1 MiB.",
                markup=False,
            )
            yield Input(placeholder="path, e.g. ~/notes.txt", id="file-input")
            with Horizontal(classes="row buttons"):
                yield Button("Insert", id="file-ok", variant="primary")
                yield Button("Cancel", id="file-cancel")

    @on(Button.Pressed, "#file-ok")
    @on(Input.Submitted, "#file-input")
    def _ok(self) -> None:
        self.dismiss(self.query_one("#file-input", Input).value.strip() or None)

    @on(Button.Pressed, "#file-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
