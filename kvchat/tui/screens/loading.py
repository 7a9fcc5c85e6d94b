"""Shown while something long runs before any tab exists (loading the model, a resume)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import LoadingIndicator, ProgressBar, Static

from kvchat.safety import printable


class LoadingScreen(Screen):
    """A message, a spinner and a progress bar; below them the ``transcript`` of the session
    being opened (role and text of its last messages, as saved), to read at once. What is
    typed meanwhile (printable keys, Backspace) is kept: ``keep(text)`` gets it when the
    screen goes, for the message box of the tab that opens next."""

    def __init__(
        self,
        message: str,
        keep: Callable[[str], None] | None = None,
        transcript: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__()
        self.message = message
        self.keep = keep
        self.transcript = transcript or []
        self.typed = ""

    def on_key(self, event: events.Key) -> None:
        if self.keep is None:
            return
        if event.key == "backspace":
            self.typed = self.typed[:-1]
        elif event.is_printable and event.character:
            self.typed += event.character
        else:
            return
        event.stop()

    def on_unmount(self) -> None:
        if self.keep is not None and self.typed:
            self.keep(self.typed)

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Static(self.message, id="loading-message", markup=False)
            yield LoadingIndicator()
            yield ProgressBar(id="loading-progress", show_eta=False)
        if self.transcript:
            with VerticalScroll(id="loading-transcript"):
                for role, text in self.transcript:  # as saved: untrusted text, never markup
                    yield Static(f"{role}: {printable(text)}", markup=False, classes=role)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False
        if self.transcript:
            self.query_one("#loading-transcript").scroll_end(animate=False)

    def set_message(self, message: str) -> None:
        self.message = message
        self.query_one("#loading-message", Static).update(message)

    def set_progress(self, done: int, total: int, what: str = "tokens") -> None:
        """Show ``done`` of ``total`` on the bar and after the message, followed by ``what``
        they count ("tokens", "layers read", "layers written, 40 MiB of 310 MiB")."""
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=max(1, total), progress=done)
        self.query_one("#loading-message", Static).update(
            f"{self.message} {done:,} of {total:,} {what}"
        )


def loading_progress(
    screen: object, call_from_thread: Callable[..., Any]
) -> Callable[[int, int, str], None] | None:
    """A model's build and load progress (layers written or read, of how many: a demo
    model's build first says the bytes it takes) for ``screen``, if it is a loading
    screen, reported from the loading thread through ``call_from_thread``."""
    if not isinstance(screen, LoadingScreen):
        return None
    return lambda done, total, what: call_from_thread(screen.set_progress, done, total, what)
