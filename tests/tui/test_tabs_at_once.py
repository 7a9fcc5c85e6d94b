"""Two tabs on one model reply at the same time, each streaming, each with its own figures."""

from __future__ import annotations

import pytest
from textual.widgets import Markdown

from kvchat.engine.caches.kinds import held_tokens
from kvchat.tui.widgets.messages import AssistantMessage
from kvchat.tui.widgets.sidebar import CacheInfo

from .conftest import SIZE, settle, until

pytestmark = pytest.mark.anyio


def _reply_text(conversation) -> str:
    """The Markdown source of the last reply on screen ('' until it is mounted and composed)."""
    replies = conversation.log.query(AssistantMessage)
    markdown = replies.last().query(Markdown) if replies else []
    return markdown.first().source if markdown else ""


async def test_a_second_tab_streams_while_the_first_is_still_answering(make_app):
    app = make_app(max_tokens=4000)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        first = app.active_conversation()
        first.session.settings.ignore_eos = True  # the demo's replies are over in a blink
        assert await first.turns.send("Talk for a long time.")
        await until(pilot, lambda: bool(_reply_text(first)), timeout=60)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: app.active_conversation() is not first, timeout=30)
        second = app.active_conversation()
        await until(pilot, lambda: second.state == "idle", timeout=30)
        second.session.settings.ignore_eos = True
        assert await second.turns.send("Tell me about the sea.")
        await until(pilot, lambda: bool(_reply_text(second)), timeout=60)
        # the first is still answering, and its reply still grows beside the second's
        assert first.state == "answering" and second.state == "answering"
        before = len(_reply_text(first))
        await until(pilot, lambda: len(_reply_text(first)) > before, timeout=60)
        # each panel shows its own session, from the snapshot its worker took
        one, two = CacheInfo.of(first), CacheInfo.of(second)
        assert (one.name, two.name) == (first.session_name, second.session_name)
        assert one.turns == 1 and two.turns == 1 and one.cache_tokens == two.cache_tokens == 0
        first.turns.stop()
        second.turns.stop()
        await settle(pilot)
        for conversation in (first, second):
            session = conversation.session
            last = session.messages[-1]
            assert last["role"] == "assistant" and last.get("stopped") and last["content"]
            assert held_tokens(session.cache) == len(session.ledger) > 0
        assert max(first.session.last_stats.batch_size, second.session.last_stats.batch_size) == 2
