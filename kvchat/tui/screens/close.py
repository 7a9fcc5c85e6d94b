"""Close a tab (or quit) with unsaved work: save, discard or cancel."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from .dialogs import Dialog


class CloseDialog(Dialog):
    """Closing a tab with unsaved changes, or quitting with several: save them first, discard
    them, or cancel. ``unsaved`` maps each session's name to whether it was saved before."""

    AUTO_FOCUS = "#close-save"

    def __init__(self, unsaved: dict[str, bool], quitting: bool = False) -> None:
        super().__init__()
        self.unsaved = dict(unsaved)
        self.quitting = quitting

    def compose(self) -> ComposeResult:
        def what(saved_before: bool) -> str:
            return "has changes since it was last saved" if saved_before else "has not been saved"

        with Vertical(classes="dialog", id="close-dialog") as box:
            box.border_title = "Quit" if self.quitting else "Close tab"
            if self.quitting:
                yield Static("Unsaved changes:", markup=False)
                yield Static(
                    "\n".join(
                        f"  {name!r} {what(before)}" for name, before in self.unsaved.items()
                    ),
                    id="close-list",
                    markup=False,
                )
                yield Static("Save them before quitting?", markup=False)
            else:
                [(name, before)] = self.unsaved.items()
                yield Static(f"{name!r} {what(before)}. Save it before closing?", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button(
                    "Save all" if self.quitting else "Save", id="close-save", variant="primary"
                )
                yield Button("Discard", id="close-discard", variant="error")
                yield Button("Cancel", id="close-cancel")

    @on(Button.Pressed, "#close-save")
    def _save(self) -> None:
        self.dismiss("save")

    @on(Button.Pressed, "#close-discard")
    def _discard(self) -> None:
        self.dismiss("discard")

    @on(Button.Pressed, "#close-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
