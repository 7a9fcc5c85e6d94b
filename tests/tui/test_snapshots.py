"""Snapshots of the main screen, the session picker, the trim dialog and the help screen.

Deterministic: fixed terminal size, no turn run, and the app in snapshot mode
(``volatile=False`` hides timings and memory). Update with
``pytest tests/tui/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

from pathlib import Path

from kvchat import store
from kvchat.store import SessionSummary
from kvchat.tui.widgets.chat_input import ChatInput

SIZE = (120, 40)


async def _steady(pilot) -> None:
    app = pilot.app
    for _ in range(200):  # the first tab (or the picker) is mounted after start-up
        await app.workers.wait_for_complete()
        await pilot.pause()
        ready = app.active_conversation() is not None and app.focused is not None
        if ready or len(app.screen_stack) > 1:
            break
        await pilot.pause(0.02)
    for area in app.query(ChatInput):
        area.cursor_blink = False
    await pilot.pause()


def test_main_screen(snap_compare, make_app):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_steady)


def test_trim_dialog(snap_compare, make_app):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_steady, press=["ctrl+l"])


def test_help_screen(snap_compare, make_app):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_steady, press=["f1"])


def test_session_picker(snap_compare, make_app, monkeypatch):
    sessions = [
        SessionSummary(
            "research",
            "demo",
            "quantized:8",
            12,
            4_812,
            1_310_720,
            "2025-01-31T09:15:00+00:00",
            Path("/sessions/research"),
        ),
        SessionSummary(
            "chat-1",
            "demo",
            "standard",
            3,
            402,
            262_144,
            "2025-01-30T18:02:00+00:00",
            Path("/sessions/chat-1"),
        ),
    ]
    monkeypatch.setattr(store, "list_sessions", lambda: sessions)
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_steady)
