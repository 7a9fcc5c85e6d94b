"""What the TUI tells the user: the welcome, who holds the model, a cache from disk, keys
refused while a reply runs (and why), nothing to undo or save, `?` typed as text, the
palette's "undo", the tab a session opens in, and a greedy regenerate."""

from __future__ import annotations

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.tui.screens.confirm import ConfirmDialog
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.trim import TrimDialog
from kvchat.tui.textual_compat import notifications
from kvchat.tui.widgets.messages import AssistantMessage, NoticeMessage, Welcome

from .conftest import SIZE, new_tab, palette_pick, screen_text, send, settle, until

pytestmark = pytest.mark.anyio


def notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


async def test_the_welcome_leaves_when_the_conversation_starts_and_comes_back_empty(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        text = " ".join(screen_text(app).split())
        assert (
            "Enter sends it" in text and "KV cache panel" in text and "F1 lists every key" in text
        )
        await send(pilot, "hi")
        assert not conversation.log.query(Welcome)
        assert "Enter sends it" not in screen_text(app)
        await pilot.press("ctrl+l")
        await pilot.pause()
        await pilot.click("#trim-undo")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))  # the only turn
        await pilot.click("#confirm-yes")
        await settle(pilot, conversation)
        assert conversation.session.messages == [] and conversation.log.query(Welcome)


async def test_empty_session_nothing_to_undo_or_save_and_question_mark_is_text(make_app, home):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert "Nothing to save yet: send a message first." in notices(app)
        assert not store.exists(conversation.session_name)

        await pilot.press("ctrl+l")
        await pilot.pause()
        assert isinstance(app.screen, TrimDialog)
        assert app.screen.query_one("#trim-undo").disabled
        assert "Nothing to undo yet" in screen_text(app)
        await pilot.press("escape")

        await pilot.press(*"why?")
        assert conversation.input.text == "why?" and not isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one("#help-table")
        keys = {str(table.get_row_at(i)[1]) for i in range(table.row_count)}
        assert "f1" in keys and not any("?" in k for k in keys)


async def test_the_palette_finds_undo(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await send(pilot, "something to undo")
        assert "Undo/trim" in await palette_pick(pilot, "undo")
        await until(pilot, lambda: isinstance(app.screen, TrimDialog))


async def test_keys_refused_during_a_reply_say_so(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "first")
        ticket = app.scheduler.request("another tab")  # the reply waits for the model
        app.scheduler.wait(ticket)
        conversation.input.text = "second"
        await pilot.press("enter")
        await until(pilot, lambda: conversation.state == "waiting")
        for key in ("f4", "ctrl+r", "f5", "ctrl+l"):
            await pilot.press(key)
            await pilot.pause()
            assert len(app.screen_stack) == 1, key  # no dialog opened
        assert notices(app).count("Busy: press Esc to stop the reply first.") == 4
        await pilot.press("escape")
        await settle(pilot, conversation)
        app.scheduler.done(ticket)
        assert conversation.session.cache_tokens > 0  # Ctrl+R did not run
        assert [m["content"] for m in conversation.session.messages if m["role"] == "user"] == [
            "first"
        ]


async def test_waiting_names_the_tab_that_holds_the_model(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        second = await new_tab(pilot)
        assert (first.owner, first.session_name) == ("conv-1", "chat-1")
        ticket = app.scheduler.request(first.owner)  # as if chat-1 were answering
        app.scheduler.wait(ticket)
        second.input.text = "queued"
        await pilot.press("enter")
        await until(pilot, lambda: bool(app.scheduler.waiting()))
        await pilot.pause()
        status = str(second.query_one(".status").render())
        assert "chat-1 is using it" in status and "conv-1" not in status
        app.scheduler.done(ticket)
        await settle(pilot, second)


def _saved(demo_model, name: str) -> Session:
    session = Session(demo_model, settings=GenerationSettings(max_tokens=8))
    for _ in session.send("a saved question"):
        pass
    store.save(session, name)
    return session


async def test_a_session_opened_from_disk_says_so_and_its_tab_is_the_active_one(
    make_app, demo_model
):
    saved = _saved(demo_model, "kept")
    app = make_app(picker=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+t")
        await settle(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("enter")  # the highlighted (only) saved session
        await settle(pilot)
        await until(
            pilot,
            lambda: (
                app.active_conversation().session_name == "kept"
                and app.focused is app.active_conversation().input
                and app.active_conversation().log.query(NoticeMessage)
            ),
        )
        conversation = app.active_conversation()
        assert conversation.session_name == "kept"
        assert app.tabs.active == conversation.parent.id
        assert app.focused is conversation.input
        shown = [str(n.render()) for n in conversation.log.query(NoticeMessage)]
        assert shown == [
            f"Resumed with its cache from disk ({saved.cache_tokens:,} tokens): "
            "the next turn evaluates only the new message."
        ]


async def test_regenerate_at_temperature_zero_says_it_is_greedy(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "hello")
        first = conversation.session.messages[-1]["content"]
        await pilot.press("f5")
        await settle(pilot, conversation)
        assert conversation.session.messages[-1]["content"] == first
        assert conversation.query_one(AssistantMessage).text == first
        assert (
            "Temperature is 0 (greedy): the same reply came again; raise it in the tab's "
            "settings (F9), or with --temp or temp in the config file."
        ) in notices(app)
        assert conversation.session.last_stats.evaluated_tokens == 0


@pytest.mark.quantized_attention
async def test_regenerate_after_a_kind_switch_says_the_reply_can_differ(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "hello")
        conversation.jobs.run(
            "switching cache", lambda progress: session.set_kind("quantized:8", progress)
        )
        await settle(pilot, conversation)
        await pilot.press("f5")
        await settle(pilot, conversation)
        evaluated = session.last_stats.evaluated_tokens
        assert evaluated == 1  # the converted cache has no kept logits: the last prompt token
        said = [n for n in notices(app) if n.startswith("Temperature is 0")]
        assert said == [
            "Temperature is 0 (greedy), but the cache changed since that reply "
            "(kind change): 1 token(s) were evaluated on it again, so the reply "
            "can differ."
        ]
