"""Sizes are written by one function in binary units: the session picker and
``kvchat sessions list`` show the same string for the same session."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app as cli_app
from kvchat.engine.conversation.session import Session
from kvchat.tui.screens.picker import SessionPicker
from kvchat.units import human_bytes

from .conftest import SIZE, settle

pytestmark = pytest.mark.anyio


def test_human_bytes_counts_in_binary_units():
    assert [human_bytes(n) for n in (0, 1023, 1024, 58_880, 5 << 20, 3 << 30, 5 << 40)] == [
        "0 B",
        "1,023 B",
        "1.0 KiB",
        "57.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "5,120.0 GiB",
    ]


async def test_picker_and_sessions_list_show_the_same_size(make_app, demo_model):
    session = Session(demo_model)
    for _ in session.send("Hello there, a few words to save."):
        pass
    store.save(session, "sized")
    size = human_bytes(store.summary("sized").size_bytes)
    assert size.endswith(" KiB")

    listed = CliRunner().invoke(cli_app, ["sessions", "list"])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if line.startswith("sized"))
    assert size in row and " KB" not in row

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, SessionPicker)
        table = app.screen.query_one(DataTable)
        cells = [str(cell) for cell in table.get_row_at(0)]
        assert size in cells
