"""A snapshot of every screen and dialog tests/tui/test_snapshots.py does not cover, at
80x24 (the smallest terminal the layout is made for).

Each is opened the way a user opens it (its key) where a fresh tab offers it; the
edit, delete-exchange, close and loading screens, which need a reply, unsaved
messages or a load under way,
are pushed as the app pushes them. Update with
``pytest tests/tui/test_dialog_snapshots.py --snapshot-update`` and look at the SVGs.
"""

from __future__ import annotations

import pytest
from textual.widgets import LoadingIndicator

from kvchat.tui.screens.close import CloseDialog
from kvchat.tui.screens.loading import LoadingScreen
from kvchat.tui.screens.message_dialogs import DeletePairDialog, EditDialog

from .test_snapshots import _steady

SIZE = (80, 24)


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param(["f4"], id="cache_kind_dialog"),
        pytest.param(["f8"], id="drop_dialog"),
        pytest.param(["f2"], id="rename_dialog"),
        pytest.param(["f9"], id="settings_dialog"),
        pytest.param(["ctrl+n"], id="model_dialog"),
        pytest.param(["f12"], id="export_dialog"),
        pytest.param(["shift+f12"], id="import_dialog"),
        pytest.param(["ctrl+f"], id="file_dialog"),
    ],
)
def test_dialog_opened_by_its_key(snap_compare, make_app, keys):
    async def opened(pilot) -> None:
        await _steady(pilot)
        await pilot.press(*keys)
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=opened)


def _pushed(screen):
    async def run_before(pilot) -> None:
        await _steady(pilot)
        await pilot.app.push_screen(screen)
        for indicator in pilot.app.screen.query(LoadingIndicator):
            indicator.display = False  # an animation: no two frames alike
        await pilot.pause()

    return run_before


def test_edit_dialog(snap_compare, make_app):
    screen = EditDialog("What is a KV cache,\nand why keep one per tab?")
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_pushed(screen))


def test_delete_exchange_dialog(snap_compare, make_app):
    screen = DeletePairDialog("What is a KV cache, and why keep one per tab?")
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_pushed(screen))


def test_loading_screen(snap_compare, make_app):
    screen = LoadingScreen("Loading model demo…")
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_pushed(screen))


def test_close_dialog(snap_compare, make_app):
    screen = CloseDialog({"chat-1": False})
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_pushed(screen))
