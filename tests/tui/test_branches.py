"""Edit an earlier message and branch, switch branches by key and by click, save and
resume them; copy a message or a code block, delete an exchange, regenerate any reply.
All on the demo model with its real cache."""

from __future__ import annotations

import base64
import json
import re

import pytest
from textual.widgets import TextArea

from kvchat import locations
from kvchat.engine.conversation.branches import Branches
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.store.base import SESSION_FILE, session_dir
from kvchat.tui.screens.message_dialogs import DeletePairDialog, EditDialog
from kvchat.tui.textual_compat import driver, notifications
from kvchat.tui.widgets.messages import AssistantMessage, BranchBar, UserMessage

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio


def user_texts(conversation) -> list[str]:
    return [w.text for w in conversation.log.query(UserMessage)]


def bars(conversation) -> dict[int, str]:
    return {b.index: str(b.render()) for b in conversation.log.query(BranchBar)}


def notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


def sidebar_figure(app, label: str) -> int:
    match = re.search(rf"{label}\s+([\d,]+)", widget_text(app.sidebar))
    return int(match.group(1).replace(",", ""))


async def select(pilot, conversation, index: int) -> None:
    """Ctrl+Up from the message box, then Up until the message at ``index`` is selected."""
    conversation.focus_input()
    await pilot.press("ctrl+up")
    while pilot.app.focused.index != index:
        await pilot.press("up")
    assert pilot.app.focused.index == index


async def edit(pilot, conversation, index: int, text: str) -> None:
    await select(pilot, conversation, index)
    await pilot.press("enter")
    await until(pilot, lambda: isinstance(pilot.app.screen, EditDialog))
    pilot.app.screen.query_one("#edit-text", TextArea).text = text
    await pilot.press("ctrl+s")
    await settle(pilot, conversation)


async def three_turns(pilot):
    await settle(pilot)
    conversation = pilot.app.active_conversation()
    for text in ("first question", "second question", "third question"):
        await send(pilot, text)
    return conversation


async def test_edit_branch_switch_save_and_resume(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await three_turns(pilot)
        session = conversation.session
        old = list(session.messages)
        ledger = list(session.ledger)

        await edit(pilot, conversation, 2, "second, edited")
        edited = list(session.messages)
        assert user_texts(conversation) == ["first question", "second, edited"]
        assert len(edited) == 4 and bars(conversation) == {2: "‹ 2/2 ›"}
        prompt = session.render(edited[:3], True)
        after_edit_point = len(prompt) - common_prefix(ledger, prompt)
        assert session.last_stats.evaluated_tokens == after_edit_point
        assert sidebar_figure(app, "evaluated") == after_edit_point

        await pilot.click(BranchBar, offset=(0, 0))  # ‹
        await settle(pilot, conversation)
        assert session.messages == old
        assert user_texts(conversation) == ["first question", "second question", "third question"]
        tokens = session.render(old, False)
        reused = common_prefix(tokens, session.render(edited, False))
        assert session.ledger == tokens
        assert (
            f"kept {reused:,} cached tokens, evaluated {len(tokens) - reused:,}."
            in notices(app)[-1]
        )
        assert bars(conversation) == {2: "‹ 1/2 ›"}
        assert app.focused.index == 2

        await pilot.press("right")  # the same, by key
        await settle(pilot, conversation)
        assert session.messages == edited and bars(conversation) == {2: "‹ 2/2 ›"}

        await pilot.press("ctrl+s")
        await settle(pilot, conversation)
        name = conversation.session_name
    data = json.loads((session_dir(name) / SESSION_FILE).read_text())
    assert data["messages"] == edited
    contents = [n["content"] for n in data["branches"]["nodes"]]
    assert contents[:6] == [m["content"] for m in old] and contents[6] == "second, edited"

    app = make_app(resume=name)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        assert session.messages == edited and len(session.ledger) > 0  # its cache, from disk
        assert user_texts(conversation) == ["first question", "second, edited"]
        held = session.render(edited, False)
        await select(pilot, conversation, 2)
        await pilot.press("left")
        await settle(pilot, conversation)
        assert session.messages == old
        tokens = session.render(old, False)
        reused = common_prefix(held, tokens)
        assert reused > 0 and session.ledger == tokens
        assert f"evaluated {len(tokens) - reused:,}." in notices(app)[-1]


async def test_copy_a_message_and_a_code_block(make_app, monkeypatch):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        written: list[str] = []
        monkeypatch.setattr(driver(app), "write", written.append)
        text = "Two blocks:\n\n```py\nprint('one')\n```\n\n```\nx = 2\n```\n"
        await send(pilot, text)
        await pilot.click(UserMessage)  # the mouse selects a message too
        assert app.focused is conversation.log.query_one(UserMessage)
        await pilot.press("c")
        osc = f"\x1b]52;c;{base64.b64encode(text.encode()).decode()}\a"
        assert osc in written
        clip = locations.data_dir() / "clipboard.txt"
        assert clip.read_text() == text
        await pilot.press("y")
        assert app.clipboard == "print('one')\n" and clip.read_text() == "print('one')\n"
        await pilot.press("y")
        assert app.clipboard == "x = 2\n"
        assert notices(app)[-1].startswith("Copied code block 2 of 2 (6 characters)")
        await pilot.press("down", "y")  # the reply has no code block
        assert notices(app)[-1] == "No code block in this message."


async def test_delete_a_pair_and_regenerate_an_earlier_reply(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await three_turns(pilot)
        session = conversation.session
        old = list(session.messages)
        ledger = list(session.ledger)

        await select(pilot, conversation, 3)  # a reply: its exchange goes
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, DeletePairDialog))
        await pilot.click("#delete-yes")
        await settle(pilot, conversation)
        assert session.messages == old[:2] + old[4:]
        assert user_texts(conversation) == ["first question", "third question"]
        tokens = session.render(session.messages, False)
        reused = common_prefix(ledger, tokens)
        assert session.ledger == tokens and len(session.turns) == 2
        assert (
            f"kept {reused:,} cached tokens, evaluated {len(tokens) - reused:,}."
            in notices(app)[-1]
        )

        session.settings.max_tokens = 3  # so the new version differs from the old
        await select(pilot, conversation, 1)
        await pilot.press("r")
        await settle(pilot, conversation)
        assert session.messages[:1] == old[:1] and len(session.messages) == 2
        assert session.last_stats.generated_tokens == 3
        replies = [w.text for w in conversation.log.query(AssistantMessage)]
        assert replies == [session.messages[1]["content"]]
        assert bars(conversation) == {1: "‹ 2/2 ›"}
        assert session.last_stats.evaluated_tokens <= 1  # the prompt was in the cache


async def test_an_empty_edit_changes_nothing(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "only question")
        old = list(conversation.session.messages)
        await edit(pilot, conversation, 0, "   ")
        assert conversation.session.messages == old
        assert user_texts(conversation) == ["only question"]
        assert notices(app)[-1] == "An edited message cannot be empty; it was left as it was."


async def test_after_an_edit_what_is_typed_goes_to_the_message_box(make_app):
    """The edited message's widget is gone once the turn starts: the keys typed next (here
    'r' and 'd', a selected message's regenerate and delete) are text, not actions."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await three_turns(pilot)
        await edit(pilot, conversation, 2, "second question, edited")
        assert app.focused is conversation.input
        await pilot.press(*"third", "enter")
        await settle(pilot, conversation)
        talk = [m["content"] for m in conversation.session.messages if m["role"] == "user"]
        assert talk == ["first question", "second question, edited", "third"]


async def test_an_edit_draws_again_only_from_the_edit_point(make_app, monkeypatch):
    """The messages before the edited one stay as they were drawn; the branch places are
    computed once for the whole transcript, not once per message."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await three_turns(pilot)
        before = conversation.selectable()[:2]
        passes = []
        real = Branches.positions

        def counted(tree):
            passes.append(len(tree.path))
            return real(tree)

        monkeypatch.setattr(Branches, "positions", counted)
        await edit(pilot, conversation, 2, "second, edited")
        assert conversation.selectable()[:2] == before  # the same widgets, not drawn again
        assert [w.text for w in before] == [
            "first question",
            conversation.session.messages[1]["content"],
        ]
        assert user_texts(conversation) == ["first question", "second, edited"]
        assert bars(conversation) == {2: "‹ 2/2 ›"}
        assert passes == [4]  # one pass over the four messages
