"""Ctrl+W on a tab with unsaved messages: autosave saves, else a dialog asks."""

from __future__ import annotations

import pytest

from kvchat import store
from kvchat.config import Config
from kvchat.tui.app import KvChatApp
from kvchat.tui.screens.close import CloseDialog
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, new_tab, send, settle, until

pytestmark = pytest.mark.anyio


def _names(app) -> list[str]:
    return [c.session_name for c in app.conversations()]


async def test_ctrl_w_asks_save_discard_or_cancel_without_autosave(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await pilot.press("ctrl+w")  # empty: closes at once, nothing to ask
        await settle(pilot)
        assert first.session_name not in _names(app) and not isinstance(app.screen, CloseDialog)

        kept = await new_tab(pilot)
        await send(pilot, "keep me")
        await pilot.press("ctrl+w")
        await pilot.pause()
        assert isinstance(app.screen, CloseDialog)
        await pilot.click("#close-cancel")
        await settle(pilot)
        assert _names(app) == [kept.session_name] and kept.session.messages[0] == {
            "role": "user",
            "content": "keep me",
        }

        await pilot.press("ctrl+w")
        await pilot.pause()
        await pilot.click("#close-save")
        await settle(pilot)
        await until(pilot, lambda: not app.conversations())
        assert store.exists(kept.session_name)
        assert store.load(kept.session_name, app.lm).session.messages[0]["content"] == "keep me"
        assert notifications(app)[-1].message == (
            f"Saved {kept.session_name} and closed it; Ctrl+O reopens it."
        )

        dropped = await new_tab(pilot)
        await send(pilot, "throw me away")
        await pilot.press("ctrl+w")
        await pilot.pause()
        await pilot.click("#close-discard")
        await settle(pilot)
        assert not app.conversations() and not store.exists(dropped.session_name)


async def test_ctrl_w_after_ctrl_s_closes_at_once_and_changes_ask_again(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "one")
        await pilot.press("ctrl+s")
        await settle(pilot)
        await send(pilot, "two")  # a change since the save
        await pilot.press("ctrl+w")
        await pilot.pause()
        assert isinstance(app.screen, CloseDialog)
        assert "has changes since it was last saved" in str(app.screen.query_one("Static").render())
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("ctrl+s")
        await settle(pilot)
        await pilot.press("ctrl+w")  # saved as it is: no question
        await settle(pilot)
        assert not app.conversations()
        assert (
            f"Closed {conversation.session_name}; it is saved"
            in list(notifications(app))[-1].message
        )


async def test_ctrl_w_with_autosave_saves_without_asking(demo_model, home):
    config = Config(model="demo", max_tokens=8, autosave=True)
    app = KvChatApp(config, lm=demo_model, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        conversation.autosave = False  # as if the turn's own autosave had not run
        await send(pilot, "autosaved")
        assert not store.exists(name)
        await pilot.press("ctrl+w")
        await settle(pilot)
        await until(pilot, lambda: not app.conversations())
        assert not isinstance(app.screen, CloseDialog)
        assert store.load(name, demo_model).session.messages[0]["content"] == "autosaved"
        assert notifications(app)[-1].message == (f"Saved {name} and closed it; Ctrl+O reopens it.")


async def test_a_saved_tab_renamed_closes_without_asking(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        tab = app.active_conversation()
        await send(pilot, "keep me")
        await pilot.press("ctrl+s")
        await settle(pilot, tab)
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#rename-input").value = "renamed"
        await pilot.press("enter")
        await settle(pilot, tab)
        assert tab.session_name == "renamed" and store.exists("renamed")
        await pilot.press("ctrl+w")
        await settle(pilot)
        assert not isinstance(app.screen, CloseDialog) and not app.conversations()
        assert store.load("renamed", app.lm).session.messages[0]["content"] == "keep me"
