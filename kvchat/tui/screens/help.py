"""The help screen: every key binding, read from the same BINDINGS lists the app uses."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from ..keymap import keys_of


def binding_rows(app, groups) -> list[tuple[str, str, str]]:
    """(where, keys, what) for every described binding in ``groups`` of (where, BINDINGS),
    with the keys the app's keymap gives them."""
    rows = []
    for where, bindings in groups:
        for binding in bindings:
            if not isinstance(binding, Binding) or not binding.description:
                continue
            keys = ", ".join(
                app.get_key_display(Binding(key, binding.action))
                for key in keys_of(binding, app.keymap)
            )
            rows.append((where, keys, binding.description))
    return rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close help", id="help_close")]

    def __init__(self, groups) -> None:
        super().__init__()
        self.groups = groups

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="help") as box:
            box.border_title = "Keys"
            table: DataTable[Text] = DataTable(
                id="help-table", cursor_type="row", show_cursor=False, classes="body"
            )
            table.add_columns("where", "keys", "action")
            for where, keys, what in binding_rows(self.app, self.groups):
                table.add_row(Text(where, style="dim"), Text(keys, style="bold"), Text(what))
            yield table
            yield Static(
                "Every action is also in the command palette (ctrl+p). Esc closes this.",
                classes="hint buttons",
                markup=False,
            )
