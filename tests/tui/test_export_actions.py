"""Export and import from the TUI: the store's formats, written to a file the user names;
an imported JSON export opens as a new tab whose first turn prefills its transcript."""

from __future__ import annotations

import json

import pytest

from kvchat import store
from kvchat.tui.screens.export_dialogs import ExportDialog, ImportDialog
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, send, settle

pytestmark = pytest.mark.anyio


def _notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


def _times_dropped(text: str) -> dict:
    return {k: v for k, v in json.loads(text).items() if k not in ("created", "updated")}


async def _dialog(pilot, key: str, kind, path, button: str | None = None) -> None:
    await pilot.press(key)
    await pilot.pause()
    assert isinstance(pilot.app.screen, kind)
    pilot.app.screen.query_one("Input").value = str(path)
    if button:
        await pilot.click(button)
    else:
        await pilot.press("enter")
    await settle(pilot)


async def test_export_writes_the_cli_formats_and_never_replaces_a_file(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "Hello there.")
        await send(pilot, "What is a cache?")
        await pilot.press("ctrl+s")
        await settle(pilot)

        await _dialog(pilot, "f12", ExportDialog, tmp_path / "talk.md", "#export-md")
        md = (tmp_path / "talk.md").read_text()
        assert md.split("\n")[5:] == store.export(name, "md").split("\n")[5:]
        assert "## User\n\nWhat is a cache?\n\n## Assistant\n\n" in md
        assert _notices(app)[-1] == (
            f"Exported {name} to {tmp_path / 'talk.md'} ({len(md.encode()):,} bytes)."
        )

        # JSON by its button: the .md suffix becomes .json
        await _dialog(pilot, "f12", ExportDialog, tmp_path / "talk.md", "#export-json")
        exported = (tmp_path / "talk.json").read_text()
        assert _times_dropped(exported) == _times_dropped(store.export(name, "json"))

        await _dialog(pilot, "f12", ExportDialog, tmp_path / "talk.md")  # Enter: by suffix
        assert (
            _notices(app)[-1] == f"{tmp_path / 'talk.md'} exists already; choose another file name."
        )
        assert (tmp_path / "talk.md").read_text() == md


async def test_import_opens_a_new_tab_that_prefills_on_its_first_turn(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await send(pilot, "Hello there.")
        path = tmp_path / "talk.json"
        path.write_text(store.export_session(first.session, "talk", "json"))
        await pilot.press("ctrl+t")  # an unsaved tab has the file's name: the import
        await settle(pilot)  # takes the next one
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("Input").value = "talk"
        await pilot.press("enter")
        await settle(pilot)
        assert app.active_conversation().session_name == "talk"

        await _dialog(pilot, "shift+f12", ImportDialog, path, "#import-ok")
        assert f"Imported {path} as talk-2; its cache is built on its first turn." in _notices(app)
        await settle(pilot)
        imported = app.active_conversation()
        assert imported is not first and imported.session_name == "talk-2"
        assert imported.session.messages == first.session.messages
        assert imported.session.cache_tokens == 0
        await send(pilot, "And why?")
        stats = imported.session.last_stats
        assert stats.reused_tokens == 0 and stats.evaluated_tokens == stats.prompt_tokens > 20

        (tmp_path / "talk.md").write_text(store.export_session(first.session, "talk", "md"))
        await _dialog(pilot, "shift+f12", ImportDialog, tmp_path / "talk.md")
        assert _notices(app)[-1].endswith(
            "is not a JSON export; import reads what "
            "`kvchat sessions export NAME --format json` writes."
        )
        assert len(app.conversations()) == 3 and not store.exists("talk-3")
