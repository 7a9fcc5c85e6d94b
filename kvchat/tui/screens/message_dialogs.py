"""Dialogs of the message actions: edit a message, confirm deleting an exchange."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static, TextArea

from .dialogs import Dialog


class EditDialog(Dialog):
    """Edit one of the user's messages; Send (or Ctrl+S) dismisses with the new text."""

    BINDINGS = [
        Binding(
            "ctrl+s", "send", "Send the edit", id="edit_send", tooltip="Send the edited message."
        )
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="edit-dialog") as box:
            box.border_title = "Edit message"
            yield Static(
                "Sending it continues the conversation from here; what followed "
                "stays as another branch (‹ › on the message).",
                markup=False,
                classes="hint",
            )
            yield TextArea(self.text, id="edit-text", soft_wrap=True, show_line_numbers=False)
            with Horizontal(classes="row buttons"):
                yield Button("Send", id="edit-send", variant="primary")
                yield Button("Cancel", id="edit-cancel")

    def on_mount(self) -> None:
        area = self.query_one("#edit-text", TextArea)
        area.focus()
        area.move_cursor(area.document.end)

    @on(Button.Pressed, "#edit-send")
    def action_send(self) -> None:
        self.dismiss(self.query_one("#edit-text", TextArea).text)

    @on(Button.Pressed, "#edit-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class DeletePairDialog(Dialog):
    """Confirm deleting an exchange (a message and its reply, every version of the reply)."""

    def __init__(self, preview: str) -> None:
        super().__init__()
        self.preview = preview

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="delete-dialog") as box:
            box.border_title = "Delete exchange"
            yield Static(
                f"Delete your message {self.preview!r} and its reply? What followed them stays.",
                markup=False,
            )
            with Horizontal(classes="row buttons"):
                yield Button("Delete", id="delete-yes", variant="error")
                yield Button("Cancel", id="delete-cancel")

    def on_mount(self) -> None:
        self.query_one("#delete-cancel", Button).focus()

    @on(Button.Pressed, "#delete-yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#delete-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
