"""The undo/trim dialog (Ctrl+L): undo the last turn, or keep the newest turns within a
number of tokens."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Static

from .dialogs import Dialog


@dataclass(frozen=True)
class TrimChoice:
    undo: int = 0
    max_tokens: int | None = None


class TrimDialog(Dialog):
    """Undo the last turn, or drop the oldest turns until the history fits N tokens."""

    AUTO_FOCUS = "#trim-undo, #trim-cancel"

    def __init__(self, cache_tokens: int, turns: int) -> None:
        super().__init__()
        self.cache_tokens = cache_tokens
        self.turns = turns

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="trim-dialog") as box:
            box.border_title = "Undo or trim"
            with VerticalScroll(classes="body"):
                if self.turns:
                    yield Static(
                        f"The cache holds {self.cache_tokens:,} tokens over {self.turns} turn(s).",
                        markup=False,
                    )
                else:
                    yield Static("Nothing to undo yet: this session has no turn.", markup=False)
                yield Button(
                    "Undo last turn", id="trim-undo", variant="primary", disabled=not self.turns
                )
                yield Label("…or keep the system prompt and the newest turns, at most:")
                with Horizontal(classes="row"):
                    yield Input(
                        placeholder="tokens",
                        id="trim-tokens",
                        type="integer",
                        value=str(max(1, self.cache_tokens // 2)),
                    )
                    yield Button("Trim to tokens", id="trim-to", variant="warning")
            with Horizontal(classes="row buttons"):
                yield Button("Cancel", id="trim-cancel")

    @on(Button.Pressed, "#trim-undo")
    def _undo(self) -> None:
        self.dismiss(TrimChoice(undo=1))

    @on(Button.Pressed, "#trim-to")
    @on(Input.Submitted, "#trim-tokens")
    def _trim(self) -> None:
        raw = self.query_one("#trim-tokens", Input).value.strip()
        if not raw.isdigit() or int(raw) < 1:
            self.notify("Give a number of tokens (1 or more).", severity="warning")
            return
        self.dismiss(TrimChoice(max_tokens=int(raw)))

    @on(Button.Pressed, "#trim-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
