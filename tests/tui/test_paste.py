"""A bracketed paste holding escape characters arrives whole, in place, and shown literally."""

from __future__ import annotations

import pytest
from textual import events

from kvchat.tui.app import KvChatApp
from kvchat.tui.textual_compat import PasteParser, PasteSafeDriver, paste_safe
from kvchat.tui.widgets.chat_input import ChatInput

from .conftest import SIZE, settle

pytestmark = pytest.mark.anyio

PASTED = "A\x1b[31mB\x1b[0mC D"
SHOWN = "A\\x1b[31mB\\x1b[0mC D"


def _tokens(raw: str) -> list:
    parser = PasteParser()
    return [*parser.feed(raw), *parser.feed("")]


def test_the_parser_keeps_a_paste_whole_and_in_order():
    tokens = _tokens(f"x\x1b[200~{PASTED}\x1b[201~y\x1b[200~plain\x1b[201~")
    described = [(type(t).__name__, getattr(t, "text", None) or t.key) for t in tokens]
    assert described == [("Key", "x"), ("Paste", PASTED), ("Key", "y"), ("Paste", "plain")]


def test_a_paste_cut_short_keeps_what_came():
    tokens = _tokens(f"\x1b[200~{PASTED}")
    assert [t.text for t in tokens if isinstance(t, events.Paste)] == [PASTED]


def test_the_app_reads_the_terminal_through_the_paste_parser():
    from textual.drivers.linux_driver import LinuxDriver

    assert paste_safe(LinuxDriver) is PasteSafeDriver
    assert KvChatApp().driver_class is PasteSafeDriver


async def test_pasted_escape_codes_reach_the_session_in_place(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        # what the terminal sends: typed x, the bracketed paste, typed y
        for token in _tokens(f"x\x1b[200~{PASTED}\x1b[201~y"):
            app.post_message(token)
        await pilot.pause()
        assert conversation.input.text == f"x{SHOWN}y"
        assert "\x1b" not in conversation.query_one(ChatInput).document.text

        conversation.input.post_message(events.Paste("\r\nline two\rthree"))
        await pilot.pause()
        assert conversation.input.text == f"x{SHOWN}y\nline two\nthree"
        await pilot.press("enter")
        await settle(pilot, conversation)
        user = [m for m in conversation.session.messages if m["role"] == "user"][-1]
        assert user["content"] == f"x{SHOWN}y\nline two\nthree"
