"""Shown while something long runs before any tab exists (loading the model, a resume)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import LoadingIndicator, ProgressBar, Static


class LoadingScreen(Screen):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Static(self.message, id="loading-message", markup=False)
            yield LoadingIndicator()
            yield ProgressBar(id="loading-progress", show_eta=False)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False

    def set_message(self, message: str) -> None:
        self.query_one("#loading-message", Static).update(message)

    def set_progress(self, done: int, total: int) -> None:
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=max(1, total), progress=done)
