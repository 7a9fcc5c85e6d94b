"""The message box: prompt history, $EDITOR and /file, driven through the real app."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys

import pytest

from kvchat.tui import prompt_history as history
from kvchat.tui.screens.file_name import FileDialog
from kvchat.tui.textual_compat import notifications
from kvchat.tui.widgets.messages import UserMessage

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio


def _notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


async def test_up_and_down_walk_this_tabs_prompts_then_the_saved_ones(make_app):
    history.remember("from another session")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        box = conversation.input
        await send(pilot, "first question")
        await send(pilot, "second\nline two")

        await pilot.press("up")
        assert box.text == "second\nline two" and box.cursor_location == (1, 8)
        await pilot.press("up")  # on the last line of a two-line prompt: the cursor moves
        assert box.text == "second\nline two" and box.cursor_location[0] == 0
        await pilot.press("up")
        assert box.text == "first question"
        await pilot.press("up")
        assert box.text == "from another session"
        await pilot.press("up")  # the oldest: stays
        assert box.text == "from another session"
        await pilot.press("down", "down")
        assert box.text == "second\nline two"
        await pilot.press("down")  # past the newest: the empty box
        assert box.text == ""

        await pilot.press("up", "up", "up")
        assert box.text == "first question"
        await pilot.press("escape")  # leaves the history
        assert box.text == ""

        await pilot.press("up", "up", "up", *" again")  # edit a recalled prompt
        assert box.text == "first question again"
        await pilot.press("up")  # typed text: Up moves the cursor, nothing is replaced
        assert box.text == "first question again"
        await pilot.press("enter")
        await settle(pilot, conversation)
        sent = [m["content"] for m in conversation.session.messages if m["role"] == "user"]
        assert sent == ["first question", "second\nline two", "first question again"]
        assert str(list(conversation.query(UserMessage))[-1].text) == "first question again"
        assert history.load()[:3] == ["first question again", "second\nline two", "first question"]
        assert "first question" in history.load()  # the edit changed no entry

        await pilot.press("up", "up", "up", "enter")  # a recalled prompt sent as it is
        await settle(pilot, conversation)
        assert conversation.session.messages[-2] == {"role": "user", "content": "second\nline two"}

    path = history.history_file()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    app = make_app()  # a new app, a new tab: the saved history comes first
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("up")
        assert app.active_conversation().input.text == "second\nline two"
        assert json.loads(path.read_text())[-1] == "from another session"


async def test_ctrl_g_runs_the_editor_and_a_missing_editor_loses_nothing(
    make_app, tmp_path, monkeypatch
):
    script = tmp_path / "editor.py"
    script.write_text("import sys\np = sys.argv[1]\nopen(p, 'a').write(' edited\\n')\n")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        box = app.active_conversation().input
        await pilot.press(*"draft")

        monkeypatch.delenv("VISUAL", raising=False)
        monkeypatch.delenv("EDITOR", raising=False)
        await pilot.press("ctrl+g")
        assert box.text == "draft"
        assert _notices(app)[-1] == "Set $EDITOR to edit messages in an editor."

        monkeypatch.setenv("EDITOR", f"{sys.executable} {script}")
        await pilot.press("ctrl+g")  # the test driver cannot hand the terminal over
        assert box.text == "draft"
        assert _notices(app)[-1] == "This terminal cannot hand over to an editor."

        # In a real terminal App.suspend() hands it over; here it does nothing, and the
        # editor (a real subprocess) runs as it would.
        monkeypatch.setattr(app, "suspend", contextlib.nullcontext)
        await pilot.press("ctrl+g")
        assert box.text == "draft edited"
        command = next(
            c for c in app.get_system_commands(app.screen) if c.title == "Edit in $EDITOR"
        )  # the palette's entry
        await command.callback()
        assert box.text == "draft edited edited"
        monkeypatch.setenv("EDITOR", f"{sys.executable} -c 'import sys; sys.exit(1)'")
        await pilot.press("ctrl+g")
        assert box.text == "draft edited edited"
        assert "exited with status 1" in _notices(app)[-1]


async def test_slash_file_inserts_the_text_with_its_token_count(make_app, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("The cache keeps\nevery token.\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "huge.txt").write_bytes(b"a" * ((1 << 20) + 1))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        box = conversation.input
        for bad, says in [
            ("missing.txt", "No file at "),
            ("blob.bin", "is not a text file"),
            ("huge.txt", "more than the 1,048,576 kvchat reads"),
            (".", "is a folder"),
        ]:
            command = f"Intro\n/file {tmp_path / bad}"
            box.text = command
            await pilot.press("enter")
            await pilot.pause()
            assert box.text == command, bad  # nothing lost, nothing sent
            assert says in _notices(app)[-1] and "\n" not in _notices(app)[-1], bad
        assert conversation.session.messages == []

        box.text = f"Intro\n/file {notes}"
        await pilot.press("enter")
        await pilot.pause()
        assert box.text == "Intro\nThe cache keeps\nevery token.\n"
        tokens = conversation.session.lm.tokenizer.encode(
            "The cache keeps\nevery token.\n", add_special_tokens=False
        )
        assert 3 < len(tokens) < 40
        assert _notices(app)[-1] == (
            f"Inserted {notes}: {len(tokens)} tokens (29 bytes); Enter sends."
        )
        assert conversation.session.messages == []  # not sent until Enter
        await pilot.press("enter")
        await settle(pilot, conversation)
        assert conversation.session.messages[0]["content"] == (
            "Intro\nThe cache keeps\nevery token.\n"
        )

        # Ctrl+F: a path dialog; the text goes in at the cursor
        (tmp_path / "esc.txt").write_text("red \x1b[31m!")
        await pilot.press(*"ab", "left", "ctrl+f")
        await pilot.pause()
        assert isinstance(app.screen, FileDialog)
        app.screen.query_one("#file-input").value = str(tmp_path / "esc.txt")
        await pilot.press("enter")
        await pilot.pause()
        assert box.text == "ared \\x1b[31m!b"  # the ESC shown as text, never sent raw
        assert _notices(app)[-1].startswith(f"Inserted {tmp_path / 'esc.txt'}: ")
        await pilot.press("ctrl+f")
        await pilot.pause()
        app.screen.query_one("#file-input").value = str(tmp_path / "blob.bin")
        await pilot.click("#file-ok")
        await pilot.pause()
        assert box.text == "ared \\x1b[31m!b" and "is not a text file" in _notices(app)[-1]


async def test_escape_stops_the_reply_before_it_empties_a_recalled_prompt(make_app):
    from .test_stream_and_quit import gate_after_first_chunk

    app = make_app(max_tokens=48)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        box = conversation.input
        first, go_on = gate_after_first_chunk(conversation.session)
        assert await conversation.turns.send("Tell me a story.")
        await until(pilot, first.is_set)
        box.focus()
        await pilot.press("up")  # recalls the prompt being answered
        assert box.recalled and box.text == "Tell me a story."
        await pilot.press("escape")  # the reply stops; the box keeps the prompt
        go_on.set()
        await settle(pilot, conversation)
        assert conversation.session.messages[-1].get("stopped") is True
        assert box.text == "Tell me a story."
        await pilot.press("escape")  # nothing to stop now: the box empties
        assert box.text == ""


async def test_the_footer_offers_escape_to_stop_while_a_reply_is_written(make_app):
    """While a reply is written the footer shows Esc "Stop" (the message box's own Esc,
    which empties a recalled prompt, stands aside then), and once it is done, not."""
    from textual.widgets import Footer

    from .test_stream_and_quit import gate_after_first_chunk

    app = make_app(max_tokens=48)
    async with app.run_test(size=(160, 30)) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        footer = app.screen.query_one(Footer)
        assert conversation.input.has_focus and "Stop" not in widget_text(footer)
        first, go_on = gate_after_first_chunk(conversation.session)
        assert await conversation.turns.send("Tell me a story.")
        await until(pilot, first.is_set)
        await until(pilot, lambda: "esc Stop" in widget_text(footer))
        go_on.set()
        await settle(pilot, conversation)
        await until(pilot, lambda: "Stop" not in widget_text(footer))


async def test_sending_while_another_kvchat_holds_the_history_lock_waits_off_the_ui(make_app):
    """The history lock is taken in a worker: a send returns at once while another kvchat
    holds it, and the prompt is saved once that one lets go (on the UI thread, the send
    would have waited out the lock's 5 s and lost the prompt)."""
    from kvchat.store.lock import file_lock

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        with file_lock(history.lock_file(), "The prompt history (another kvchat)"):
            assert await conversation.turns.send("while locked")
            assert history.load() == []  # not yet: the worker waits for the lock
        await settle(pilot, conversation)
        assert history.load() == ["while locked"]
        assert not [n for n in _notices(app) if "history" in n]


async def test_keys_typed_right_after_ctrl_t_go_into_the_new_tab(make_app):
    """A fast typist's keys arrive before the app has handled Ctrl+T: they all wait in the
    app's queue, and the new tab's box gets the ones after it (they landed in the old
    tab's box)."""
    from textual import events

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        first.focus_input()
        await pilot.pause()
        for key in ("o", "k", "ctrl+t", "h", "i"):  # queued at once, as typed
            app.post_message(events.Key(key, None if key == "ctrl+t" else key))
        await until(pilot, lambda: len(app.conversations()) == 2)
        await settle(pilot)
        second = app.active_conversation()
        assert second is not first
        assert (first.input.text, second.input.text) == ("ok", "hi")


async def test_keys_typed_while_a_session_loads_wait_for_its_box(demo_model, home):
    """The loading screen of ``--resume`` shows the saved transcript at once; what is typed
    behind it (Backspace too) is kept and put in the session's box when its tab opens."""
    from kvchat import store
    from kvchat.config import Config
    from kvchat.engine.conversation.session import Session
    from kvchat.tui.app import KvChatApp
    from kvchat.tui.screens.loading import LoadingScreen

    session = Session(demo_model)
    for _ in session.send("Opening line."):
        pass
    store.save(session, "slow")
    app = KvChatApp(
        Config(model="demo", max_tokens=4, autosave=False),
        lm=demo_model,
        resume="slow",
        volatile=False,
    )
    held = app.scheduler.request("held by the test")  # the session's load waits for it
    app.scheduler.wait(held)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LoadingScreen))
        shown = widget_text(app.screen.query_one("#loading-transcript"))  # at once, as saved
        assert "user: Opening line." in shown
        assert f"assistant: {session.messages[-1]['content'][:20]}" in shown
        await pilot.press(*"and thenn", "backspace", "?")
        app.scheduler.done(held)
        await until(pilot, lambda: bool(app.conversations()))
        await settle(pilot)
        shown = app.active_conversation()
        assert shown.session_name == "slow" and shown.input.text == "and then?"
