"""Drop a session: close its tab, or delete it from disk too."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from .dialogs import Dialog


class DropDialog(Dialog):
    """Confirm dropping a session: from memory only (it stays on disk) or from disk too;
    ``then`` says what becomes of its tab. Enter drops it from memory only (it stays on
    disk)."""

    AUTO_FOCUS = "#drop-memory"

    def __init__(self, name: str, on_disk: bool, then: str = "close its tab") -> None:
        super().__init__()
        self.session_name = name
        self.on_disk = on_disk
        self.then = then

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="drop-dialog") as box:
            box.border_title = "Drop session"
            where = "It is saved on disk." if self.on_disk else "It has not been saved."
            yield Static(f"Drop {self.session_name!r} and {self.then}? {where}", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button("Memory only", id="drop-memory", variant="warning")
                yield Button("Memory and disk", id="drop-disk", variant="error")
                yield Button("Cancel", id="drop-cancel")

    @on(Button.Pressed, "#drop-memory")
    def _memory(self) -> None:
        self.dismiss("memory")

    @on(Button.Pressed, "#drop-disk")
    def _disk(self) -> None:
        self.dismiss("disk")

    @on(Button.Pressed, "#drop-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
