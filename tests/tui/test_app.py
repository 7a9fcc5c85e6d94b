"""Pilot tests: every binding and button, checked against the engine behind the screen.

Starting the app costs about a second on a small machine, so each test walks
through a few related actions in one run.
"""

from __future__ import annotations

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.tui.app import KvChatApp
from kvchat.tui.screens.help import HelpScreen, binding_rows
from kvchat.tui.screens.kind import KindDialog
from kvchat.tui.screens.picker import SessionPicker
from kvchat.tui.screens.trim import TrimDialog
from kvchat.tui.textual_compat import notifications
from kvchat.tui.widgets.messages import AssistantMessage, UserMessage

from .conftest import SIZE, new_tab, send, settle, until

pytestmark = pytest.mark.anyio


async def test_typing_sending_and_the_sidebar(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session

        await pilot.press("enter")  # empty: refused, nothing changes
        await settle(pilot)
        assert session.messages == []
        assert any("empty" in n.message for n in notifications(app))

        await pilot.press(*"hello", "ctrl+j", *"there")
        assert conversation.input.text == "hello\nthere"
        assert session.messages == []
        await pilot.press("enter")
        await settle(pilot, conversation)
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
        assert session.messages[0]["content"] == "hello\nthere"
        assert conversation.input.text == ""
        assert session.cache_tokens > 0 and session.last_stats.generated_tokens > 0
        assert len(conversation.query(UserMessage)) == 1
        assert conversation.query_one(AssistantMessage).text == session.messages[-1]["content"]
        info = app.sidebar.info
        assert (info.cache_tokens, info.turns, info.kind) == (session.cache_tokens, 1, "standard")

        await send(pilot, "and again")
        assert session.last_stats.reused_tokens > 0  # the cache carried over
        assert app.sidebar.info.turns == 2
        assert list(app.query_one("#cache-sparkline").data) == [0.0, 0.0]  # snapshot mode


async def test_tabs_help_palette_and_sidebar_toggle(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        second = await new_tab(pilot)
        assert len(app.conversations()) == 2 and second is not first
        await send(pilot, "only in the second tab")
        assert first.session.cache_tokens == 0 and second.session.cache_tokens > 0
        await pilot.press("ctrl+pageup")
        assert app.active_conversation() is first
        assert app.sidebar.info.cache_tokens == 0
        await pilot.press("ctrl+pagedown")
        assert app.active_conversation() is second

        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#rename-input").value = "renamed"
        await pilot.press("enter")
        await settle(pilot)
        assert second.session_name == "renamed"
        assert str(app.tabs.get_tab(second.parent.id).label) == "renamed"

        await pilot.press("ctrl+w")  # unsaved, autosave off: it asks (test_close_tab.py)
        await pilot.pause()
        await pilot.click("#close-discard")
        await settle(pilot)
        assert app.conversations() == [first]
        assert app.sidebar.info.name == first.session_name

        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        rows = binding_rows(app, KvChatApp.binding_groups())
        assert app.screen.query_one("#help-table").row_count == len(rows)
        assert {b.description for b in KvChatApp.BINDINGS} <= {what for _, _, what in rows}
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        commands = list(app.get_system_commands(app.screen))
        assert {b.description for b in KvChatApp.APP_BINDINGS} <= {c.title for c in commands}
        await next(c for c in commands if c.title == "New tab").callback()  # run_action
        await settle(pilot)
        assert len(app.conversations()) == 2

        await pilot.press("ctrl+b")
        assert not app.sidebar.display
        await pilot.press("ctrl+b")
        assert app.sidebar.display


async def test_escape_stops_a_reply_and_the_next_turn_works(make_app, endless):
    app = make_app(max_tokens=4000)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        conversation.input.text = "tell me a long story"
        await pilot.press("enter")
        await until(pilot, lambda: conversation.query(AssistantMessage))
        await pilot.press("escape")
        await settle(pilot, conversation)
        session = conversation.session
        last = session.messages[-1]
        assert last["role"] == "assistant" and last.get("stopped") is True
        assert session.last_stats.generated_tokens < 4000
        assert conversation.query_one(AssistantMessage).has_class("stopped")
        session.settings.max_tokens = 4
        await send(pilot, "short one")
        assert not session.messages[-1].get("stopped")
        assert session.last_stats.reused_tokens > 0


async def test_save_and_trim_both_ways(make_app, home):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        name = conversation.session_name
        await send(pilot, "first")
        await pilot.press("ctrl+s")
        await settle(pilot)
        folder = home / "data" / "sessions" / name
        assert (folder / "session.json").is_file() and (folder / "cache.safetensors").is_file()
        assert conversation.saved and app.sidebar.info.saved

        for text in ("second", "third"):
            await send(pilot, text)
        await pilot.click("#btn-save")
        await settle(pilot)
        assert store.summary(name).cache_tokens == session.cache_tokens

        await pilot.press("ctrl+l")
        await pilot.pause()
        assert isinstance(app.screen, TrimDialog)
        await pilot.click("#trim-undo")
        await settle(pilot, conversation)
        users = [m["content"] for m in session.messages if m["role"] == "user"]
        assert users == ["first", "second"]
        assert session.cache_tokens == len(session.render(session.messages, False))
        assert len(conversation.query(UserMessage)) == 2

        limit = len(session.render(session.messages, False)) - 5
        await pilot.click("#btn-trim")
        await pilot.pause()
        app.screen.query_one("#trim-tokens").value = str(limit)
        await pilot.click("#trim-to")
        await settle(pilot, conversation)
        # the undone exchange went to archived first, then the trimmed one
        assert [m["content"] for m in session.archived if m["role"] == "user"] == ["third", "first"]
        assert len(session.render(session.messages, False)) <= limit
        assert session.cache_tokens == len(session.render(session.messages, False))
        assert [m.text for m in conversation.query(UserMessage)] == ["second"]
        assert app.sidebar.info.cache_tokens == session.cache_tokens


@pytest.mark.quantized_attention
async def test_cache_kind_switch_and_reset(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await send(pilot, "hello")
        session = app.active_conversation().session
        tokens, size = session.cache_tokens, session.cache_bytes

        await pilot.press("f4")
        await pilot.pause()
        assert isinstance(app.screen, KindDialog)
        await until(pilot, lambda: app.focused is app.screen.query_one("#kind-options"))
        await pilot.press("down", "enter")  # standard -> quantized:8, converted in place
        await settle(pilot)
        assert session.kind.name == "quantized:8"
        assert session.cache_tokens == tokens and session.cache_bytes < size
        assert app.sidebar.info.kind == "quantized:8"
        await send(pilot, "still works")
        assert session.last_stats.reused_tokens > 0

        await pilot.click("#btn-kind")
        await pilot.pause()
        await until(pilot, lambda: app.focused is app.screen.query_one("#kind-options"))
        await pilot.press("down", "down", "down", "down", "enter")  # past rotated:8 and :4 to
        # rotating:4096,
        # which is rebuilt from the transcript
        await settle(pilot)
        assert session.kind.name == "rotating:4096"
        assert session.cache_tokens == len(session.render(session.messages, False))
        assert (
            "Cache is now rotating:4096: rebuilt (cache kind changed from quantized:8 to "
            "rotating:4096)."
        ) in [n.message for n in notifications(app)]
        assert app.sidebar.info.rebuilt is None  # whole again: the next turn rebuilds nothing

        await pilot.press("ctrl+r")
        await settle(pilot)
        assert session.cache_tokens == 0 and len(session.messages) == 4
        assert app.sidebar.info.cache_tokens == 0
        await send(pilot, "again")
        assert session.last_stats.reused_tokens == 0
        assert session.last_stats.rebuilt == "the cache was reset"

        await pilot.click("#btn-reset")
        await settle(pilot)
        assert session.cache_tokens == 0


def _saved_session(demo_model, name: str) -> Session:
    session = Session(demo_model, settings=GenerationSettings(max_tokens=8))
    for _ in session.send("a saved question"):
        pass
    store.save(session, name)
    return session


async def test_picker_resume_new_and_sessions_key(make_app, demo_model):
    saved = _saved_session(demo_model, "kept")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, SessionPicker)
        await pilot.press("enter")
        await settle(pilot)
        conversation = app.active_conversation()
        assert conversation.session_name == "kept" and conversation.saved
        assert conversation.session.messages == saved.messages
        assert conversation.session.cache_tokens == saved.cache_tokens  # cache from disk
        await send(pilot, "and a follow-up")
        assert conversation.session.last_stats.reused_tokens >= saved.cache_tokens - 1

        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, SessionPicker)
        await pilot.press("n")
        await settle(pilot)
        assert [c.session_name for c in app.conversations()] == ["kept", "chat-1"]
        await until(pilot, lambda: app.active_conversation().session_name == "chat-1")
        assert app.active_conversation().session.messages == []


async def test_resume_flag_opens_straight_into_the_session(make_app, demo_model):
    saved = _saved_session(demo_model, "direct")
    app = make_app(resume="direct")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert not isinstance(app.screen, SessionPicker)
        conversation = app.active_conversation()
        assert conversation.session_name == "direct"
        assert conversation.session.cache_tokens == saved.cache_tokens


async def test_a_tab_waits_for_the_model_and_escape_withdraws(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session

        async def queue(text: str) -> None:
            conversation.input.text = text
            await pilot.press("enter")
            await until(pilot, lambda: app.scheduler.waiting())
            await pilot.pause()

        ticket = app.scheduler.request("another tab")
        app.scheduler.wait(ticket)  # the model is busy elsewhere
        await queue("never mind")
        assert conversation.state == "waiting"
        await pilot.press("escape")
        await settle(pilot, conversation)
        assert session.messages == [] and conversation.input.text == "never mind"
        assert not conversation.query(UserMessage)

        await queue("queued")
        assert conversation.state == "waiting"
        assert "Waiting" in str(conversation.query_one(".status").render())
        assert session.cache_tokens == 0
        app.scheduler.done(ticket)
        await settle(pilot, conversation)
        assert session.cache_tokens > 0 and session.messages[0]["content"] == "queued"


async def test_themes_are_registered_and_the_choice_is_remembered(make_app, home):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert {"kvchat-dark", "kvchat-light", "kvchat-high-contrast"} <= set(app.available_themes)
        assert app.theme == "kvchat-dark"
        app.theme = "kvchat-light"
        await pilot.pause()
    assert 'theme = "kvchat-light"' in (home / "config" / "config.toml").read_text()


async def test_a_theme_change_leaves_a_broken_config_alone_and_says_where(make_app, home):
    path = home / "config" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    broken = b'# mine\nmodel = "demo"\ntemp = 0.7x\n\n[keymap]\nsave = "f10"\n'
    path.write_bytes(broken)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        app.theme = "kvchat-light"
        await pilot.pause()
        assert app.theme == "kvchat-light" and app.config.theme == "kvchat-light"
        assert [n.message for n in app._notifications][-1] == (
            "config.toml has an error at line 3 (Invalid number); your change applies to this "
            "run only and the file was left alone."
        )
    assert path.read_bytes() == broken
