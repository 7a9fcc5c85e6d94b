"""The session picker's filter: typing lists only the sessions whose name or transcript
matches (through the search index), Up/Down move the highlight, Enter opens it."""

from __future__ import annotations

import pytest
from textual.widgets import Button, DataTable, Input

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.tui.screens.picker import SessionPicker

from .conftest import SIZE, settle, until, widget_text

pytestmark = pytest.mark.anyio


def _save(lm, name: str, text: str) -> None:
    session = Session(lm, settings=GenerationSettings(max_tokens=4))
    for _ in session.send(text):
        pass
    store.save(session, name)


def _listed(app) -> list[str]:
    table = app.screen.query_one(DataTable)
    return [str(row.value) for row in table.rows]


@pytest.mark.parametrize("size", [SIZE, (80, 24), (60, 20)])
async def test_typing_in_the_filter_lists_only_the_matching_sessions(make_app, demo_model, size):
    _save(demo_model, "zoo", "tell me about the zebras and quokkas")
    _save(demo_model, "farm", "the aardvark eats ants with quokkas")
    _save(demo_model, "alpaca-notes", "nothing special here")
    app = make_app()
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, SessionPicker)
        assert sorted(_listed(app)) == ["alpaca-notes", "farm", "zoo"]
        await pilot.press("slash", *"zebr")  # a word being typed already matches
        await pilot.pause()
        assert isinstance(app.screen.focused, Input)
        assert _listed(app) == ["zoo"]
        assert "1 of 3 sessions match" in widget_text(app.screen.query_one("#picker-hint"))
        filter_box = app.screen.query_one("#picker-filter", Input)
        for region in (filter_box.region, app.screen.query_one("#picker-open").region):
            assert 0 <= region.y and region.bottom <= size[1], region

        await pilot.press(*"a aard")  # "zebra aard": no message holds both
        await pilot.pause()
        assert _listed(app) == []
        assert app.screen.query_one("#picker-open", Button).disabled
        await pilot.press("enter")  # nothing to open: the picker stays
        await pilot.pause()
        assert isinstance(app.screen, SessionPicker)

        filter_box.value = "ALPACA"  # by name, case ignored
        await pilot.pause()
        assert _listed(app) == ["alpaca-notes"]
        filter_box.value = "quokkas"  # in two transcripts (the demo never says it); newest first
        await pilot.pause()
        assert _listed(app) == ["farm", "zoo"]
        await pilot.press("down")  # Up and Down in the filter move the highlight
        await pilot.press("enter")
        await settle(pilot)
        assert not isinstance(app.screen, SessionPicker)
        conversation = app.active_conversation()
        assert conversation.session_name == "zoo"
        assert conversation.session.messages[0]["content"] == "tell me about the zebras and quokkas"


async def test_a_damaged_index_is_rebuilt_when_the_picker_opens(make_app, demo_model):
    _save(demo_model, "zoo", "tell me about the zebras and quokkas")
    _save(demo_model, "farm", "the aardvark eats ants with quokkas")
    store.search_index.index_path().write_bytes(b"this is no database" * 50)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        hint = app.screen.query_one("#picker-hint")
        await until(pilot, lambda: "rebuilt" in widget_text(hint))
        assert "The search index was unusable (file is not a database)" in widget_text(hint)
        app.screen.query_one("#picker-filter", Input).value = "aardvark"
        await pilot.pause()
        assert _listed(app) == ["farm"]
