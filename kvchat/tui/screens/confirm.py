"""A yes-or-no question before a step that cannot be taken back (a trim or undo that drops
every message)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from .dialogs import Dialog


class ConfirmDialog(Dialog):
    """A question before a step that drops something: Enter does it (the dialog was asked
    for by a key of the user's), Escape or Cancel does not; dismisses with a bool."""

    AUTO_FOCUS = "#confirm-yes"

    def __init__(self, title: str, text: str, yes: str) -> None:
        super().__init__()
        self.title_text, self.text, self.yes = title, text, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="confirm-dialog") as box:
            box.border_title = self.title_text
            yield Static(self.text, markup=False)
            with Horizontal(classes="row buttons"):
                yield Button(self.yes, id="confirm-yes", variant="warning")
                yield Button("Cancel", id="confirm-cancel")

    @on(Button.Pressed, "#confirm-yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#confirm-cancel")
    def _no(self) -> None:
        self.dismiss(False)
