"""The cache-kind dialog: pick a kind from those that apply to the model, or type one
(``rotating:1024``); each line shows what a token costs in it."""

from __future__ import annotations

import mlx.nn as nn
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from kvchat.engine.caches.kinds import OFFERED_KINDS, CacheKindError, parse_kind
from kvchat.engine.caches.sizes import kind_bytes_per_token
from kvchat.units import human_bytes

from .dialogs import Dialog


def kind_choices(current: str, applicable: list[str]) -> list[str]:
    """The kinds the dialog lists: the examples in ``applicable`` (those that apply to the
    model), plus the current kind after its family's example when its number differs
    (``rotating:1024``)."""
    names = [n for n in OFFERED_KINDS if n == current or n in applicable]
    if current not in names:
        family = parse_kind(current).family
        at = max((i for i, n in enumerate(names) if n.split(":")[0] == family), default=-1)
        names.insert(at + 1, current)
    return names


class KindDialog(Dialog):
    """Pick a cache kind, or type one (``rotating:1024``); each line shows its bytes per
    token for this model, and quantized kinds their share of a standard cache's."""

    def __init__(self, current: str, model: nn.Module, applicable: list[str]) -> None:
        super().__init__()
        self.current = current
        self.model = model
        self.names = kind_choices(current, applicable)

    def _label(self, name: str) -> Text:
        kind = parse_kind(name)
        per_token = kind_bytes_per_token(self.model, name)
        if kind.family in ("rotating", "chunked") and kind.size is not None:
            extra = f", at most {human_bytes(int(per_token * kind.size))}"
        elif kind.quantized:
            share = per_token / kind_bytes_per_token(self.model, "standard")
            extra = f" ({share:.2f} × standard)"
        else:
            extra = ""
        mark = "● " if name == self.current else "  "
        return Text.assemble(
            (f"{mark}{name:<14}", "bold"),
            f"{human_bytes(int(per_token)):>10}/token{extra}\n",
            ("    " + kind.description, "dim"),
        )

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="kind-dialog") as box:
            box.border_title = f"Cache type (now {self.current})"
            yield OptionList(
                *(Option(self._label(n), id=n) for n in self.names),
                id="kind-options",
                classes="body",
            )
            with Vertical(classes="buttons"):
                yield Static(
                    "Bytes per token from the model: layers × kv heads × head dim × 2 × "
                    "bytes per element (quantized: bits/8 plus a scale and bias per 64).",
                    classes="hint",
                    markup=False,
                )
                with Horizontal(classes="row"):
                    yield Input(placeholder="or type: rotating:1024", id="kind-input")
                    yield Button("Use", id="kind-use", variant="primary")
                    yield Button("Cancel", id="kind-cancel")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = self.names.index(self.current)
        options.focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Button.Pressed, "#kind-use")
    @on(Input.Submitted, "#kind-input")
    def _typed(self) -> None:
        try:
            kind = parse_kind(self.query_one("#kind-input", Input).value)
        except CacheKindError as error:
            self.notify(str(error), severity="warning", markup=False)
            return
        self.dismiss(kind.name)

    @on(Button.Pressed, "#kind-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
