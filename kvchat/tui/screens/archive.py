"""The archive dialog: the exchanges undo and trim dropped from the tab's session, the
last archived first, each as its user message's first line and a preview of the reply;
Enter brings the highlighted one back to the end of the conversation."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, OptionList, Static
from textual.widgets.option_list import Option

from kvchat.safety import printable

from .dialogs import Dialog

PREVIEW = 60  # characters of each line the list shows


def preview(text: str) -> str:
    """The first non-blank line of ``text``, shortened to :data:`PREVIEW` characters, with
    control characters shown as text (model output is untrusted)."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = printable(line, one_line=True)
    return line if len(line) <= PREVIEW else line[: PREVIEW - 1] + "…"


def exchange_label(exchange: list[dict[str, Any]]) -> Text:
    """One exchange as the list shows it: its user message, then its last reply (the one a
    restore shows), as Text: never read as markup."""
    user = next((m for m in exchange if m["role"] == "user"), exchange[0])
    replies = [m for m in exchange if m["role"] == "assistant"]
    said = preview(str(user.get("content") or "")) or "(empty message)"
    answer = preview(str(replies[-1].get("content") or "")) if replies else ""
    more = f" (+{len(replies) - 1} more)" if len(replies) > 1 else ""
    return Text.assemble((said, "bold"), "\n", ("  ↳ " + (answer or "(no reply)") + more, "dim"))


class ArchiveDialog(Dialog):
    """Pick an archived exchange (``exchanges`` as
    :func:`~kvchat.engine.conversation.history.archived_exchanges` gives them, oldest
    first) to bring back; dismisses with its index, or None. The list has the focus, on
    the last archived: Enter restores the highlighted exchange, Escape cancels."""

    AUTO_FOCUS = "#archive-options"

    def __init__(self, exchanges: list[list[dict[str, Any]]]) -> None:
        super().__init__()
        self.exchanges = exchanges
        self.order = list(reversed(range(len(exchanges))))  # the list's rows: last archived first

    def compose(self) -> ComposeResult:
        count = len(self.exchanges)
        with Vertical(classes="dialog", id="archive-dialog") as box:
            box.border_title = f"Archived exchanges ({count})"
            yield OptionList(
                *(Option(exchange_label(self.exchanges[i])) for i in self.order),
                id="archive-options",
                classes="body",
            )
            with Vertical(classes="buttons"):
                yield Static(
                    "Undo and trim keep what they drop here. A restored exchange goes to the "
                    "end of the conversation; the next turn evaluates it.",
                    classes="hint",
                    markup=False,
                )
                with Horizontal(classes="row"):
                    yield Button("Restore", id="archive-restore", variant="primary")
                    yield Button("Cancel", id="archive-cancel")

    def on_mount(self) -> None:
        self.query_one(OptionList).highlighted = 0

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.order[event.option_index])

    @on(Button.Pressed, "#archive-restore")
    def _restore(self) -> None:
        row = self.query_one(OptionList).highlighted
        if row is not None:
            self.dismiss(self.order[row])

    @on(Button.Pressed, "#archive-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
