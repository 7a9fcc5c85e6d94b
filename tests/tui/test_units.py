"""Sizes are written by one function in binary units."""

from __future__ import annotations

from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app as cli_app
from kvchat.engine.conversation.session import Session
from kvchat.units import human_bytes


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


def test_sessions_list_shows_sizes_in_binary_units(demo_model, home):
    """(The session picker leaves sizes to ``sessions list``, to fit 80 columns.)"""
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
