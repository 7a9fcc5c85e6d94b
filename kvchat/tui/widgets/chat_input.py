"""The message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line, Up/Down walk
the prompt history, Ctrl+G opens the message in ``$EDITOR``, ``/file PATH`` and Ctrl+F
insert a file's text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import events, work
from textual.app import SuspendNotSupported
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from kvchat.safety import printable
from kvchat.store import StoreError
from kvchat.tui import prompt_history as history
from kvchat.tui.prompt_tools import (
    PromptToolError,
    edit_in_editor,
    editor_command,
    file_request,
    read_text_file,
)

from ..keymap import keys_of
from ..screens.file_name import FileDialog


class ChatInput(TextArea):
    """A multi-line message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line.

    History works as in zsh or fish: Up in an empty box recalls the newest prompt;
    while the box holds a recalled prompt unchanged, Up on its first line goes
    further back and Down on its last line comes forward (past the newest: the
    empty box again), and Esc empties the box (once the reply being written, if any, is
    stopped: Esc stops it first). Typed text is never replaced by
    Up/Down, which then move the cursor as usual; editing a recalled prompt makes it
    a new message and leaves the history as it was.
    """

    BINDINGS = [
        # Not in the footer: the box's placeholder says so, and the footer is short of room.
        Binding("enter", "submit", "Send", id="send", show=False),
        Binding(
            "ctrl+j,shift+enter", "newline", "New line", id="newline", key_display="^j", show=False
        ),
        Binding(
            "up",
            "history(1)",
            "Earlier prompt",
            id="history_back",
            show=False,
            tooltip="In an empty box (or on a recalled prompt): the prompt sent before.",
        ),
        Binding(
            "down",
            "history(-1)",
            "Later prompt",
            id="history_forward",
            show=False,
            tooltip="On a recalled prompt: the prompt sent after it.",
        ),
        Binding(
            "escape",
            "leave_history",
            "Leave history",
            id="leave_history",
            show=False,
            tooltip="On a recalled prompt: empty the box again.",
        ),
        # Ctrl+E stays the end of the line, as in the shells and TextArea.
        Binding(
            "ctrl+g",
            "editor",
            "Edit in $EDITOR",
            id="editor",
            key_display="^g",
            show=False,
            tooltip="Open the message in $VISUAL or $EDITOR; saving there puts it back.",
        ),
        Binding(
            "ctrl+f",
            "insert_file",
            "Insert file",
            id="insert_file",
            key_display="^f",
            show=False,
            tooltip="Put a text file's text in the message at the cursor (also: /file PATH).",
        ),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(
        self,
        prompts: Callable[[], list[str]] = list,
        count_tokens: Callable[[str], int] = len,
        busy: Callable[[], bool] = bool,
        keymap: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kwargs)
        self.prompts = prompts  # the prompts Up walks, newest first (TextArea.history is undo)
        self.count_tokens = count_tokens  # by the tab's tokenizer, for an inserted file
        self.busy = busy  # whether the tab is writing a reply (Esc then stops it first)
        self.keymap = {} if keymap is None else keymap  # the app's [keymap]: binding id -> keys
        self._walk: list[str] = []  # the history as it was when the walk began
        self._at = -1  # index into _walk of the prompt shown; -1: not walking

    @work(thread=True, group="history")
    def remember(self, text: str) -> None:
        """Worker: put a sent ``text`` first in the saved prompt history (its lock may wait
        seconds for another kvchat: never on the UI thread)."""
        try:
            history.remember(text)
        except (OSError, StoreError) as error:
            self.notify(
                f"The prompt history was not saved: {error}", severity="warning", markup=False
            )  # thread-safe

    @property
    def recalled(self) -> bool:
        """True while the box shows a prompt from the history, unchanged."""
        return 0 <= self._at < len(self._walk) and self.text == self._walk[self._at]

    async def _on_key(self, event: events.Key) -> None:
        # TextArea inserts a newline on Enter before bindings are looked at, and a
        # priority binding would run ahead of keys still queued (typed text), so these
        # two are dispatched here, in order with the typing. The others go the usual way.
        keymap = self.keymap
        for binding in self.BINDINGS:
            if not isinstance(binding, Binding):
                continue
            if binding.action in ("submit", "newline") and event.key in keys_of(binding, keymap):
                event.stop()
                event.prevent_default()
                await self.run_action(binding.action)
                return
        await super()._on_key(event)

    def _walks(self, step: int) -> bool:
        """Whether Up (``step`` 1) or Down (-1) walks the history now, else moves the cursor."""
        if not self.recalled:
            return step == 1 and not self.text
        row = self.cursor_location[0]
        return row == 0 if step == 1 else row == self.document.line_count - 1

    def action_history(self, step: int) -> None:
        if not self._walks(step):
            (self.action_cursor_up if step == 1 else self.action_cursor_down)()
            return
        if not self.recalled:
            self._walk = self.prompts()
            self._at = -1
        at = self._at + step
        if at >= len(self._walk):
            self.app.bell()
            return
        self._at = at
        self.put(self._walk[at] if at >= 0 else "")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "leave_history":  # else Esc is the app's (stop the reply), in the footer too
            return self.recalled and not self.busy()
        return super().check_action(action, parameters)

    def action_leave_history(self) -> None:
        self._at = -1
        self.put("")

    def put(self, text: str) -> None:
        """Put ``text`` in the box, the cursor at its end (where typing goes on)."""
        self.text = text
        self.move_cursor(self.document.end)

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
        """Send the message; a last line ``/file PATH`` is replaced by the file's text
        instead, and nothing is sent."""
        request = file_request(self.text)
        if request is None:
            self.post_message(self.Submitted(self.text))
            return
        before, path = request
        text = self._file_text(path)
        if text is not None:
            self.put(before + text)

    def action_newline(self) -> None:
        self.insert("\n")

    def action_editor(self) -> None:
        """Hand the terminal to ``$VISUAL``/``$EDITOR`` on the message; its saved text
        comes back into the box. Any failure keeps the text as it was, with a notice."""
        try:
            command = editor_command()
            with self.app.suspend():
                text = edit_in_editor(self.text, command)
        except SuspendNotSupported:
            self.notify("This terminal cannot hand over to an editor.", severity="warning")
            return
        except PromptToolError as error:
            self.notify(str(error), severity="warning", markup=False)
            return
        self.put(printable(text))
        self.focus()

    def action_insert_file(self) -> None:
        def chosen(path: str | None) -> None:
            text = self._file_text(path) if path else None
            if text is not None:
                self.insert(text)

        self.app.push_screen(FileDialog(), chosen)

    def _file_text(self, path: str) -> str | None:
        """The text of the file at ``path`` for the box (control characters shown as
        ``\\xNN``), with a notice of its token count; None, with a one-line notice saying
        why, when it cannot be used (the box is then left as it was)."""
        try:
            text = read_text_file(path)
        except PromptToolError as error:
            self.notify(str(error), severity="warning", markup=False)
            return None
        self.notify(
            f"Inserted {printable(path, one_line=True)}: {self.count_tokens(text):,} "
            f"tokens ({len(text.encode()):,} bytes); Enter sends.",
            markup=False,
            timeout=8,
        )
        return printable(text)
