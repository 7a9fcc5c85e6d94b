"""The message being sent survives a crash: it is on disk (durably) before its prefill
starts, and the next time its session is opened kvchat offers it back."""

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
from kvchat.tui.screens.dialogs import DraftDialog

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
