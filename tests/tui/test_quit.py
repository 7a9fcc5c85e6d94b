"""Quitting saves: Ctrl+Q saves every tab with unsaved changes (autosave) or asks once,
listing them; a signal saves once the app and its workers have ended (autosave)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvchat import drafts, store
from kvchat.config import Config
from kvchat.store.lock import lock_file
from kvchat.tui.app import KvChatApp
from kvchat.tui.run import after_exit
from kvchat.tui.screens.close import CloseDialog

from .conftest import SIZE, new_tab, send, settle, until, widget_text
from .test_stream_and_quit import run_tui_and_quit

pytestmark = pytest.mark.anyio


def saving_app(demo_model, max_tokens: int = 8) -> KvChatApp:
    """An app on ``demo`` that autosaves into the test's sessions folder."""
    return KvChatApp(
        Config(model="demo", max_tokens=max_tokens, autosave=True), lm=demo_model, volatile=False
    )


def talk(name: str) -> list[tuple[str, str]]:
    """The saved transcript of ``name``: (role, text) of each message."""
    return [(m["role"], m["content"]) for m in store.read(name)["messages"]]


async def test_ctrl_q_saves_an_undo_with_autosave(demo_model, home):
    app = saving_app(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "one")
        await send(pilot, "two")
        assert [t for r, t in talk(name) if r == "user"] == ["one", "two"]  # autosaved
        assert "(unsaved)" not in widget_text(app.sidebar)
        await pilot.press("ctrl+l")
        await pilot.pause()
        await pilot.click("#trim-undo")
        await settle(pilot, conversation)
        kept = list(conversation.session.messages)
        assert [m["content"] for m in kept if m["role"] == "user"] == ["one"]
        assert conversation.unsaved  # an undo is a change, though no turn ended
        assert "(unsaved)" in widget_text(app.sidebar)

        await pilot.press("ctrl+q")
        await until(pilot, lambda: app.return_code is not None, timeout=20)
    assert app.return_code == 0
    assert talk(name) == [(m["role"], m["content"]) for m in kept]  # the undone state


async def test_ctrl_q_without_autosave_asks_once_for_every_unsaved_tab(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await send(pilot, "saved before")
        await pilot.press("ctrl+s")
        await settle(pilot)
        on_disk = store.read(first.session_name)["messages"]
        await send(pilot, "changed since")
        second = await new_tab(pilot)
        await send(pilot, "never saved")
        clean = await new_tab(pilot)  # nothing in it: not listed

        await pilot.press("ctrl+q")
        await until(pilot, lambda: isinstance(app.screen, CloseDialog))
        listed = widget_text(app.screen.query_one("#close-list"))
        assert f"'{first.session_name}' has changes since it was last saved" in listed
        assert f"'{second.session_name}' has not been saved" in listed
        assert clean.session_name not in listed
        await pilot.click("#close-cancel")  # cancel: the app stays, nothing written
        await settle(pilot)
        assert app.return_code is None and len(app.conversations()) == 3
        assert store.read(first.session_name)["messages"] == on_disk

        await pilot.press("ctrl+q")
        await until(pilot, lambda: isinstance(app.screen, CloseDialog))
        await pilot.click("#close-discard")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 0
    assert store.read(first.session_name)["messages"] == on_disk  # left as it was
    assert not store.exists(second.session_name)


async def test_ctrl_q_without_autosave_save_all_writes_every_tab(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        await send(pilot, "first tab")
        second = await new_tab(pilot)
        await send(pilot, "second tab")
        await pilot.press("ctrl+q")
        await until(pilot, lambda: isinstance(app.screen, CloseDialog))
        await pilot.click("#close-save")
        await until(pilot, lambda: app.return_code is not None, timeout=20)
    assert app.return_code == 0
    assert [t for r, t in talk(first.session_name) if r == "user"] == ["first tab"]
    assert [t for r, t in talk(second.session_name) if r == "user"] == ["second tab"]


async def test_a_signal_ends_the_app_and_its_changes_are_saved_after(demo_model, home):
    """The handler's path in-process: SIGTERM stops and ends the app at once; what is
    unsaved is saved once it has ended, as ``run_app`` does after ``App.run``."""
    app = saving_app(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        await send(pilot, "one")
        await send(pilot, "two")
        session = conversation.session
        session.undo()
        kept = [(m["role"], m["content"]) for m in session.messages]
        app.quitter.on_signal(signal.SIGTERM)
        await until(pilot, lambda: app.return_code is not None)
    assert talk(name) != kept  # not saved by the app itself: it ended at once
    leases = lock_file(name).parent
    assert [p.name for p in leases.glob("*.open")] == [f"{name}.{os.getpid()}.open"]
    assert after_exit(app) == 0
    assert talk(name) == kept
    assert list(leases.glob("*.open")) == []  # let go of: closed, for other kvchats


@pytest.mark.parametrize("end", [signal.SIGTERM, signal.SIGHUP])
def test_a_real_kvchat_ended_by_a_signal_saves_and_exits_0(tmp_path, end):
    """A real ``kvchat`` on a pseudo-terminal: a message sent, then the signal while its
    turn runs (or just after): the turn is kept (stopped if it was cut) and saved."""
    home = tmp_path / "home"
    code, out = run_tui_and_quit(str(home), 0.2, message="keep this message", end=end, sent=True)
    assert code == 0, out[-1500:].decode(errors="replace")
    saved = json.loads((home / "sessions" / "chat-1" / "session.json").read_text())
    user, reply = saved["messages"][-2:]
    assert user == {"role": "user", "content": "keep this message"}
    assert reply["role"] == "assistant"
    assert not (home / "drafts" / "chat-1.txt").exists()  # saved: no draft left


async def test_a_save_that_fails_on_quitting_keeps_the_app_open(demo_model, home):
    app = saving_app(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "one")
        conversation.session.settings.temp = 0.5  # a change of settings: unsaved

        def full_disk() -> None:
            raise OSError(28, "No space left on device")

        conversation.save_now = full_disk
        await pilot.press("ctrl+q")
        await until(
            pilot, lambda: any(n.message.startswith("Could not save") for n in app._notifications)
        )
        await settle(pilot)
        assert app.return_code is None and conversation.unsaved
        await send(pilot, "two")  # the app still works
        assert conversation.session.messages[-2]["content"] == "two"
        await pilot.press("ctrl+q")  # again: quits at once
        await until(pilot, lambda: app.return_code is not None)


async def sigterm_mid_reply(app: KvChatApp, message: str) -> str:
    """Run ``app``, send ``message``, and end the app with SIGTERM once its reply streams;
    return the tab's session name."""
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        assert await conversation.turns.send(message)
        await until(pilot, lambda: conversation.turns.reply is not None)
        app.quitter.on_signal(signal.SIGTERM)
        await until(pilot, lambda: app.return_code is not None)
    return conversation.session_name


async def test_a_signal_mid_reply_keeps_the_stopped_reply_and_saves_it_after(demo_model, home):
    """SIGTERM while a reply streams: the app ends with status 0 and the reply, stopped, is
    saved once it has (the reply's last events may reach a tab whose widgets the ending app
    is removing: they change no widget; the real-terminal test above meets that race)."""
    app = saving_app(demo_model, max_tokens=8000)
    name = await sigterm_mid_reply(app, "keep this message")
    assert app.return_code == 0
    assert after_exit(app) == 0
    user, reply = store.read(name)["messages"][-2:]
    assert user == {"role": "user", "content": "keep this message"}
    assert reply["role"] == "assistant" and reply["stopped"] is True and reply["content"]


async def test_a_signal_mid_reply_without_autosave_keeps_the_message_as_a_draft(make_app):
    """Autosave off: nothing is saved after the signal, so the message in flight stays on
    disk as its draft (offered back when the session is next opened)."""
    app = make_app(max_tokens=8000)
    name = await sigterm_mid_reply(app, "keep this message")
    assert after_exit(app) == 0
    assert not store.exists(name)
    assert drafts.draft_file(name).read_text() == "keep this message"
