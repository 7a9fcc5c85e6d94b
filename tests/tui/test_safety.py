"""Model output with markup, ANSI or OSC sequences shows literally and triggers nothing."""

from __future__ import annotations

import pytest

from kvchat.engine.conversation.session import TurnDone
from kvchat.engine.conversation.stats import TurnStats
from kvchat.tui.tab.events import ReplyChunk, TurnFinished
from kvchat.tui.textual_compat import notifications
from kvchat.tui.widgets.messages import AssistantMessage

from .conftest import SIZE, settle

pytestmark = pytest.mark.anyio

EVIL = (
    "[@click=app.quit]boom[/] [bold red]red[/] [link=http://x]l[/link] "
    "\x1b[31mansi \x1b]8;;http://x\x07osc\x1b]8;;\x07 \x1b]0;title\x07 bell\x07 cr\r!"
)


def _stats() -> TurnStats:
    return TurnStats(1, 0, 1, 0.0, 0.0, 1, 0.0, 1, 0, "standard", 0, 0)


async def _reply(pilot, text: str, pieces: int = 7) -> AssistantMessage:
    conversation = pilot.app.active_conversation()
    conversation.state = "answering"
    step = max(1, len(text) // pieces)
    for n, i in enumerate(range(0, len(text), step), 1):  # a piece a token
        conversation.post_message(ReplyChunk(text[i : i + step], n))
    conversation.post_message(TurnFinished(TurnDone(text, _stats(), stopped=False), None))
    await settle(pilot, conversation)
    return conversation.query(AssistantMessage).last()


async def test_injection_shows_literally_and_does_nothing(make_app, monkeypatch):
    app = make_app()
    opened, quits = [], []
    monkeypatch.setattr(app, "open_url", lambda url, **kw: opened.append(url))
    monkeypatch.setattr(app, "action_quit", lambda: quits.append(True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        message = await _reply(pilot, EVIL)
        assert "\x1b" not in message.text and "\x07" not in message.text
        assert "\r" not in message.text
        for literal in (
            "[@click=app.quit]boom[/]",
            "[bold red]red[/]",
            "[link=http://x]l[/link]",
            "\\x1b[31mansi",
            "\\x1b]8;;http://x\\x07osc",
            "\\x1b]0;title\\x07",
        ):
            assert literal in message.text
        screen = app.export_screenshot()
        assert "\x1b" not in screen and "\x07" not in screen
        assert "[@click=app.quit]boom[/]" in screen.replace("&#160;", " ")
        assert "\\x1b[31mansi" in screen
        await pilot.click(message, offset=(3, 1))  # on the "[@click=…]" text
        await pilot.pause()

        link = await _reply(pilot, "[boom](app.quit) and <http://example.com>")
        await pilot.click(link, offset=(3, 1))  # on the link text "boom"
        await pilot.pause()
        assert app.is_running and not quits and not opened
        assert any("Link (not opened): app.quit" in n.message for n in notifications(app))
