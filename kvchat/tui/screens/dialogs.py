"""Modal dialogs: trim (and a confirmation), drop, rename, close, a conflict, a kept draft,
a file name (the cache-kind dialog is in :mod:`.kind`). Each one dismisses with a small
result that the app turns into one engine call."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from kvchat.drafts import OFFER
from kvchat.safety import printable


class Dialog(ModalScreen):
    """A modal with a title; Escape cancels (dismisses with None). Each dialog names its
    primary action in ``AUTO_FOCUS`` (Textual focuses the first focusable match), so that
    Enter does what the dialog offers first."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog_cancel")]
    TITLE_TEXT = ""

    def action_cancel(self) -> None:
        self.dismiss(None)


class UnpromptedDialog(Dialog):
    """A dialog that opens on its own, not at a key of the user's: it takes no keys for
    :data:`GRACE_S` (nothing focused, keys dropped), so that keys typed before it appeared,
    meant for the message box, do not press its buttons; then its primary action
    (``PRIMARY``) gets the focus."""

    AUTO_FOCUS = ""
    PRIMARY = ""
    GRACE_S = 0.4

    def __init__(self) -> None:
        super().__init__()
        self.taking_keys = False

    def on_mount(self) -> None:
        self.set_timer(self.GRACE_S, self._take_keys)

    def _take_keys(self) -> None:
        self.taking_keys = True
        self.query_one(self.PRIMARY, Button).focus()

    def on_key(self, event: events.Key) -> None:
        if not self.taking_keys:
            event.prevent_default()
            event.stop()

    def action_cancel(self) -> None:
        if self.taking_keys:
            super().action_cancel()


# ----------------------------------------------------------------------- trim


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


class ConfirmDialog(Dialog):
    """A question before a step that drops something: Enter does it (the dialog was asked
    for by a key of the user's), Escape or Cancel does not; dismisses with a bool."""

    AUTO_FOCUS = "#confirm-yes"

    def __init__(self, title: str, text: str, yes: str) -> None:
        super().__init__()
        self.title_text, self.text, self.yes = title, text, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="confirm-dialog") as box:
            box.border_title = self.title_text
            yield Static(self.text, markup=False)
            with Horizontal(classes="row buttons"):
                yield Button(self.yes, id="confirm-yes", variant="warning")
                yield Button("Cancel", id="confirm-cancel")

    @on(Button.Pressed, "#confirm-yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#confirm-cancel")
    def _no(self) -> None:
        self.dismiss(False)


# ----------------------------------------------------------------------- drop


class DropDialog(Dialog):
    """Confirm dropping a session: from memory only (it stays on disk) or from disk too;
    ``then`` says what becomes of its tab. Enter drops it from memory only (it stays on
    disk)."""

    AUTO_FOCUS = "#drop-memory"

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

    AUTO_FOCUS = "#rename-input"

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

    AUTO_FOCUS = "#close-save"

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

    @on(Button.Pressed, "#close-save")
    def _save(self) -> None:
        self.dismiss("save")

    @on(Button.Pressed, "#close-discard")
    def _discard(self) -> None:
        self.dismiss("discard")

    @on(Button.Pressed, "#close-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ConflictDialog(UnpromptedDialog):
    """Another kvchat saved this tab's session since the tab loaded it: keep both, as
    branches of the session (reloaded), or as a new session; or decide later."""

    PRIMARY = "#conflict-reload"

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

    @on(Button.Pressed, "#conflict-reload")
    def _reload(self) -> None:
        self.dismiss("reload")

    @on(Button.Pressed, "#conflict-fork")
    def _fork(self) -> None:
        self.dismiss("fork")

    @on(Button.Pressed, "#conflict-later")
    def _later(self) -> None:
        self.dismiss(None)


class DraftDialog(UnpromptedDialog):
    """A message that was being sent when kvchat stopped: put it back in the message box,
    or let it go. (Escape asks again next time the session is opened.)"""

    PRIMARY = "#draft-restore"

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

    @on(Button.Pressed, "#draft-restore")
    def _restore(self) -> None:
        self.dismiss("restore")

    @on(Button.Pressed, "#draft-discard")
    def _discard(self) -> None:
        self.dismiss("discard")


# ----------------------------------------------------------------------- file


class FileDialog(Dialog):
    """The path of a text file whose text goes into the message at the cursor."""

    AUTO_FOCUS = "#file-input"

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
