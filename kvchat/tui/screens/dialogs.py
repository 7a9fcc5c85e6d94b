"""Modal dialogs: trim, cache kind, drop, rename. Each one dismisses with a small result
that the app turns into one engine call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from kvchat.drafts import OFFER
from kvchat.engine.caches.kinds import (
    OFFERED_KINDS,
    CacheKindError,
    group_size,
    parse_kind,
)
from kvchat.safety import printable
from kvchat.units import human_bytes


class Dialog(ModalScreen):
    """A modal with a title; Escape cancels (dismisses with None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog_cancel")]
    TITLE_TEXT = ""

    def action_cancel(self) -> None:
        self.dismiss(None)


# ----------------------------------------------------------------------- trim


@dataclass(frozen=True)
class TrimChoice:
    undo: int = 0
    max_tokens: int | None = None


class TrimDialog(Dialog):
    """Undo the last turn, or drop the oldest turns until the history fits N tokens."""

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


# ----------------------------------------------------------------- cache kind


def model_kv_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, bytes per element) of a model's attention cache."""
    args = getattr(model, "args", None)
    layers = len(getattr(model, "layers", []))
    heads: int = getattr(args, "num_key_value_heads", 0) or getattr(args, "num_attention_heads", 1)
    head_dim: int = getattr(args, "head_dim", None) or (
        getattr(args, "hidden_size", 0) // max(1, getattr(args, "num_attention_heads", 1))
    )
    size = 4
    # (path, array) pairs: mlx's annotation also allows the dict it fills when given one
    for _, value in cast(list[tuple[str, Any]], tree_flatten(model.parameters())):
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            size = value.dtype.size
            break
    return layers, heads, head_dim, size


def kind_bytes_per_token(model: nn.Module, kind_name: str) -> float:
    """Bytes one token adds to a cache of ``kind_name``, computed from the model's shape:
    layers × kv heads × head dim × 2 (keys and values) × bytes per element; quantized
    and rotated kinds store ``bits/8`` bytes per element plus a scale and a bias per group
    (of 64, or 32 where the head size needs it)."""
    layers, heads, head_dim, size = model_kv_shape(model)
    elements = layers * heads * head_dim * 2
    kind = parse_kind(kind_name)
    if kind.quantized and kind.size is not None:  # its family takes a size: it has one
        return elements * (kind.size / 8 + 2 * size / group_size(model, kind))
    return float(elements * size)


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


# ----------------------------------------------------------------------- drop


class DropDialog(Dialog):
    """Confirm dropping a session: from memory only (it stays on disk) or from disk too;
    ``then`` says what becomes of its tab."""

    def __init__(self, name: str, on_disk: bool, then: str = "close its tab") -> None:
        super().__init__()
        self.session_name = name
        self.on_disk = on_disk
        self.then = then

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="drop-dialog") as box:
            box.border_title = "Drop session"
            where = "It is saved on disk." if self.on_disk else "It has not been saved."
            yield Static(f"Drop {self.session_name!r} and {self.then}? {where}", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button("Memory only", id="drop-memory", variant="warning")
                yield Button("Memory and disk", id="drop-disk", variant="error")
                yield Button("Cancel", id="drop-cancel")

    @on(Button.Pressed, "#drop-memory")
    def _memory(self) -> None:
        self.dismiss("memory")

    @on(Button.Pressed, "#drop-disk")
    def _disk(self) -> None:
        self.dismiss("disk")

    @on(Button.Pressed, "#drop-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


# --------------------------------------------------------------------- rename


class RenameDialog(Dialog):
    """A new name for the session (it is also the name it is saved under)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.session_name = name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="rename-dialog") as box:
            box.border_title = "Rename session"
            yield Input(value=self.session_name, id="rename-input")
            with Horizontal(classes="row buttons"):
                yield Button("Rename", id="rename-ok", variant="primary")
                yield Button("Cancel", id="rename-cancel")

    @on(Button.Pressed, "#rename-ok")
    @on(Input.Submitted, "#rename-input")
    def _ok(self) -> None:
        self.dismiss(self.query_one("#rename-input", Input).value.strip() or None)

    @on(Button.Pressed, "#rename-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


# ---------------------------------------------------------------------- close


class CloseDialog(Dialog):
    """Closing a tab with unsaved changes, or quitting with several: save them first, discard
    them, or cancel. ``unsaved`` maps each session's name to whether it was saved before."""

    def __init__(self, unsaved: dict[str, bool], quitting: bool = False) -> None:
        super().__init__()
        self.unsaved = dict(unsaved)
        self.quitting = quitting

    def compose(self) -> ComposeResult:
        def what(saved_before: bool) -> str:
            return "has changes since it was last saved" if saved_before else "has not been saved"

        with Vertical(classes="dialog", id="close-dialog") as box:
            box.border_title = "Quit" if self.quitting else "Close tab"
            if self.quitting:
                yield Static("Unsaved changes:", markup=False)
                yield Static(
                    "\n".join(
                        f"  {name!r} {what(before)}" for name, before in self.unsaved.items()
                    ),
                    id="close-list",
                    markup=False,
                )
                yield Static("Save them before quitting?", markup=False)
            else:
                [(name, before)] = self.unsaved.items()
                yield Static(f"{name!r} {what(before)}. Save it before closing?", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button(
                    "Save all" if self.quitting else "Save", id="close-save", variant="primary"
                )
                yield Button("Discard", id="close-discard", variant="error")
                yield Button("Cancel", id="close-cancel")

    def on_mount(self) -> None:
        self.query_one("#close-save", Button).focus()

    @on(Button.Pressed, "#close-save")
    def _save(self) -> None:
        self.dismiss("save")

    @on(Button.Pressed, "#close-discard")
    def _discard(self) -> None:
        self.dismiss("discard")

    @on(Button.Pressed, "#close-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ConflictDialog(Dialog):
    """Another kvchat saved this tab's session since the tab loaded it: keep both, as
    branches of the session (reloaded), or as a new session; or decide later."""

    def __init__(self, name: str, new_name: str) -> None:
        super().__init__()
        self.session_name = name
        self.new_name = new_name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="conflict-dialog") as box:
            box.border_title = "Session changed on disk"
            yield Static(
                f"Another kvchat saved {self.session_name!r} since this tab loaded it; "
                "nothing was overwritten. Reload it (its turns shown, this tab's kept as a "
                f"branch), or save this tab as a new session {self.new_name!r}?",
                markup=False,
            )
            with Horizontal(classes="row buttons"):
                yield Button("Reload", id="conflict-reload", variant="primary")
                yield Button("New session", id="conflict-fork")
                yield Button("Later", id="conflict-later")

    def on_mount(self) -> None:
        self.query_one("#conflict-reload", Button).focus()

    @on(Button.Pressed, "#conflict-reload")
    def _reload(self) -> None:
        self.dismiss("reload")

    @on(Button.Pressed, "#conflict-fork")
    def _fork(self) -> None:
        self.dismiss("fork")

    @on(Button.Pressed, "#conflict-later")
    def _later(self) -> None:
        self.dismiss(None)


class DraftDialog(Dialog):
    """A message that was being sent when kvchat stopped: put it back in the message box,
    or let it go. (Escape asks again next time the session is opened.)"""

    def __init__(self, name: str, text: str) -> None:
        super().__init__()
        self.session_name = name
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="draft-dialog") as box:
            box.border_title = f"Unsent message ({self.session_name})"
            lines = self.text.count("\n") + 1
            yield Static(
                f"{OFFER} ({len(self.text):,} characters, {lines:,} line(s))", markup=False
            )
            preview = self.text if len(self.text) <= 300 else self.text[:300] + "…"
            yield Static(printable(preview), id="draft-preview", classes="body", markup=False)
            with Horizontal(classes="row buttons"):
                yield Button("Restore", id="draft-restore", variant="primary")
                yield Button("Discard", id="draft-discard", variant="error")

    def on_mount(self) -> None:
        self.query_one("#draft-restore", Button).focus()

    @on(Button.Pressed, "#draft-restore")
    def _restore(self) -> None:
        self.dismiss("restore")

    @on(Button.Pressed, "#draft-discard")
    def _discard(self) -> None:
        self.dismiss("discard")


# ----------------------------------------------------------------------- file


class FileDialog(Dialog):
    """The path of a text file whose text goes into the message at the cursor."""

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="file-dialog") as box:
            box.border_title = "Insert a file"
            yield Static(
                "Its text goes into the message at the cursor (not sent); "
                "UTF-8 text, at most 1 MiB.",
                markup=False,
            )
            yield Input(placeholder="path, e.g. ~/notes.txt", id="file-input")
            with Horizontal(classes="row buttons"):
                yield Button("Insert", id="file-ok", variant="primary")
                yield Button("Cancel", id="file-cancel")

    @on(Button.Pressed, "#file-ok")
    @on(Input.Submitted, "#file-input")
    def _ok(self) -> None:
        self.dismiss(self.query_one("#file-input", Input).value.strip() or None)

    @on(Button.Pressed, "#file-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
