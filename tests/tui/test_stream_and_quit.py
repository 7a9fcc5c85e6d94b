"""The reply is on screen while it is written, and quitting stops it, keeps it and saves it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import Footer, Markdown

from kvchat import store
from kvchat.config import Config
from kvchat.engine.conversation.session import Chunk
from kvchat.engine.conversation.thoughts import split_thoughts
from kvchat.tui.app import KvChatApp
from kvchat.tui.widgets.messages import (
    DRAW_SHARE,
    FLUSH_MAX_S,
    FLUSH_S,
    AssistantMessage,
    Pace,
)

from .conftest import SIZE, settle, until, widget_text

pytestmark = pytest.mark.anyio


def gate_after_first_chunk(session):
    """Wrap ``session.send`` so the real turn pauses after its first chunk with visible text
    until the test lets it go on (the reply of the tiny demo is over in a blink)."""
    return gate_chunks(session, 1)[0]


def gate_chunks(session, count: int) -> list[tuple[threading.Event, threading.Event]]:
    """Wrap ``session.send`` so the real turn pauses after each of its first ``count``
    chunks with visible text: each pause's first event is set when it is reached, and it
    goes on when the test sets the second."""
    pauses = [(threading.Event(), threading.Event()) for _ in range(count)]
    real_send = session.send

    def send(text):
        events = real_send(text)

        def gated():
            said, paused = "", 0
            try:
                for event in events:
                    yield event
                    if isinstance(event, Chunk) and paused < count:
                        said += event.text
                        if said.strip():  # something to see: the view strips leading space
                            reached, go_on = pauses[paused]
                            paused, said = paused + 1, ""
                            reached.set()
                            go_on.wait(20)
            finally:
                events.close()

        return gated()

    session.send = send
    return pauses


def shown_text(conversation) -> str:
    """The Markdown source of the last reply on screen ('' until it is mounted and composed)."""
    replies = conversation.log.query(AssistantMessage)
    markdown = replies.last().query(Markdown) if replies else []
    return markdown.first().source if markdown else ""


async def test_reply_text_is_on_screen_while_it_is_written(make_app):
    app = make_app(max_tokens=48)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        first, go_on = gate_after_first_chunk(conversation.session)
        assert await conversation.turns.send("Hello there.")
        await until(pilot, first.is_set)
        await until(pilot, lambda: bool(shown_text(conversation)))
        shown = shown_text(conversation)
        assert conversation.state == "answering"
        go_on.set()
        await settle(pilot, conversation)
        reply = split_thoughts(conversation.session.messages[-1]["content"]).answer
        assert shown and reply.startswith(shown) and len(reply) > len(shown)
        assert conversation.log.query(AssistantMessage).last().markdown.source == reply


async def test_the_log_follows_a_growing_reply_until_the_user_scrolls_up(make_app):
    """While a reply streams the log stays at its end as the reply grows on screen, with no
    word coming after the batch drawn; once the user scrolls up to read, later batches
    leave the log where the user put it; the reply's end brings it back down."""
    app = make_app(max_tokens=48)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        log = conversation.log
        (first, go_on), (second, go_on_again) = gate_chunks(conversation.session, 2)
        long_message = "\n".join(f"line {i} of a long message" for i in range(60))
        assert await conversation.turns.send(long_message)  # the log overflows at once
        await until(pilot, first.is_set)
        await until(pilot, lambda: bool(shown_text(conversation)))

        def following() -> bool:
            return log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y

        # (well within the gate's 20 s: a log that follows only the next word waits it out)
        await until(pilot, following, timeout=5)
        log.scroll_home(animate=False)  # the user reads from the top
        go_on.set()
        await until(pilot, second.is_set)
        drawn = shown_text(conversation)
        await until(pilot, lambda: shown_text(conversation) != drawn)  # the next batch
        await pilot.pause(0.2)  # a scroll after the batch (the old way's) has had its time
        assert log.scroll_y == 0 < log.max_scroll_y
        go_on_again.set()
        await settle(pilot, conversation)
        await until(pilot, following)


async def test_quit_mid_reply_stops_keeps_and_saves_it(demo_model, home):
    config = Config(model="demo", max_tokens=8000, autosave=True)
    app = KvChatApp(config, lm=demo_model, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        first, go_on = gate_after_first_chunk(conversation.session)
        assert await conversation.turns.send("Hello there.")
        await until(pilot, first.is_set)
        await pilot.press("ctrl+q")
        go_on.set()
        await until(pilot, lambda: app.return_code is not None, timeout=20)
    saved = store.read(name)
    last = saved["messages"][-1]
    assert last["role"] == "assistant" and last.get("stopped") is True and last["content"]
    turn = saved["turns"][-1]
    assert turn["stopped"] is True and 0 < turn["generated_tokens"] < 8000
    assert saved["ledger"] and len(saved["ledger"]) == saved["cache"]["tokens"]


async def test_quit_right_after_enter_keeps_and_saves_the_message(demo_model, home):
    """Ctrl+Q in the same breath as Enter: the turn is stopped, not run past or lost."""
    config = Config(model="demo", max_tokens=8000, autosave=True)
    app = KvChatApp(config, lm=demo_model, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        name = conversation.session_name
        sending = asyncio.create_task(conversation.turns.send("Hello there."))
        await asyncio.sleep(0)  # send() is now awaiting the mount of the message
        await app.action_quit()
        assert await sending
        await until(pilot, lambda: app.return_code is not None, timeout=20)
    assert app.return_code == 0
    saved = store.read(name)
    user, reply = saved["messages"][-2:]
    assert user == {"role": "user", "content": "Hello there."}
    assert reply["role"] == "assistant" and reply.get("stopped") is True
    assert saved["turns"][-1]["generated_tokens"] < 8000
    cached = saved["cache"]["tokens"] if saved["cache"] else 0  # none when stopped before prefill
    assert len(saved["ledger"]) == cached


def run_tui_and_quit(
    home: str,
    wait_s: float,
    message: str = "hello",
    end: bytes | signal.Signals = b"\x11",
    sent: bool = False,
) -> tuple[int, bytes]:
    """``kvchat --model demo`` on a real pseudo-terminal: send a message, wait, then quit
    with ``end``: keys (Ctrl+Q), or a signal (SIGHUP: then the terminal closes too). With
    ``sent``, the wait starts once the app has taken the message (its draft, written
    before the prefill, or the saved session is on disk), not once its keys are written:
    on a busy machine the keys may still be unread ``wait_s`` later."""
    env = {
        **os.environ,
        "KVCHAT_HOME": home,
        "KVCHAT_CONFIG_DIR": home + "-config",
        "TERM": "xterm-256color",
        "COLUMNS": "100",
        "LINES": "30",
    }
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kvchat.cli import main; main()",
            "--model",
            "demo",
            "--max-tokens",
            "64",
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    out = bytearray()

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    out.extend(os.read(master, 65536))
                except OSError:
                    return

    def wait_for(text: bytes, seconds: float) -> None:
        end = time.monotonic() + seconds
        while text not in out and time.monotonic() < end:
            read_for(0.1)

    wait_for(b"Message", 60)  # the input's placeholder: the app is up
    os.write(master, message.encode() + b"\r")
    taken = (Path(home) / "drafts" / "chat-1.txt", Path(home) / "sessions" / "chat-1")
    deadline = time.monotonic() + 30
    while sent and not any(p.exists() for p in taken) and time.monotonic() < deadline:
        read_for(0.01)
    read_for(wait_s)
    if end == signal.SIGHUP:  # the terminal goes: nothing more is read from it
        proc.send_signal(end)
        os.close(master)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    else:
        if isinstance(end, bytes):
            os.write(master, end)
        else:
            proc.send_signal(end)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            read_for(0.1)
        os.close(master)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(), bytes(out)


def test_quit_always_exits_cleanly_in_a_real_terminal(tmp_path):
    """About one quit in five used to abort at interpreter shutdown (exit 134)."""
    for i, wait_s in enumerate([0.0, 0.3, 1.0, 2.5]):
        code, out = run_tui_and_quit(str(tmp_path / f"home{i}"), wait_s)
        assert b"terminate called" not in out, out[-400:]
        assert code == 0, (wait_s, out[-2000:].decode(errors="replace"))


async def test_the_footer_is_rebuilt_when_its_keys_change_not_for_figures(make_app):
    """The sidebar's figures, redrawn a few times a second while a reply streams, do not
    rebuild the footer's keys (a third of the UI thread's work while a reply streamed); the
    reply's end, which changes what the keys offer (the tab is no longer busy), does."""
    app = make_app(max_tokens=48)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        footer = app.screen.query_one(Footer)
        conversation = app.active_conversation()
        first, go_on = gate_after_first_chunk(conversation.session)
        assert await conversation.turns.send("Hello there.")
        await until(pilot, first.is_set)
        await until(pilot, lambda: conversation.busy and bool(shown_text(conversation)))
        await pilot.pause()
        keys = list(footer.children)
        for _ in range(5):  # as the streaming reply does a few times a second
            conversation.report_changed()
            await pilot.pause()
        assert keys and list(footer.children) == keys  # the same widgets: not recomposed
        go_on.set()
        await settle(pilot, conversation)
        await until(pilot, lambda: list(footer.children) != keys)
        assert "^s Save" in widget_text(footer)


def test_streamed_words_reach_the_ui_in_batches_and_none_is_lost():
    """Words that come faster than CHUNK_S apart go to the UI thread together (one message
    for several tokens), a word after a pause goes at once, and the last wait is sent at
    the end: the messages' texts make the reply, their counts the tokens so far."""
    from kvchat.tui.tab.events import ReplyChunk
    from kvchat.tui.tab.turns import CHUNK_S, Words

    sent: list[ReplyChunk] = []
    words = Words(sent.append)
    for i in range(1, 41):  # 40 tokens at once: the first goes, the rest wait
        words.add(f"w{i} ", i)
    assert [(m.text, m.tokens) for m in sent] == [("w1 ", 1)]
    time.sleep(CHUNK_S * 1.5)
    words.add("after ", 41)  # after a pause: at once, with what waited
    assert len(sent) == 2 and sent[1].tokens == 41 and sent[1].text.endswith("w40 after ")
    words.add("last", 42)
    words.flush()
    assert "".join(m.text for m in sent) == "".join(f"w{i} " for i in range(1, 41)) + "after last"
    assert [m.tokens for m in sent] == [1, 41, 42]
    words.flush()  # nothing waits: nothing sent
    assert len(sent) == 3


def test_a_reply_is_drawn_less_often_as_drawing_costs_more():
    """The wait before a streamed reply's next batch follows the UI thread's CPU since the
    last one (over DRAW_SHARE): FLUSH_S when drawing costs nothing, about 40 ms / DRAW_SHARE
    after 40 ms of it, FLUSH_MAX_S at most; CPU spent on another thread does not count."""

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    pace = Pace()
    pace.batch()
    assert pace.wait == FLUSH_S
    burn(0.04)
    pace.batch()
    assert 0.04 / DRAW_SHARE <= pace.wait < 0.06 / DRAW_SHARE < FLUSH_MAX_S
    other = threading.Thread(target=burn, args=(0.2,))
    other.start()
    other.join()
    pace.batch()
    assert pace.wait == FLUSH_S
    burn(FLUSH_MAX_S * DRAW_SHARE * 2)
    pace.batch()
    assert pace.wait == FLUSH_MAX_S
