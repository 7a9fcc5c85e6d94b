"""The modal dialogs' bases: :class:`Dialog` (Esc cancels; what it dismisses with, the app
turns into one engine call) and :class:`UnpromptedDialog` (one that opens on its own).
Each dialog has a module of its own beside this one."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Button


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
