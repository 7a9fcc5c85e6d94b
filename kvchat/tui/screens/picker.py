"""The session picker: saved sessions (model, cache kind, turns, tokens, last used), the unsent
drafts of sessions never saved, or a new one, filtered by name and by the words of their
transcripts (the store's search index)."""

from __future__ import annotations

import contextlib
from datetime import datetime

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Static

from kvchat import drafts
from kvchat.store import SessionSummary, StoreError, exists, matching_sessions
from kvchat.store.search_index import REBUILT, sync

# the widest name and model shown: with the last-used time as _when gives it, every column
# fits an 80-column terminal (the filter finds a longer name; `sessions list` shows sizes)
NAME_WIDTH, MODEL_WIDTH = 16, 16


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(stamp: str, now: datetime | None = None) -> str:
    """A last-used time, short enough for 80 columns: ``14:05`` today, ``Nov 27`` this
    year, ``2025-11-27`` before (local time); anything unreadable as it is."""
    try:
        then = datetime.fromisoformat(stamp).astimezone()
    except ValueError:
        return stamp[:16]
    now = now or datetime.now().astimezone()
    if then.date() == now.date():
        return then.strftime("%H:%M")
    if then.year == now.year:
        return then.strftime("%b %d")
    return then.strftime("%Y-%m-%d")


UNSENT = "unsent:"  # a row's key for a session never saved, with a message in drafts/


def unsaved_drafts() -> dict[str, str]:
    """The unsent messages (being sent or typed when kvchat stopped) of sessions never
    saved, by session name: the picker lists them, since opening a saved session is the
    only other way they come back."""
    try:
        return {n: text for n, text in drafts.unsent().items() if not exists(n)}
    except (StoreError, OSError):
        return {}


class SessionPicker(ModalScreen):
    """Dismisses with a saved session's name, ``""`` for a new session, :data:`UNSENT` and
    a name for a session never saved whose draft is to come back, or None (cancel)."""

    BINDINGS = [
        Binding("n", "new", "New session", id="picker_new"),
        Binding("escape", "cancel", "Cancel", id="picker_cancel"),
        Binding("slash", "filter", "Filter", id="picker_filter", key_display="/"),
        Binding("down", "move(1)", "Next row", id="picker_down", show=False),
        Binding("up", "move(-1)", "Previous row", id="picker_up", show=False),
    ]
    HINT = "Enter opens the highlighted session; n starts a new one; / filters."

    def __init__(
        self,
        sessions: list[SessionSummary],
        cancellable: bool = True,
        unsent: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.sessions = sessions
        self.cancellable = cancellable
        self.unsent = unsent or {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="picker") as box:
            box.border_title = "Sessions"
            hint = self.HINT if self.sessions or self.unsent else "No saved sessions yet."
            yield Static(hint, id="picker-hint", classes="hint", markup=False)
            yield Input(
                placeholder="filter: a name or words said in the chat",
                id="picker-filter",
                disabled=not (self.sessions or self.unsent),
            )
            table: DataTable[str | Text] = DataTable(
                id="picker-table", cursor_type="row", zebra_stripes=True, classes="body"
            )
            table.add_columns("name", "model", "cache", "turns", "tokens", "used")
            self._fill(table, self.sessions, self.unsent)
            yield table
            with Horizontal(classes="row buttons"):
                yield Button(
                    "Open",
                    id="picker-open",
                    variant="primary",
                    disabled=not (self.sessions or self.unsent),
                )
                yield Button("New session", id="picker-new", variant="success")
                if self.cancellable:
                    yield Button("Cancel", id="picker-cancel")

    @staticmethod
    def _fill(table: DataTable, sessions: list[SessionSummary], unsent: dict[str, str]) -> None:
        table.clear()
        for draft, text in unsent.items():
            first = " ".join(text.split())
            said = first if len(first) <= 24 else first[:23] + "…"
            table.add_row(
                Text(draft),
                Text("not saved"),
                Text(f"unsent: {said}"),
                "",
                "",
                "",
                key=UNSENT + draft,
            )
        for s in sessions:
            name = Text(_cut(s.name, NAME_WIDTH) + (" (damaged)" if s.note else ""))
            table.add_row(
                name,
                Text(_cut(s.model_id, MODEL_WIDTH)),
                Text(s.cache_kind),
                str(s.turns),
                f"{s.cache_tokens:,}",
                Text(_when(s.last_used)),
                key=s.name,
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        if self.sessions or self.unsent:
            table.focus()
            self._sync_index()
        else:
            self.query_one("#picker-new", Button).focus()

    @work(thread=True, exclusive=True, group="picker-index")
    def _sync_index(self) -> None:
        """Catch the search index up with the sessions on disk (usually nothing to do),
        then filter again with what it knows."""
        try:
            problem = next((n for n in sync() if n.startswith(REBUILT)), None)
        except StoreError as exc:
            problem = str(exc)
        with contextlib.suppress(RuntimeError):  # the app is gone
            self.app.call_from_thread(self._synced, problem)

    def _synced(self, problem: str | None) -> None:
        """Show a rebuild or an unusable index in the hint; filter again, as the index
        may know more now."""
        if not self.is_attached:  # the picker closed meanwhile
            return
        if self.query_one("#picker-filter", Input).value.strip():
            self._apply_filter()
        if problem:
            self._show_hint(problem)

    def _show_hint(self, text: str) -> None:
        self.query_one("#picker-hint", Static).update(Text(text))

    @on(Input.Changed, "#picker-filter")
    def _apply_filter(self) -> None:
        """List the sessions whose name holds every word of the filter, or whose
        transcript matches it in the index."""
        text = self.query_one("#picker-filter", Input).value
        shown, unsent = self.sessions, self.unsent
        hint = self.HINT
        if text.strip():
            words = text.lower().split()
            try:
                said = matching_sessions(text)
            except StoreError as exc:
                said, hint = set(), str(exc)
            shown = [
                s
                for s in self.sessions
                if s.name in said or all(w in s.name.lower() for w in words)
            ]
            unsent = {
                n: t
                for n, t in self.unsent.items()
                if all(w in n.lower() or w in t.lower() for w in words)
            }
            if hint == self.HINT:
                hint = f"{len(shown)} of {len(self.sessions)} sessions match; Enter opens one."
        table = self.query_one(DataTable)
        self._fill(table, shown, unsent)
        self.query_one("#picker-open", Button).disabled = not (shown or unsent)
        self._show_hint(hint)

    def action_filter(self) -> None:
        self.query_one("#picker-filter", Input).focus()

    def action_move(self, step: int) -> None:
        """Up and Down in the filter move the highlighted row."""
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=max(0, min(table.row_count - 1, table.cursor_row + step)))

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    @on(Button.Pressed, "#picker-open")
    @on(Input.Submitted, "#picker-filter")
    def _open(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
            self.dismiss(key.value)

    @on(Button.Pressed, "#picker-new")
    def action_new(self) -> None:
        self.dismiss("")

    @on(Button.Pressed, "#picker-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None if self.cancellable else "")
