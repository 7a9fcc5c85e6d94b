"""The export and import dialogs: a path (and for an export, Markdown or JSON)."""

from __future__ import annotations

from pathlib import PurePath

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Static

from kvchat.store import FORMATS

from .dialogs import Dialog, PathDialog

SUFFIXES = {fmt: f".{fmt}" for fmt in FORMATS}


class ExportDialog(Dialog):
    """Dismisses with (format, path): the button pressed, or Enter by the path's suffix.
    A path ending in the other format's suffix gets the chosen one's."""

    AUTO_FOCUS = "#export-path"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.session_name = name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="export-dialog") as box:
            box.border_title = "Export the transcript"
            yield Static(
                "The same formats as `kvchat sessions export`; an existing file is never replaced.",
                markup=False,
            )
            yield Input(value=f"{self.session_name}.md", id="export-path")
            with Horizontal(classes="row buttons"):
                yield Button("Markdown", id="export-md", variant="primary")
                yield Button("JSON", id="export-json")
                yield Button("Cancel", id="export-cancel")

    @on(Input.Submitted, "#export-path")
    def _by_suffix(self) -> None:
        path = self.query_one("#export-path", Input).value.strip()
        self._done("json" if path.lower().endswith(".json") else "md")

    @on(Button.Pressed, "#export-md")
    def _markdown(self) -> None:
        self._done("md")

    @on(Button.Pressed, "#export-json")
    def _json(self) -> None:
        self._done("json")

    def _done(self, fmt: str) -> None:
        path = self.query_one("#export-path", Input).value.strip()
        if not path:
            return
        if PurePath(path).suffix.lower() in SUFFIXES.values():
            path = str(PurePath(path).with_suffix(SUFFIXES[fmt]))
        self.dismiss((fmt, path))

    @on(Button.Pressed, "#export-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ImportDialog(PathDialog):
    """Dismisses with the path of a JSON export, or None."""

    AUTO_FOCUS = "#import-path"
    PREFIX, INPUT, TITLE, OK = "import", "import-path", "Import a session", "Import"
    TEXT = (
        "A JSON export (`kvchat sessions export NAME --format json`) becomes "
        "a new session; its cache is built on its first turn."
    )
    PLACEHOLDER = "path, e.g. ~/talk.json"
