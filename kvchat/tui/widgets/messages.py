"""The pieces of a transcript: the user's messages, the replies and kvchat's own notices.

Model output is untrusted: every piece goes through :func:`kvchat.safety.printable`
(control characters and escape sequences become visible ``\\xNN`` text) and is
shown either as ``Text`` or through ``Markdown`` with link opening turned off,
never parsed as Rich/Textual markup.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Collapsible, Markdown, Static

from kvchat.engine.conversation.thoughts import Thoughts, split_thoughts
from kvchat.safety import printable


def safe(text: str) -> str:
    """Untrusted text made safe for the terminal (markup is a separate matter: see callers)."""
    return printable(text)


# A streamed reply's view catches up in batches. Each costs the UI thread a layout and a
# redraw that grow with the reply (Textual lays the log out again and re-wraps the growing
# paragraph), and on a small machine that CPU is taken from the decoding: qwen2.5-0.5b@q4 on
# 2 cores streamed at 46 tok/s with a batch every 50 ms (the UI thread 36% of a core), 64-68
# with one a second. So batches come at least FLUSH_S apart, and further apart (up to
# FLUSH_MAX_S) as they cost more: the UI thread's CPU since the last batch, over DRAW_SHARE.
FLUSH_S = 0.05
FLUSH_MAX_S = 0.5
DRAW_SHARE = 0.15  # (0.15 and 0.1 alike: 55-57 tok/s, the UI thread 16-18% of a core)


class Pace:
    """How long a streamed reply's view waits before its next batch (``wait``): called on the
    UI thread, whose CPU time it reads."""

    def __init__(self) -> None:
        self.wait = FLUSH_S
        self._cpu = time.thread_time()

    def batch(self) -> None:
        """A batch is drawn now: the next waits for the UI thread's CPU time since the last
        over DRAW_SHARE, within FLUSH_S … FLUSH_MAX_S."""
        cpu = time.thread_time()
        self.wait = min(FLUSH_MAX_S, max(FLUSH_S, (cpu - self._cpu) / DRAW_SHARE))
        self._cpu = cpu


# ------------------------------------------------------------------ messages


class MessageAction(Message):
    """A key or click on the message at ``index`` of the transcript asks for ``action``
    (``edit``, ``regenerate``, ``copy``, ``copy_code``, ``delete``, ``branch`` with
    ``step``, ``leave``); the conversation carries it out."""

    def __init__(self, index: int, action: str, step: int = 0) -> None:
        super().__init__()
        self.index = index
        self.action = action
        self.step = step


# A message of the transcript is selected by clicking it or with Ctrl+Up from the message
# box; these keys then act on it.
SELECTED_BINDINGS = [
    Binding("up,k", "move(-1)", "Earlier message", id="message_up", show=False),
    Binding("down,j", "move(1)", "Later message", id="message_down", show=False),
    Binding(
        "enter,e",
        "act('edit')",
        "Edit",
        id="message_edit",
        tooltip="Edit your message and send it again: the old continuation stays as a branch.",
    ),
    Binding(
        "r",
        "act('regenerate')",
        "Regenerate",
        id="message_regenerate",
        tooltip="A new version of this reply (or of the reply to this message), as a branch.",
    ),
    Binding(
        "left,[",
        "branch(-1)",
        "‹ Branch",
        id="branch_previous",
        key_display="←",
        tooltip="Show the previous version of this message (‹).",
    ),
    Binding(
        "right,]",
        "branch(1)",
        "Branch ›",
        id="branch_next",
        key_display="→",
        tooltip="Show the next version of this message (›).",
    ),
    Binding(
        "c",
        "act('copy')",
        "Copy",
        id="message_copy",
        tooltip="Copy the message's text to the clipboard.",
    ),
    Binding(
        "y",
        "act('copy_code')",
        "Copy code",
        id="message_copy_code",
        tooltip="Copy a code block of the message; again: the next one.",
    ),
    Binding(
        "d,delete",
        "act('delete')",
        "Delete",
        id="message_delete",
        tooltip="Delete this exchange (your message and its reply).",
    ),
    Binding(
        "t",
        "thoughts",
        "Thoughts",
        id="message_thoughts",
        tooltip="Show or hide the reply's thoughts (its <think> blocks).",
    ),
    Binding("escape", "act('leave')", "Back to the message box", id="message_leave", show=False),
]


if TYPE_CHECKING:
    from textual.widget import Widget

    _Mixed = Widget  # what a Selectable is mixed into
else:
    _Mixed = object


class Selectable(_Mixed):
    """The keys of a selected message (a mixin of a widget; the class sets ``BINDINGS``)."""

    can_focus = True
    index: int = -1

    def action_move(self, step: int) -> None:
        if self.parent is None:  # not mounted (any more)
            return
        siblings = [w for w in self.parent.children if isinstance(w, Selectable)]
        at = siblings.index(self) + step
        if at >= len(siblings):
            self.post_message(MessageAction(self.index, "leave"))
        elif at >= 0:
            siblings[at].focus()
            siblings[at].scroll_visible(animate=False)

    def action_act(self, action: str) -> None:
        self.post_message(MessageAction(self.index, action))

    def action_branch(self, step: int) -> None:
        self.post_message(MessageAction(self.index, "branch", step))

    def has_thoughts(self) -> bool:
        return False

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # "thoughts" only on a reply that has some (hidden from the footer elsewhere)
        return self.has_thoughts() if action == "thoughts" else True


class UserMessage(Selectable, Static):
    """What the user sent, shown as plain text; ``index`` is its place in the transcript."""

    BINDINGS = [*SELECTED_BINDINGS]

    def __init__(self, content: str, index: int = -1) -> None:
        self.text = safe(content)
        super().__init__(Text(self.text), markup=False, classes="message user")
        self.border_title = "you"
        self.index = index


class AssistantMessage(Selectable, Vertical):
    """A reply, rendered as Markdown (streamed while it is written). Its thoughts
    (``<think>`` blocks) go in a collapsed :class:`Collapsible` above the answer;
    ``text`` stays the whole reply."""

    BINDINGS = [*SELECTED_BINDINGS]

    def __init__(
        self, content: str = "", stopped: bool = False, note: str | None = None, index: int = -1
    ) -> None:
        super().__init__(classes="message assistant")
        self.index = index
        self._note = note
        self.border_title = "assistant"
        self._initial = safe(content)
        self._shown = ""  # the answer as the Markdown has it
        self._thought_shown = ""  # the thoughts as their Static has them
        self._flush_timer: Timer | None = None
        self._pace = Pace()
        self._done = False
        self._has_thoughts = False
        self.text = self._initial
        if stopped:
            self.add_class("stopped")
            self.border_subtitle = "stopped"

    def compose(self) -> ComposeResult:
        parts = split_thoughts(self._initial)
        self._thought_shown = parts.thought
        thoughts = Collapsible(
            Static(Text(parts.thought), classes="thought-text", markup=False),
            title=thought_title(parts),
            classes="thoughts",
        )
        thoughts.display = self._has_thoughts = bool(parts.thought or parts.thinking)
        yield thoughts
        self._shown = parts.answer
        yield Markdown(parts.answer, open_links=False)
        if self._note:
            yield Static(Text(self._note), classes="note", markup=False)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def thoughts(self) -> Collapsible:
        return self.query_one(".thoughts", Collapsible)

    def has_thoughts(self) -> bool:
        return self._has_thoughts

    def action_thoughts(self) -> None:
        self.thoughts.collapsed = not self.thoughts.collapsed

    async def write(self, chunk: str) -> None:
        """Append a streamed piece of the reply; the view catches up in small batches."""
        self.text += safe(chunk)
        if self._flush_timer is None:
            self._flush_timer = self.set_timer(self._pace.wait, self._flush)

    async def _flush(self) -> None:
        self._flush_timer = None
        if not self._done:
            self._pace.batch()
            await self._show(self.text)

    async def _show(self, text: str, whole: bool = False) -> None:
        """Show ``text`` split: the thoughts in the collapsible, the answer as Markdown
        (appended to while it only grows, as a stream does, unless ``whole``)."""
        parts = split_thoughts(text)
        thoughts = self.thoughts
        if parts.thought != self._thought_shown:  # an update lays the whole screen out again
            self._thought_shown = parts.thought
            thoughts.query_one(".thought-text", Static).update(Text(parts.thought))
        thoughts.title = thought_title(parts)
        if self._has_thoughts != bool(parts.thought or parts.thinking):
            thoughts.display = self._has_thoughts = not self._has_thoughts
            self.refresh_bindings()
        if not whole and parts.answer.startswith(self._shown):
            if parts.answer != self._shown:
                await self.markdown.append(parts.answer[len(self._shown) :])
        else:
            await self.markdown.update(parts.answer)
        self._shown = parts.answer

    async def finish(self, reply: str, stopped: bool, note: str | None = None) -> None:
        """The turn is over: show the reply as kept in the transcript, and the turn's note
        (it goes with this reply: a regenerate removes both)."""
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        self._done = True
        self.text = safe(reply)
        await self._show(self.text, whole=True)
        if note:
            await self.mount(Static(Text(note), classes="note", markup=False))
        if stopped:
            self.add_class("stopped")
            self.border_subtitle = "stopped"

    @on(Markdown.LinkClicked)
    def _link_clicked(self, event: Markdown.LinkClicked) -> None:
        # Links in model output open nothing; show where they point instead.
        event.stop()
        self.notify(f"Link (not opened): {safe(event.href)}", markup=False, timeout=6)


def thought_title(parts: Thoughts) -> str:
    words = len(parts.thought.split())
    return f"{'Thinking…' if parts.thinking else 'Thought'} ({words:,} word{'s' * (words != 1)})"


class BranchBar(Static):
    """‹ k/n › under a message that has other versions: a click on ‹ or › switches."""

    def __init__(self, index: int, position: tuple[int, int], role: str) -> None:
        k, n = position
        super().__init__(f"‹ {k}/{n} ›", markup=False, classes=f"branch-bar {role}")
        self.index = index

    def on_click(self, event) -> None:
        event.stop()
        width = self.content_size.width
        if event.x <= 1:
            self.post_message(MessageAction(self.index, "branch", -1))
        elif event.x >= width - 2:
            self.post_message(MessageAction(self.index, "branch", 1))


class NoticeMessage(Static):
    """A line from kvchat itself (a rebuild, a load notice, an error)."""

    def __init__(self, content: str, kind: str = "info") -> None:
        super().__init__(Text(safe(content)), markup=False, classes=f"message notice {kind}")


def rebuild_note(reason: str | None) -> str | None:
    """The line shown under a reply whose turn had to rebuild the cache."""
    return f"The cache was rebuilt for this turn: {reason}." if reason else None


class Welcome(Static):
    """The empty tab's hint: what the panel shows and the keys to start with."""

    TEXT = (
        "Type a message below: Enter sends it, Ctrl+J starts a new line.\n\n"
        "Each tab keeps its own KV cache, so a follow-up evaluates only the new message. "
        "The KV cache panel (Ctrl+B shows or hides it) says what the cache holds and what "
        "the last turn reused, evaluated and cost.\n\n"
        "F1 lists every key; Ctrl+P finds any action; Ctrl+O opens a saved session."
    )

    def __init__(self) -> None:
        super().__init__(self.TEXT, classes="message welcome", markup=False)
        self.border_title = "kvchat"
