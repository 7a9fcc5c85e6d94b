"""Dialogs do what Enter says: each opens with its primary action focused, so Enter
confirms it (Escape cancels); a trim or undo that would drop every message asks first;
a dialog that opens on its own takes no keys typed before it appeared."""

from __future__ import annotations

import pytest
from textual import events
from textual.widgets import Button, Input

from kvchat.tui.screens.confirm import ConfirmDialog
from kvchat.tui.screens.draft import DraftDialog
from kvchat.tui.screens.trim import TrimDialog

from .conftest import SIZE, send, settle, until

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("key", "focused"),
    [
        ("ctrl+l", "trim-undo"),
        ("f8", "drop-memory"),
        ("f2", "rename-input"),
        ("f4", "kind-options"),
        ("f9", "settings-temp"),
        ("ctrl+n", "model-options"),
        ("f12", "export-path"),
        ("shift+f12", "import-path"),
        ("ctrl+f", "file-input"),
    ],
)
async def test_each_dialog_opens_with_its_primary_action_focused(make_app, key, focused):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await send(pilot, "first")
        await pilot.press(key)
        await until(pilot, lambda: app.focused is not None and app.focused.id == focused)
        await pilot.press("escape")
        await until(pilot, lambda: len(app.screen_stack) == 1)


def users(messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


async def two_turns_then_ctrl_l(pilot, texts=("first", "second")):
    """A tab that said ``texts`` ("first" and "second"), its trim dialog open: its
    conversation."""
    app = pilot.app
    await settle(pilot)
    conversation = app.active_conversation()
    for text in texts:
        await send(pilot, text)
    await pilot.press("ctrl+l")
    await until(pilot, lambda: isinstance(app.screen, TrimDialog))
    return conversation


async def test_enter_undoes_the_last_turn_and_asks_before_the_only_one(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await two_turns_then_ctrl_l(pilot)
        session = conversation.session
        await pilot.press("enter")  # the focused "Undo last turn"
        await settle(pilot, conversation)
        assert users(session.messages) == ["first"] and users(session.archived) == ["second"]

        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(app.screen, TrimDialog))
        await pilot.press("enter")  # the only turn: asked first
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")
        await settle(pilot, conversation)
        assert users(session.messages) == ["first"]

        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(app.screen, TrimDialog))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("enter")  # "Drop them"
        await settle(pilot, conversation)
        assert users(session.messages) == [] and users(session.archived) == ["second", "first"]


async def test_a_trim_to_too_few_tokens_asks_first(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await two_turns_then_ctrl_l(pilot)
        session = conversation.session
        app.screen.query_one("#trim-tokens", Input).value = "3"
        await pilot.click("#trim-to")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.click("#confirm-cancel")
        await settle(pilot, conversation)
        assert users(session.messages) == ["first", "second"] and session.archived == []


async def test_a_dialog_that_opens_on_its_own_takes_no_keys_typed_before(make_app):
    """Keys already on their way when a dialog appears unasked (a draft offered back, a
    conflict) do not press its buttons; after its grace it takes them as any dialog."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        chosen: list[str | None] = []
        conversation = app.active_conversation()
        conversation.focus_input()
        await pilot.pause()
        for key in ("x", "enter"):  # typed for the message box, still in the app's queue
            app.post_message(events.Key(key, "x" if key == "x" else None))
        app.push_screen(DraftDialog("chat-1", "an old message"), chosen.append)  # meanwhile
        await until(pilot, lambda: isinstance(app.focused, Button))  # its grace is over
        assert chosen == [] and isinstance(app.screen, DraftDialog)
        assert conversation.input.text == ""  # nor did they reach the box behind it
        assert app.focused.id == "draft-restore"
        await pilot.press("enter")
        await until(pilot, lambda: chosen == ["restore"])
