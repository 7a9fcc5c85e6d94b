"""The modal dialogs' bases: :class:`Dialog` (Esc cancels; what it dismisses with, the app
turns into one engine call), :class:`UnpromptedDialog` (one that opens on its own) and
:class:`PathDialog` (one that asks for a file's path).
Each dialog has a module of its own beside this one."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static


class Dialog(ModalScreen):
    """A modal with a title; Escape cancels (dismisses with None). Each dialog names its
    primary action in ``AUTO_FOCUS`` (Textual focuses the first focusable match), so that
    Enter does what the dialog offers first."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog_cancel")]

    def action_cancel(self) -> None:
        self.dismiss(None)


class UnpromptedDialog(Dialog):
    """A dialog that opens on its own, not at a key of the user's: it takes no keys for
    :data:`GRACE_S` (nothing focused, keys dropped), so that keys typed before it appeared,
    meant for the message box, do not press its buttons; then its primary action
    (``PRIMARY``) gets the focus."""

    AUTO_FOCUS = ""
    PRIMARY = ""
    GRACE_S = 0.4

    def __init__(self) -> None:
        super().__init__()
        self.taking_keys = False

    def on_mount(self) -> None:
        self.set_timer(self.GRACE_S, self._take_keys)

    def _take_keys(self) -> None:
        self.taking_keys = True
        self.query_one(self.PRIMARY, Button).focus()

    def on_key(self, event: events.Key) -> None:
        if not self.taking_keys:
            event.prevent_default()
            event.stop()

    def action_cancel(self) -> None:
        if self.taking_keys:
            super().action_cancel()


class PathDialog(Dialog):
    """Asks for a file's path: dismisses with it (stripped), or None. A subclass says its
    ``PREFIX`` (its ids: ``PREFIX-dialog``, ``-ok``, ``-cancel``, and the field's
    ``INPUT``), title, what the file is for, an example path and its button's label."""

    PREFIX = INPUT = TITLE = TEXT = PLACEHOLDER = OK = ""

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id=f"{self.PREFIX}-dialog") as box:
            box.border_title = self.TITLE
            yield Static(self.TEXT, markup=False)
            yield Input(placeholder=self.PLACEHOLDER, id=self.INPUT)
            with Horizontal(classes="row buttons"):
                yield Button(self.OK, id=f"{self.PREFIX}-ok", variant="primary")
                yield Button("Cancel", id=f"{self.PREFIX}-cancel")

    def on_input_submitted(self) -> None:
        self._ok()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == f"{self.PREFIX}-ok":
            self._ok()
        else:
            self.dismiss(None)

    def _ok(self) -> None:
        self.dismiss(self.query_one(f"#{self.INPUT}", Input).value.strip() or None)
