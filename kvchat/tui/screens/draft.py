"""A message kept from last time (not sent): restore it into the box, or discard it."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from kvchat.drafts import OFFER
from kvchat.safety import printable

from .dialogs import UnpromptedDialog


class DraftDialog(UnpromptedDialog):
    """A message that was being sent when kvchat stopped: put it back in the message box,
    or let it go. (Escape asks again next time the session is opened.)"""

    PRIMARY = "#draft-restore"

    def __init__(self, name: str, text: str) -> None:
        super().__init__()
        self.session_name = name
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="draft-dialog") as box:
            box.border_title = f"Unsent message ({self.session_name})"
            lines = self.text.count("\n") + 1
            yield Static(
                f"{OFFER} ({len(self.text):,} characters, {lines:,} line(s))", markup=False
            )
            preview = self.text if len(self.text) <= 300 else self.text[:300] + "…"
            yield Static(printable(preview), id="draft-preview", classes="body", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button("Restore", id="draft-restore", variant="primary")
                yield Button("Discard", id="draft-discard", variant="error")

    @on(Button.Pressed, "#draft-restore")
    def _restore(self) -> None:
        self.dismiss("restore")

    @on(Button.Pressed, "#draft-discard")
    def _discard(self) -> None:
        self.dismiss("discard")
