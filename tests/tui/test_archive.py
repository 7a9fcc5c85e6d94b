"""The archive dialog (Shift+F5, or "Archive" in the palette): the exchanges undo and trim
dropped, the last archived first; Enter brings the highlighted one back to the end of the
conversation, Escape changes nothing, and an empty archive says so."""

from __future__ import annotations

import pytest
from rich.text import Text
from textual.widgets import OptionList

from kvchat.tui.screens.archive import ArchiveDialog, exchange_label
from kvchat.tui.textual_compat import notifications, screen_text

from .conftest import SIZE, palette_pick, send, settle, until, widget_text
from .test_dialog_focus import two_turns_then_ctrl_l, users
from .test_sidebar import flat, row

pytestmark = pytest.mark.anyio

KEPT, UNDONE = "Where is the lighthouse?", "What does the keeper eat?"


async def talk_then_undo(pilot):
    """Two turns in the active tab, the second undone with Ctrl+L, Enter: its conversation."""
    app = pilot.app
    conversation = await two_turns_then_ctrl_l(pilot, (KEPT, UNDONE))
    await pilot.press("enter")
    await settle(pilot, conversation)
    assert users(conversation.session.archived) == [UNDONE]
    assert UNDONE not in screen_text(app)
    assert row(widget_text(app.sidebar), "turns") == "1"
    return conversation


async def test_enter_brings_the_undone_exchange_back(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await talk_then_undo(pilot)
        session = conversation.session
        reply = session.archived[1]["content"]
        await pilot.press("shift+f5")
        await until(pilot, lambda: isinstance(app.screen, ArchiveDialog))
        assert app.focused is not None and app.focused.id == "archive-options"
        assert UNDONE in screen_text(app)  # the list shows it
        await pilot.press("enter")
        await settle(pilot, conversation)
        assert not isinstance(app.screen, ArchiveDialog)
        assert users(session.messages) == [KEPT, UNDONE] and session.archived == []
        assert session.messages[-1] == {"role": "assistant", "content": reply}
        await until(pilot, lambda: UNDONE in screen_text(app))  # the transcript shows it
        # the sidebar's figures follow, as after an undo
        await until(pilot, lambda: row(widget_text(app.sidebar), "turns") == "2")
        assert "last change restore" in flat(widget_text(app.sidebar))
        # the next turn sees it
        await send(pilot, "And the lamp?")
        assert users(session.messages) == [KEPT, UNDONE, "And the lamp?"]


async def test_escape_leaves_everything_as_it_was(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conversation = await talk_then_undo(pilot)
        session = conversation.session
        before = (session.messages, session.archived, session.ledger)
        assert (await palette_pick(pilot, "Archive")).startswith("Archive…\nSee the exchanges")
        await until(pilot, lambda: isinstance(app.screen, ArchiveDialog))
        await pilot.press("escape")
        await settle(pilot, conversation)
        assert len(app.screen_stack) == 1
        assert (session.messages, session.archived, session.ledger) == before
        assert UNDONE not in screen_text(app)


async def test_an_empty_archive_says_so_instead_of_opening(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await send(pilot, KEPT)
        await pilot.press("shift+f5")
        await until(pilot, lambda: notifications(app))
        assert len(app.screen_stack) == 1
        assert [n.message for n in notifications(app)] == [
            "Nothing archived yet: undo and trim keep here what they drop."
        ]


async def test_the_list_shows_model_text_as_text_last_archived_first(make_app):
    """Markup and escapes in a message stay letters; the last archived is highlighted."""
    label = exchange_label(
        [{"role": "user", "content": "\n[bold]hi[/bold]\x1b[31m"}, {"role": "assistant"}]
    )
    assert isinstance(label, Text) and label.plain == "[bold]hi[/bold]\\x1b[31m\n  ↳ (no reply)"
    label = exchange_label(
        [
            {"role": "user", "content": "q"},
            *[{"role": "assistant", "content": c} for c in ("A1", "A2")],
        ]
    )
    assert label.plain == "q\n  ↳ A2 (+1 more)"  # the version a restore shows
    older = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "A"}]
    newer = [{"role": "user", "content": "new"}, {"role": "assistant", "content": "B"}]
    chosen: list[int | None] = []
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        app.push_screen(ArchiveDialog([older, newer]), chosen.append)
        await until(pilot, lambda: isinstance(app.focused, OptionList))
        options = app.screen.query_one(OptionList)
        assert options.highlighted == 0 and str(options.get_option_at_index(0).prompt).startswith(
            "new"
        )
        await pilot.press("down", "enter")  # the older one
        await until(pilot, lambda: chosen == [0])
