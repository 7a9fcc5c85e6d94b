"""Nothing typed is lost: the message being sent is on disk (durably) before its prefill
starts, and what the message box holds a moment after each change (and at quitting);
the next time its session is opened kvchat gives them back, and the session picker
lists the sessions never saved that have one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from textual.widgets import Button

from kvchat import drafts, store
from kvchat.engine.conversation.session import Prefill, Session
from kvchat.tui.screens.changed_on_disk import ConflictDialog
from kvchat.tui.screens.draft import DraftDialog
from kvchat.tui.screens.picker import SessionPicker

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def long_message(words: int) -> str:
    vocabulary = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    pick = random.Random(7).choice
    return "A long paste:\n" + " ".join(pick(vocabulary) for _ in range(words)) + " ✓"


@pytest.fixture
def offered(demo_model, home):
    """``kvchat ask --session paste`` with a long message, killed with SIGKILL as soon as its
    draft is on disk (its prefill takes seconds); then the TUI resuming ``paste``."""
    session = Session(demo_model)
    for _ in session.send("hello"):
        pass
    store.save(session, "paste")
    message = long_message(1200)
    draft = drafts.draft_file("paste")

    proc = subprocess.Popen(
        [*CLI, "ask", "--session", "paste", "--max-tokens", "4", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=os.environ.copy(),
    )
    proc.stdin.write(message.encode())
    proc.stdin.close()
    deadline = time.monotonic() + 120
    while not draft.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read()[-500:]
    assert draft.read_bytes() == message.encode()  # all of it, written before the prefill
    assert [m["content"] for m in store.read("paste")["messages"]] == [
        "hello",
        session.messages[-1]["content"],
    ]  # the killed turn never reached the session

    from kvchat.config import Config
    from kvchat.tui.app import KvChatApp

    app = KvChatApp(
        Config(model="demo", max_tokens=4, autosave=False),
        lm=demo_model,
        resume="paste",
        volatile=False,
    )
    return app, message


async def test_a_message_killed_in_its_prefill_is_offered_back_and_restored(offered):
    app, message = offered
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: isinstance(app.screen, DraftDialog) and drafts.OFFER in widget_text(app.screen),
            timeout=30,
        )
        shown = widget_text(app.screen.query_one("#draft-preview"))
        assert " ".join(shown.split()).startswith(" ".join(message[:200].split()))
        app.screen.query_one("#draft-restore", Button).press()
        await settle(pilot)
        conversation = app.active_conversation()
        assert conversation.input.text == message
        await send(pilot, conversation.input.text)  # sent at last: no draft left
        assert not drafts.draft_file("paste").exists()
        assert conversation.session.messages[-2] == {"role": "user", "content": message}


async def test_discard_lets_the_draft_go(offered):
    app, _ = offered
    async with app.run_test(size=SIZE) as pilot:
        await until(
            pilot,
            lambda: isinstance(app.screen, DraftDialog) and app.screen.query("#draft-discard"),
            timeout=30,
        )
        app.screen.query_one("#draft-discard", Button).press()
        await until(pilot, lambda: not isinstance(app.screen, DraftDialog))
        await until(pilot, lambda: not drafts.draft_file("paste").exists())
        assert app.active_conversation().input.text == ""


async def test_the_tui_keeps_the_message_on_disk_while_its_turn_runs(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        seen: list[bytes | None] = []
        go_on = threading.Event()
        real_send = session.send

        def send_watched(text):  # the real turn: what is on disk when its prefill starts
            events = real_send(text)

            def watched():
                for event in events:
                    if isinstance(event, Prefill) and not seen:
                        path = drafts.draft_file(conversation.session_name)
                        seen.append(path.read_bytes() if path.exists() else None)
                        go_on.wait(20)
                    yield event

            return watched()

        session.send = send_watched
        assert await conversation.turns.send("a message in flight")
        await until(pilot, lambda: bool(seen))
        assert seen == ["a message in flight".encode()]
        go_on.set()
        await settle(pilot, conversation)
        assert not drafts.draft_file(conversation.session_name).exists()  # the turn ended


async def test_a_message_typed_and_not_sent_comes_back_after_quitting(make_app):
    """Ctrl+Q a moment after typing (before the box went to disk on its own): the text is
    kept, the picker lists the never-saved session with it, and opening it puts the text
    back in the box, where typing goes on at its end."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        conversation.focus_input()
        await pilot.press(*"half a thought")
        await pilot.press("ctrl+q")
    assert drafts.typed(name, []) == "half a thought"
    assert not store.exists(name)

    again = make_app(picker=True)
    async with again.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(again.screen, SessionPicker))
        rows = widget_text(again.screen.query_one("#picker-table"))
        assert name in rows and "unsent: half a thought" in rows
        await pilot.press("enter")
        await until(pilot, lambda: again.active_conversation() is not None)
        await settle(pilot)
        shown = again.active_conversation()
        assert shown.session_name == name and shown.input.text == "half a thought"
        shown.focus_input()
        await pilot.press(*", finished")  # typing goes on at its end
        assert shown.input.text == "half a thought, finished"
        await send(pilot, shown.input.text)
        await until(pilot, lambda: drafts.typed(name, []) is None)  # sent: the box is empty


async def test_a_message_held_back_by_the_conflict_dialog_survives_ctrl_q(demo_model, home):
    """Another kvchat saved the session; the message sent into the "changed on disk"
    dialog stays in the box; Ctrl+Q then keeps it, and reopening gives it back."""
    session = Session(demo_model)
    for _ in session.send("Opening line."):
        pass
    store.save(session, "k1")
    from kvchat.config import Config
    from kvchat.tui.app import KvChatApp

    def resumed() -> KvChatApp:
        config = Config(model="demo", max_tokens=4, autosave=True)
        return KvChatApp(config, lm=demo_model, resume="k1", volatile=False)

    app = resumed()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: any(c.session_name == "k1" for c in app.conversations()), 60)
        await settle(pilot)
        tab = app.active_conversation()
        out = subprocess.run(
            [*CLI, "ask", "--session", "k1", "--max-tokens", "4", "Asked from the shell."],
            capture_output=True,
            timeout=120,
            env=os.environ.copy(),
        )
        assert out.returncode == 0, out.stderr
        tab.focus_input()
        await pilot.press(*"Typed in the TUI.")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ConflictDialog))
        await pilot.press("ctrl+q")
    assert drafts.typed("k1", store.read("k1")["messages"]) == "Typed in the TUI."

    again = resumed()
    async with again.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: any(c.session_name == "k1" for c in again.conversations()), 60)
        await settle(pilot)
        assert again.active_conversation().input.text == "Typed in the TUI."
