"""A session open in the TUI while a real `kvchat ask` process saves a turn to it:
nothing is overwritten, the user reloads (their tab's turns kept as a branch) or saves
the tab as a new session, and both exchanges are on disk afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from textual.widgets import Button

from kvchat import store
from kvchat.config import Config
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.tui.app import KvChatApp
from kvchat.tui.screens.changed_on_disk import ConflictDialog

from .conftest import SIZE, settle, until

pytestmark = pytest.mark.anyio
CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def real_ask(name: str, text: str) -> dict:
    """``kvchat ask --session name text`` in a process of its own; its JSON output."""
    out = subprocess.run(
        [*CLI, "ask", "--session", name, "--max-tokens", "6", "--json", text],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def saved_k1(lm) -> None:
    session = Session(lm, settings=GenerationSettings(max_tokens=6))
    [e for e in session.send("Opening line.") if isinstance(e, TurnDone)]
    store.save(session, "k1")


def pairs(name: str) -> set[tuple[str, str]]:
    """(message, reply) of every exchange saved in ``name``, on any branch."""
    data = store.read(name)
    nodes = (data.get("branches") or {}).get("nodes")
    if nodes is None:
        messages = data["messages"]
        return {
            (a["content"], b["content"])
            for a, b in zip(messages, messages[1:])
            if a["role"] == "user" and b["role"] == "assistant"
        }
    return {
        (nodes[n["parent"]]["content"], n["content"])
        for n in nodes
        if n["role"] == "assistant" and n["parent"] >= 0
    }


def dialog_shown(app) -> bool:
    """The conflict dialog is up, its buttons mounted."""
    return isinstance(app.screen, ConflictDialog) and bool(app.screen.query("#conflict-fork"))


def app_on_k1(demo_model) -> KvChatApp:
    config = Config(model="demo", max_tokens=6, autosave=True)
    return KvChatApp(config, lm=demo_model, resume="k1", volatile=False)


async def opened(pilot):
    app = pilot.app
    await until(pilot, lambda: any(c.session_name == "k1" for c in app.conversations()), 60)
    await settle(pilot)
    return next(c for c in app.conversations() if c.session_name == "k1")


async def test_an_ask_while_the_tab_is_open_is_kept_and_the_tab_reloads(demo_model, home):
    saved_k1(demo_model)
    app = app_on_k1(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        tab = await opened(pilot)
        asked = real_ask("k1", "Asked from the shell.")
        before = list(tab.session.messages)
        tab.input.text = "Typed in the TUI."
        tab.focus_input()
        await pilot.press("enter")
        await until(pilot, lambda: dialog_shown(app))
        assert tab.session.messages == before  # not sent over the ask's turn
        assert tab.input.text == "Typed in the TUI."  # the message stays in the box
        app.screen.query_one("#conflict-reload", Button).press()
        await until(pilot, lambda: tab not in app.conversations(), 60)
        await settle(pilot)
        shown = app.active_conversation()
        assert shown.session_name == "k1" and shown.input.text == "Typed in the TUI."
        assert [m["content"] for m in shown.session.messages][-2:] == [
            "Asked from the shell.",
            asked["reply"],
        ]  # the tab shows the ask's turn
        await pilot.press("enter")  # now it is sent, on top of the ask's turn
        await settle(pilot, shown)
        reply = shown.session.messages[-1]["content"]
    assert pairs("k1") >= {("Asked from the shell.", asked["reply"]), ("Typed in the TUI.", reply)}
    assert [m["content"] for m in store.read("k1")["messages"]][-4:] == [
        "Asked from the shell.",
        asked["reply"],
        "Typed in the TUI.",
        reply,
    ]


async def test_a_turn_saved_over_an_ask_asks_and_can_become_a_new_session(demo_model, home):
    """The ask saves while the tab's turn runs (after the look before the send): the
    tab's save is refused, the dialog offers a new session, both are kept."""
    saved_k1(demo_model)
    app = app_on_k1(demo_model)
    async with app.run_test(size=SIZE) as pilot:
        tab = await opened(pilot)
        # the other process saves while the scheduler holds this tab's turn back
        with app.scheduler.turn("held by the test"):
            assert await tab.turns.send("Typed in the TUI.")
            asked = real_ask("k1", "Asked from the shell.")
        await until(pilot, lambda: dialog_shown(app) and not tab.busy, 60)
        typed_reply = tab.session.messages[-1]["content"]
        app.screen.query_one("#conflict-fork", Button).press()
        await until(pilot, lambda: tab.session_name != "k1", 60)
        await settle(pilot)
        new = tab.session_name
    assert new == "k1-1"
    assert pairs("k1") == {
        ("Opening line.", store.read("k1")["messages"][1]["content"]),
        ("Asked from the shell.", asked["reply"]),
    }
    assert ("Typed in the TUI.", typed_reply) in pairs(new)
