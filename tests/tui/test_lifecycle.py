"""Pilot tests of a session's life in the TUI: drop without loss, offload after a time to
live or over the memory budget (and the reload on the next turn), and the shared
system prompt of a new tab. Real files in a private home; the demo model."""

from __future__ import annotations

import pytest

from kvchat import store
from kvchat.config import Config
from kvchat.tui.app import KvChatApp
from kvchat.tui.screens.close import CloseDialog
from kvchat.tui.screens.drop import DropDialog
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, idle_past_ttl, new_tab, send, settle, until

pytestmark = pytest.mark.anyio

SYSTEM = "You are a terse assistant. Answer in one short sentence."


def _app(demo_model, **config) -> KvChatApp:
    expire_every = config.pop("expire_every", 0)
    values = {"model": "demo", "max_tokens": 8, "autosave": False, **config}
    return KvChatApp(
        Config(**values), lm=demo_model, volatile=False, picker=False, expire_every=expire_every
    )


async def test_drop_memory_only_saves_first_and_disk_deletes(demo_model, home):
    app = _app(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "remember me")
        messages = list(conversation.session.messages)
        assert not store.exists(name)  # never saved
        await pilot.press("f8")
        await pilot.pause()
        assert isinstance(app.screen, DropDialog)
        await pilot.click("#drop-memory")
        await settle(pilot)
        await until(pilot, lambda: not app.conversations())
        assert app.sidebar.info is None
        assert (home / "data" / "sessions" / name / "session.json").is_file()
        assert store.load(name, demo_model).session.messages == messages
        assert name not in app.pool
        assert any(
            f"Saved as {name} and closed; reopen it with Ctrl+O" in n.message
            for n in notifications(app)
        )

        await pilot.press("ctrl+t")
        await settle(pilot)
        await send(pilot, "forget me")
        gone = app.active_conversation().session_name
        await pilot.click("#btn-save")
        await settle(pilot)
        assert store.exists(gone)
        await pilot.click("#btn-drop")
        await pilot.pause()
        await pilot.click("#drop-disk")
        await settle(pilot)
        assert app.conversations() == [] and gone not in app.pool
        assert not (home / "data" / "sessions" / gone).exists()
        assert store.exists(name)


async def test_ttl_offloads_an_idle_cache_and_the_next_turn_reloads_it(demo_model, home):
    app = _app(demo_model, ttl=0.01)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session, name = conversation.session, conversation.session_name
        assert name in app.pool and app.pool.ttl_s == 0.01
        await send(pilot, "hello")
        tokens = session.cache_tokens
        assert tokens > 0
        await idle_past_ttl(pilot, name)
        app.expire_idle()  # the timer's tick
        await settle(pilot)
        assert session.cache_tokens == 0 and not app.pool.entry(name).in_memory
        assert (home / "data" / "sessions" / name / "cache.safetensors").is_file()
        assert store.summary(name).cache_tokens == tokens
        assert conversation.saved and conversation.offloaded
        info = app.sidebar.info
        assert info.state == "offloaded to disk" and info.cache_tokens == 0

        await send(pilot, "and again")
        assert app.pool.entry(name).in_memory
        assert session.last_stats.reused_tokens > 0
        assert session.last_stats.reused_tokens >= tokens - 1
        assert app.sidebar.info.state == "idle"


async def test_discarding_an_offloaded_tab_deletes_the_offloads_copy(demo_model, home):
    app = _app(demo_model, ttl=0.01)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "never saved")
        await idle_past_ttl(pilot, name)
        app.expire_idle()
        await settle(pilot)
        assert conversation.offloaded and store.exists(name)  # the offload wrote it
        assert conversation.unsaved  # ...but the user never saved it: closing asks
        await pilot.press("ctrl+w")
        await pilot.pause()
        assert isinstance(app.screen, CloseDialog)
        await pilot.click("#close-discard")
        await settle(pilot)
        assert app.conversations() == [] and name not in app.pool
        assert not store.exists(name)
        assert not (home / "data" / "sessions" / name).exists()


async def test_the_timer_offloads_but_never_a_busy_tab(demo_model, home):
    app = _app(demo_model, ttl=0.01, expire_every=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "hello")
        await until(pilot, lambda: conversation.offloaded)
        assert store.exists(name)

        # while another owner holds the model, the tab waits: it is busy, so never offloaded
        ticket = app.scheduler.request("another tab")
        app.scheduler.wait(ticket)
        assert await conversation.turns.send("queued")
        await until(pilot, lambda: conversation.owner in app.scheduler.waiting())
        await idle_past_ttl(pilot, name)
        app.expire_idle()  # a tick while the tab waits for the model
        assert conversation.busy and conversation.owner in app.scheduler.waiting()
        app.scheduler.done(ticket)
        await settle(pilot, conversation)
        assert conversation.session.messages[-1]["role"] == "assistant"
        assert conversation.session.last_stats.reused_tokens > 0  # reloaded from disk


async def test_memory_budget_offloads_the_least_recently_used(demo_model, home):
    app = _app(demo_model, ttl=0, memory_budget=1)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await send(pilot, "first tab")
        second = await new_tab(pilot)
        await send(pilot, "second tab")
        app.expire_idle()
        await settle(pilot)
        assert first.offloaded and not second.offloaded
        assert first.session.cache_tokens == 0 and second.session.cache_tokens > 0
        assert store.exists(first.session_name)


async def test_a_new_tab_starts_from_the_shared_system_prompt(demo_model, home):
    app = _app(demo_model, system=SYSTEM)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await send(pilot, "hello")
        system_tokens = len(first.session.render(first.session.messages[:1], False))
        assert system_tokens > 0
        second = await new_tab(pilot)
        assert second is not first and second.session_name in app.pool
        assert second.session.cache_tokens == system_tokens
        await send(pilot, "a different question")
        assert second.session.last_stats.reused_tokens == system_tokens
        assert first.session.messages[-1]["role"] == "assistant"  # the first is untouched


async def test_the_timer_fires_safely_under_a_dialog(demo_model, home):
    """A tick while the help screen is on top still finds the tabs and the sidebar."""
    app = _app(demo_model, ttl=0.01)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "hello")
        await pilot.press("f1")
        await until(pilot, lambda: app.screen is not app.main_screen)
        await idle_past_ttl(pilot, conversation.session_name)
        app.expire_idle()
        await settle(pilot)
        assert not app.pool.entry(conversation.session_name).in_memory
        assert app.sidebar.info.state == "offloaded to disk"


async def test_a_damaged_session_says_so_when_resumed(demo_model, home):
    """``--resume`` of a session whose session.json is damaged says that, as the CLI does,
    not that a model '?' could not be loaded; a new tab opens instead."""
    folder = home / "data" / "sessions" / "broken1"
    folder.mkdir(parents=True)
    (folder / "session.json").write_text('{"messages": ')
    app = KvChatApp(
        Config(model="demo", max_tokens=4, autosave=False),
        lm=demo_model,
        resume="broken1",
        volatile=False,
    )
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: bool(app.conversations()) and bool(notifications(app)))
        said = [str(n.message) for n in notifications(app)]
        assert any("broken1" in m and "session.json is damaged" in m for m in said), said
        assert not any("Could not load model" in m for m in said), said
        assert app.active_conversation().session_name != "broken1"
    assert (folder / "session.json").read_text() == '{"messages": '  # left as it was
