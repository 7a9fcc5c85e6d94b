"""Ctrl+N: a new tab on another model, loaded on demand and unloaded with its last tab;
a saved session opens on its own model; a model that cannot load loses nothing."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from textual.widgets import Input

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.engine.models.model import load_model
from kvchat.tui.screens.loading import LoadingScreen
from kvchat.tui.screens.settings import ModelDialog
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio

OTHER = "demo@q4"  # the demo's shape with 4-bit weights: another model, built in a second
TEXT = "Say something."  # the two models answer it differently


def solo(lm, text: str = TEXT) -> str:
    """The greedy reply of a fresh session on ``lm`` (max tokens as make_app's)."""
    session = Session(lm, settings=GenerationSettings(max_tokens=8))
    return [e for e in session.send(text) if isinstance(e, TurnDone)][0].reply


async def open_model_tab(pilot, spec: str) -> None:
    await pilot.press("ctrl+n")
    await until(pilot, lambda: isinstance(pilot.app.screen, ModelDialog))
    pilot.app.screen.query_one("#model-input", Input).value = spec
    await pilot.click("#model-use")
    await settle(pilot)
    await until(pilot, lambda: not isinstance(pilot.app.screen, LoadingScreen))


async def test_a_tab_on_another_model_answers_with_it_and_unloads_it_when_closed(
    make_app, demo_model
):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await open_model_tab(pilot, OTHER)
        second = app.active_conversation()
        assert second is not first and len(app.conversations()) == 2
        other = app.models.get(OTHER)
        assert second.session.lm is other and first.session.lm is demo_model
        assert app.models.holders() == {"demo": 2, OTHER: 1}  # the app, tab 1; tab 2
        assert "model       demo@q4" in widget_text(app.sidebar)

        await send(pilot, TEXT)
        expected = solo(other)
        assert expected != solo(demo_model)
        assert second.session.messages[-1]["content"] == expected

        app.tabs.active = first.parent.id
        await settle(pilot)
        assert "model       demo " in widget_text(app.sidebar) + " "
        await send(pilot, TEXT)
        assert first.session.messages[-1]["content"] == solo(demo_model)

        # closing tab 2 (saved first: Ctrl+W then closes at once) unloads its model
        app.tabs.active = second.parent.id
        await settle(pilot)
        await pilot.press("ctrl+s")
        await settle(pilot)
        gone = weakref.ref(other.model)
        name = second.session_name
        del other, second  # the test's own references
        on_ui_thread = []  # where each release (and so the unload) ran
        release = app.models.release
        app.models.release = lambda lm: (
            on_ui_thread.append(threading.current_thread() is threading.main_thread()),
            release(lm),
        )[1]
        await pilot.press("ctrl+w")
        await settle(pilot)
        await until(pilot, lambda: len(app.conversations()) == 1)
        gc.collect()
        assert app.models.holders() == {"demo": 2}
        assert gone() is None
        assert on_ui_thread == [False]  # in a worker: an unload never stalls the UI
        assert store.read(name)["model_id"] == OTHER


async def test_a_saved_session_opens_on_its_own_model_with_its_cache(make_app, kvchat_dirs):
    other = load_model(OTHER)
    session = Session(other, settings=GenerationSettings(max_tokens=8))
    for _ in session.send(TEXT):
        pass
    store.save(session, "on-q4")
    app = make_app(picker=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert OTHER not in app.models.holders()
        app.open_saved("on-q4")
        await settle(pilot)
        await until(pilot, lambda: len(app.conversations()) == 2)
        opened = app.active_conversation()
        assert opened.session.lm.model_id == OTHER
        assert opened.session.ledger == session.ledger  # the cache, not a rebuild
        assert "Resumed with its cache from disk" in widget_text(opened.log)
        assert app.models.holders()[OTHER] == 1
        await send(pilot, "and more")
        assert opened.session.last_stats.reused_tokens > 0
        assert opened.session.last_stats.rebuilt is None


async def test_a_model_that_cannot_load_says_so_and_loses_no_tab(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "keep me")
        missing = tmp_path / "no-such-model"
        await open_model_tab(pilot, str(missing))
        await until(
            pilot, lambda: any("Could not load model" in n.message for n in notifications(app))
        )
        message = [n.message for n in notifications(app)][-1]
        assert message.startswith(f"Could not load model '{missing}'") and "\n" not in message
        assert app.conversations() == [conversation]
        assert app.active_conversation() is conversation
        assert conversation.session.messages[0]["content"] == "keep me"
        assert app.models.holders() == {"demo": 2}


async def test_the_first_frame_comes_before_the_model_which_loads_into_the_registry(
    home, kvchat_dirs
):
    """The app's first frame is the loading screen, composed while its model's load waits
    (here for the scheduler, which the test holds); then the model loads into the registry
    and the first tab opens on it."""
    from kvchat.config import Config
    from kvchat.tui.app import KvChatApp

    app = KvChatApp(Config(model="demo", max_tokens=4, autosave=False), volatile=False)
    held = app.scheduler.request("held by the test")  # the model's load waits for it
    app.scheduler.wait(held)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.scheduler.waiting() == ["load:demo"])
        assert isinstance(app.screen, LoadingScreen)
        assert widget_text(app.screen.query_one("#loading-message")) == "Loading model demo…"
        assert app.lm is None and app.models.holders() == {} and not app.conversations()
        app.scheduler.done(held)
        await until(pilot, lambda: app.lm is not None, timeout=30)
        await settle(pilot)
        assert app.models.get("demo") is app.lm
        assert app.models.holders() == {"demo": 2}  # the app's own hold, and tab 1's
        await send(pilot, TEXT)
        assert app.active_conversation().session.lm is app.lm


async def test_a_saved_session_whose_model_cannot_load_stays_on_disk(
    make_app, demo_model, tmp_path
):
    import json

    session = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    for _ in session.send(TEXT):
        pass
    folder = store.save(session, "lost-model")
    data = json.loads((folder / "session.json").read_text())
    missing = str(tmp_path / "gone-model")
    data["model_id"] = missing
    (folder / "session.json").write_text(json.dumps(data))
    app = make_app(picker=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        tab = app.active_conversation()
        app.open_saved("lost-model")
        await settle(pilot)
        await until(pilot, lambda: not isinstance(app.screen, LoadingScreen))
        message = [n.message for n in notifications(app)][-1]
        assert message.startswith(f"Could not load model '{missing}'") and "\n" not in message
        assert app.conversations() == [tab] and app.models.holders() == {"demo": 2}
    assert store.read("lost-model")["messages"] == session.messages  # untouched
