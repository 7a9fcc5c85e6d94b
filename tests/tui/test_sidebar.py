"""The cache panel's figures as shown on screen: turns and the last turn after undo, the
rebuild note (cleared, never stacked), memory labelled as the process's, and the buttons
(which stay put and leave the focus in the message box)."""

from __future__ import annotations

import threading

import pytest

from kvchat import store
from kvchat.engine.conversation.session import Prefill
from kvchat.tui.screens.confirm import ConfirmDialog
from kvchat.tui.widgets.messages import AssistantMessage
from kvchat.units import human_bytes

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio


def flat(text: str) -> str:
    """Drawn text without the panel's border, its words joined by single spaces."""
    return " ".join(" ".join(line.strip(" │╭╮╰╯─").split()) for line in text.splitlines())


def row(text: str, label: str) -> str | None:
    """The value beside ``label`` in the sidebar's drawn text."""
    for line in text.splitlines():
        cells = line.strip(" │╭╮╰╯─")
        if cells.startswith(label + " ") or cells == label:
            return cells[len(label) :].strip()
    return None


async def test_undo_takes_its_turn_off_the_panel_and_every_view_counts_turns_alike(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        for text in ("one", "two", "three"):
            await send(pilot, text)
        assert row(widget_text(app.sidebar), "turns") == "3"

        await pilot.press("ctrl+l")
        await pilot.pause()
        assert "over 3 turn(s)" in widget_text(app.screen.query_one("#trim-dialog"))
        await pilot.click("#trim-undo")
        await settle(pilot, conversation)
        panel = widget_text(app.sidebar)
        assert row(panel, "turns") == "2"
        # the undo is the cache's last event: no turn's figures (they describe another cache)
        assert row(panel, "last change") == "undo"
        assert row(panel, "evaluated") == "0"
        assert row(panel, "reused") == "—" and row(panel, "generated") == "—"
        assert row(panel, "tokens") == f"{session.cache_tokens:,}"

        await pilot.press("ctrl+s")
        await settle(pilot)
        assert store.summary(conversation.session_name).turns == 2  # the picker's figure
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert "over 2 turn(s)" in widget_text(app.screen.query_one("#trim-dialog"))
        await pilot.press("escape")

        for last in (False, True):
            await pilot.press("ctrl+l")
            await pilot.pause()
            await pilot.click("#trim-undo")
            if last:  # undoing the only turn asks first
                await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
                await pilot.click("#confirm-yes")
            await settle(pilot, conversation)
        panel = widget_text(app.sidebar)
        assert row(panel, "turns") == "0" and row(panel, "last change") == "undo"
        assert row(panel, "reused") == "—"
        # mlx's memory figures are labelled as the whole process's
        assert "mlx, whole process" in panel and row(panel, "memory") == "–"  # snapshot mode


async def test_after_a_trim_and_an_undo_the_panel_shows_the_cache_as_it_is(make_app):
    app = make_app(max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        for text in ("one more message", "two more messages here", "three", "four"):
            await send(pilot, text)
        before = session.last_stats
        await pilot.press("ctrl+l")
        await pilot.pause()
        app.screen.query_one("#trim-tokens").value = str(session.cache_tokens // 2)
        await pilot.click("#trim-to")
        await settle(pilot, conversation)
        panel = widget_text(app.sidebar)
        assert row(panel, "last change") == "trim"
        assert row(panel, "evaluated") == f"{session.last_change.evaluated_tokens:,}"
        assert session.last_change.evaluated_tokens > 0  # the kept turns, evaluated again

        only = sum(m["role"] == "user" for m in session.messages) == 1
        await pilot.press("ctrl+l")
        await pilot.pause()
        await pilot.click("#trim-undo")
        if only:  # the trim kept one turn: undoing it asks first
            await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await pilot.click("#confirm-yes")
        await settle(pilot, conversation)
        panel = widget_text(app.sidebar)
        assert session.cache_tokens < before.cache_tokens
        assert row(panel, "tokens") == f"{session.cache_tokens:,}"
        assert row(panel, "last change") == "undo" and row(panel, "evaluated") == "0"
        assert row(panel, "reused") == "—"  # not the pre-trim turn's "reused X of Y"

        await send(pilot, "five")  # a turn: its own figures again
        panel = widget_text(app.sidebar)
        last = session.last_stats
        assert row(panel, "last change") is None
        assert row(panel, "reused") == f"{last.reused_tokens:,} of {last.prompt_tokens:,}"


async def test_a_rebuild_note_goes_with_its_turn_and_never_stacks(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "hello")
        save_button = app.sidebar.query_one("#btn-save").region

        await pilot.click("#btn-reset")
        await settle(pilot, conversation)
        assert app.focused is conversation.input  # the click left the focus in the box
        assert session.cache_tokens == 0
        assert "The next turn rebuilds the cache: the cache was reset." in flat(
            widget_text(app.sidebar)
        )
        assert app.sidebar.query_one("#btn-save").region == save_button  # no jump

        await send(pilot, "again")
        assert session.last_stats.rebuilt == "the cache was reset"
        notes = [str(n.render()) for n in conversation.log.query(".note")]
        assert notes == ["The cache was rebuilt for this turn: the cache was reset."]
        assert "Last turn rebuilt: the cache was reset." in flat(widget_text(app.sidebar))

        for _ in range(2):  # regenerate twice: the note left with the reply it belonged to
            await pilot.press("f5")
            await settle(pilot, conversation)
            assert session.last_stats.rebuilt is None
            assert not conversation.log.query(".note")
            assert "rebuil" not in widget_text(app.sidebar)
        replies = conversation.log.query(AssistantMessage)
        assert [r.text for r in replies] == [
            m["content"] for m in session.messages if m["role"] == "assistant"
        ]


async def test_a_notice_after_a_rebuild_shows_on_the_reloaded_transcript(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "one")
        await pilot.press("ctrl+r")
        await settle(pilot, conversation)
        await send(pilot, "two")
        await send(pilot, "three")
        await conversation.reload()  # as after an undo or a trim
        replies = list(conversation.log.query(AssistantMessage))
        noted = [bool(r.query(".note")) for r in replies]
        assert noted == [False, True, False]


async def test_checkpoint_memory_is_shown_and_counted(arch, home):
    from kvchat.config import Config
    from kvchat.tui.app import KvChatApp

    lm = arch("gemma3_text")  # a sliding-window layer: checkpoints are kept
    app = KvChatApp(Config(model=str(lm.path), max_tokens=4, autosave=False), lm=lm, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        session = app.active_conversation().session
        await send(pilot, "The quick brown fox jumps over the lazy dog near the river bank today.")
        points = session.checkpoints
        assert len(points) == 2
        shown = f"2 · {human_bytes(points.nbytes)}"
        await until(pilot, lambda: row(widget_text(app.sidebar), "checkpoints") == shown)
        entry = app.pool.entry(app.active_conversation().session_name)
        assert entry.cache_bytes == session.allocated_bytes + points.nbytes


async def test_while_a_reply_is_written_the_panel_shows_that_turn_not_the_last(make_app, endless):
    app = make_app(max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "first")
        first = session.last_stats
        panel = widget_text(app.sidebar)
        assert row(panel, "generated") == "6" and row(panel, "last turn") == ""

        session.settings.max_tokens = 3000  # endless: it answers until stopped (or 3,000)
        assert await conversation.turns.send("second")

        def answering() -> bool:  # past the prompt's evaluation ("evaluated 0 of 15" before)
            panel = widget_text(app.sidebar)
            return "this turn answering…" in flat(panel) and " of " not in (
                row(panel, "evaluated") or " of "
            )

        await until(
            pilot, lambda: conversation.query(AssistantMessage).last().index > 1 and answering()
        )
        panel = widget_text(app.sidebar)
        assert "this turn answering…" in flat(panel) and row(panel, "last turn") is None
        for label in ("reused", "TTFT"):
            assert row(panel, label) is None, label  # none of the first turn's figures
        shown = row(panel, "evaluated")

        def generated() -> int:  # this reply's tokens so far, as the panel shows them live
            return int((row(widget_text(app.sidebar), "generated") or "0").replace(",", ""))

        await until(pilot, lambda: generated() >= 8)  # past the first turn's 6: its own
        seen = generated()
        await until(pilot, lambda: generated() > seen)  # growing as it streams
        assert row(widget_text(app.sidebar), "gen speed").endswith(" tok/s")
        status = widget_text(conversation.query_one(".status")).strip()
        assert status.startswith("Answering: ") and " tokens/s… Esc stops" in status
        await pilot.press("escape")
        await settle(pilot, conversation)
        second = session.last_stats
        assert second is not first and shown == f"{second.evaluated_tokens:,}"
        panel = widget_text(app.sidebar)
        assert row(panel, "last turn") == "" and row(panel, "evaluated") == shown
        assert row(panel, "generated") == f"{second.generated_tokens:,} (stopped)"


async def test_a_turn_stopped_in_its_prefill_shows_no_time_to_first_token(make_app):
    app = make_app(volatile=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "first")
        assert row(widget_text(app.sidebar), "TTFT").endswith(" ms")  # a turn that answered

        started, go_on = threading.Event(), threading.Event()
        real_send = session.send

        def send_paused(text):  # the real turn, held at the start of its prefill
            events = real_send(text)

            def held():
                for event in events:
                    yield event
                    if isinstance(event, Prefill) and not started.is_set():
                        started.set()
                        go_on.wait(20)

            return held()

        session.send = send_paused
        session.settings.prefill_step = 4
        # long enough that its prefill (4 tokens a step, on the core's thread) is still
        # running when the Escape lands
        assert await conversation.turns.send(" ".join(["a message of many prefill steps"] * 60))
        await until(pilot, started.is_set)
        await pilot.press("escape")
        go_on.set()
        await settle(pilot, conversation)
        last = session.last_stats
        assert last.stopped and last.generated_tokens == 0
        panel = widget_text(app.sidebar)
        assert row(panel, "TTFT") == "—" and row(panel, "gen speed") == "—"
        assert row(panel, "generated") == "0 (stopped)"
