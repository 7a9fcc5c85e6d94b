"""The pieces of a transcript: the user's messages, the replies and kvchat's own notices.

Model output is untrusted: every piece goes through :func:`kvchat.safety.printable`
(control characters and escape sequences become visible ``\\xNN`` text) and is
shown either as ``Text`` or through ``Markdown`` with link opening turned off,
never parsed as Rich/Textual markup.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.timer import Timer
from textual.widgets import Markdown, Static

from kvchat.safety import printable


def safe(text: str) -> str:
    """Untrusted text made safe for the terminal (markup is a separate matter: see callers)."""
    return printable(text)


# ------------------------------------------------------------------ messages


class UserMessage(Static):
    """What the user sent, shown as plain text."""

    def __init__(self, content: str) -> None:
        self.text = safe(content)
        super().__init__(Text(self.text), markup=False, classes="message user")
        self.border_title = "you"


class AssistantMessage(Vertical):
    """A reply, rendered as Markdown (streamed while it is written)."""

    def __init__(self, content: str = "", stopped: bool = False) -> None:
        super().__init__(classes="message assistant")
        self.border_title = "assistant"
        self._initial = safe(content)
        self._pending = ""
        self._flush_timer: Timer | None = None
        self._done = False
        self.text = self._initial
        if stopped:
            self.add_class("stopped")
            self.border_subtitle = "stopped"

    def compose(self) -> ComposeResult:
        yield Markdown(self._initial, open_links=False)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def write(self, chunk: str) -> None:
        """Append a streamed piece of the reply; the Markdown catches up in small batches."""
        piece = safe(chunk)
        self.text += piece
        self._pending += piece
        if self._flush_timer is None:
            self._flush_timer = self.set_timer(0.05, self._flush)

    async def _flush(self) -> None:
        self._flush_timer = None
        pending, self._pending = self._pending, ""
        if pending and not self._done:
            await self.markdown.append(pending)

    async def finish(self, reply: str, stopped: bool) -> None:
        """The turn is over: show the reply as kept in the transcript."""
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        self._pending = ""
        self._done = True
        self.text = safe(reply)
        await self.markdown.update(self.text)
        if stopped:
            self.add_class("stopped")
            self.border_subtitle = "stopped"

    @on(Markdown.LinkClicked)
    def _link_clicked(self, event: Markdown.LinkClicked) -> None:
        # Links in model output open nothing; show where they point instead.
        event.stop()
        self.notify(f"Link (not opened): {safe(event.href)}", markup=False, timeout=6)


class NoticeMessage(Static):
    """A line from kvchat itself (a rebuild, a load notice, an error)."""

    def __init__(self, content: str, kind: str = "info") -> None:
        super().__init__(Text(safe(content)), markup=False, classes=f"message notice {kind}")
