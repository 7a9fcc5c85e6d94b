"""A reasoning model's reply: its <think> blocks fold into a collapsed "Thought" above the
answer (streamed too), a click or `t` on the selected reply toggles it, and the panel
says when the template dropped the last reply's thoughts."""

from __future__ import annotations

import pytest
from textual.widgets import Footer, Static

from kvchat.config import Config
from kvchat.engine.conversation.session import TurnDone
from kvchat.tui.app import KvChatApp
from kvchat.tui.tab.events import ReplyChunk, TurnFinished
from kvchat.tui.widgets.messages import AssistantMessage

from .conftest import SIZE, screen_text, send, settle, until, widget_text
from .test_safety import _stats

pytestmark = pytest.mark.anyio

THOUGHT = "The user asks for [bold]the answer[/]. Six times seven, then."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\nThe answer is **42**."


def thought_text(message: AssistantMessage) -> str:
    return str(message.thoughts.query_one(".thought-text", Static).render())


async def stream(pilot, pieces: list[str]) -> AssistantMessage:
    conversation = pilot.app.active_conversation()
    conversation.state = "answering"
    for n, piece in enumerate(pieces, 1):  # a piece a token
        conversation.post_message(ReplyChunk(piece, n))
    await until(
        pilot,
        lambda: (
            conversation.query(AssistantMessage)
            and conversation.query_one(AssistantMessage).text == "".join(pieces)
        ),
    )
    message = conversation.query_one(AssistantMessage)
    await until(pilot, lambda: thought_text(message) or message.markdown.source)  # a flush
    await pilot.pause()
    return message


async def test_thoughts_stream_into_a_collapsed_block_and_toggle(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        message = await stream(pilot, ["<thi", "nk>\nThe user asks", " for [bold]the"])
        assert message.has_thoughts() and message.thoughts.display
        assert message.thoughts.collapsed
        assert message.thoughts.title == "Thinking… (5 words)"
        assert thought_text(message) == "The user asks for [bold]the"
        assert message.markdown.source == ""

        rest = REPLY[len("<think>\nThe user asks for [bold]the") :]
        for n, piece in enumerate((rest[:30], rest[30:]), 100):
            conversation.post_message(ReplyChunk(piece, n))
        conversation.post_message(TurnFinished(TurnDone(REPLY, _stats(), stopped=False), None))
        await settle(pilot, conversation)
        assert message.text == REPLY  # copy and the transcript keep the whole reply
        assert message.markdown.source == "The answer is **42**."
        assert thought_text(message) == THOUGHT  # literally: no markup
        assert message.thoughts.title == "Thought (10 words)" and message.thoughts.collapsed
        shown = widget_text(message)
        assert "▶ Thought (10 words)" in shown and "The answer is 42" in shown
        assert "Six times" not in shown

        await pilot.press("ctrl+up")  # select the reply: `t` is offered and toggles
        await pilot.pause()
        assert app.focused is message
        assert "t Thoughts" in widget_text(app.screen.query_one(Footer))
        await pilot.press("t")
        await pilot.pause()
        assert not message.thoughts.collapsed
        assert "▼ Thought" in widget_text(message)
        assert "[bold]the answer[/]. Six times seven, then." in screen_text(app)
        await pilot.press("t")
        await pilot.pause()
        assert message.thoughts.collapsed and "Six times" not in widget_text(message)

        await pilot.click(message.thoughts.query_one("CollapsibleTitle"))
        await pilot.pause()
        assert not message.thoughts.collapsed


async def test_a_reply_without_thoughts_has_no_block_and_no_key(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await send(pilot, "hello")
        message = app.active_conversation().query_one(AssistantMessage)
        assert not message.thoughts.display and not message.has_thoughts()
        assert message.markdown.source == message.text
        await pilot.press("ctrl+up")
        await pilot.pause()
        assert app.focused is message
        footer = widget_text(app.screen.query_one(Footer))
        assert "Copy" in footer and "Thoughts" not in footer
        await pilot.press("t")
        await pilot.pause()
        assert not message.thoughts.display


async def test_a_dropping_template_is_noted_in_the_panel(dropping_model, home):
    app = KvChatApp(
        Config(model="demo", max_tokens=6, autosave=False), lm=dropping_model, volatile=False
    )
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        session.replace_history(
            [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": REPLY}]
        )
        session.rebuild("test")  # the cache holds the reply, thoughts and all
        await conversation.reload()
        reply = conversation.query_one(AssistantMessage)
        assert reply.thoughts.collapsed and reply.markdown.source == "The answer is **42**."

        await send(pilot, "And how are you?")
        stats = session.last_stats
        assert stats.reevaluated_reply_tokens > 0
        panel = " ".join(widget_text(app.sidebar).replace("│", " ").split())
        assert (
            f"The template drops earlier thoughts, so {stats.reevaluated_reply_tokens} "
            "tokens of the last reply were evaluated again."
        ) in panel

        await send(pilot, "Fine.")  # the reply just made has no thoughts
        assert "drops earlier thoughts" not in widget_text(app.sidebar)
