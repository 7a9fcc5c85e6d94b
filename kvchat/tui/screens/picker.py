"""The session picker: saved sessions (model, turns, tokens, size, last used) or a new one."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Static

from kvchat.store import SessionSummary

from ..widgets.sidebar import human_bytes


class SessionPicker(ModalScreen):
    """Dismisses with a saved session's name, ``""`` for a new session, or None (cancel)."""

    BINDINGS = [
        Binding("n", "new", "New session"),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, sessions: list[SessionSummary], cancellable: bool = True) -> None:
        super().__init__()
        self.sessions = sessions
        self.cancellable = cancellable

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="picker") as box:
            box.border_title = "Sessions"
            if self.sessions:
                yield Static("Enter opens the highlighted session; n starts a new one.",
                             classes="hint", markup=False)
            else:
                yield Static("No saved sessions yet.", classes="hint", markup=False)
            table = DataTable(id="picker-table", cursor_type="row", zebra_stripes=True,
                              classes="body")
            table.add_columns("name", "model", "cache", "turns", "tokens", "size", "last used")
            for s in self.sessions:
                name = Text(s.name + (" (damaged)" if s.note else ""))
                table.add_row(
                    name, Text(s.model_id), Text(s.cache_kind), str(s.turns),
                    f"{s.cache_tokens:,}", human_bytes(s.size_bytes),
                    Text(s.last_used.replace("T", " ")[:16]), key=s.name,
                )
            yield table
            with Horizontal(classes="row buttons"):
                yield Button("Open", id="picker-open", variant="primary",
                             disabled=not self.sessions)
                yield Button("New session", id="picker-new", variant="success")
                if self.cancellable:
                    yield Button("Cancel", id="picker-cancel")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        if self.sessions:
            table.focus()
        else:
            self.query_one("#picker-new", Button).focus()

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    @on(Button.Pressed, "#picker-open")
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
