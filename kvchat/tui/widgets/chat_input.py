"""The message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line."""

from __future__ import annotations

from typing import Any

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from kvchat.safety import printable


class ChatInput(TextArea):
    """A multi-line message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line."""

    BINDINGS = [
        # Not in the footer: the box's placeholder says so, and the footer is short of room.
        Binding("enter", "submit", "Send", show=False),
        Binding("ctrl+j,shift+enter", "newline", "New line", key_display="^j", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        # TextArea inserts a newline on Enter before bindings are looked at, and a
        # priority binding would run ahead of keys still queued (typed text), so the
        # keys of BINDINGS are dispatched here, in order with the typing.
        for binding in self.BINDINGS:
            if event.key in [key.strip() for key in binding.key.split(",")]:
                event.stop()
                event.prevent_default()
                await self.run_action(binding.action)
                return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        # In place of TextArea's paste: control characters (the ESC of a pasted colour
        # code) would reach the terminal raw, so they are shown as ``\\xNN`` text.
        event.stop()
        event.prevent_default()
        if self.read_only:
            return
        text = printable(event.text.replace("\r\n", "\n").replace("\r", "\n"))
        result = self.replace(text, *self.selection)
        self.move_cursor(result.end_location)
        self.focus()

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        self.insert("\n")
