"""Small terminals: the sidebar narrows or hides, and every dialog, buttons included, lies
inside the screen at 60×20 and 80×24."""

from __future__ import annotations

import pytest
from textual.geometry import Region
from textual.widgets import Button, Footer

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session

from .conftest import send, settle, until, widget_text

pytestmark = pytest.mark.anyio

DIALOG_KEYS = ("f4", "ctrl+l", "ctrl+o", "f1", "f8", "f2", "ctrl+f", "f9", "ctrl+n")


def _inside(app, widget) -> bool:
    screen = Region(0, 0, *app.size)
    region = widget.region
    return region.width > 0 and region.height > 0 and screen.contains_region(region)


@pytest.mark.parametrize(
    ("size", "sidebar_width"), [((60, 20), 0), ((80, 24), 28), ((120, 40), 34)]
)
async def test_sidebar_and_dialogs_fit_the_screen(make_app, demo_model, size, sidebar_width):
    session = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    for _ in session.send("saved"):
        pass
    store.save(session, "kept")  # so the session picker has a row
    app = make_app(picker=False)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        await send(pilot, "hello")
        width = app.sidebar.region.width if app.sidebar.display else 0
        assert width == sidebar_width
        assert conversation.region.width == size[0] - sidebar_width
        if size[0] >= 80:  # the footer draws its keys once it has been laid out
            await until(pilot, lambda: "f1 Help" in widget_text(app.query_one(Footer)))
            assert "^p palette" in widget_text(app.query_one(Footer))

        for key in DIALOG_KEYS:
            await pilot.press(key)
            await pilot.pause()
            assert len(app.screen_stack) == 2, key
            dialog = app.screen.query_one(".dialog")
            assert _inside(app, dialog), (key, dialog.region)
            buttons = list(app.screen.query(Button))
            assert buttons or key == "f1"
            for button in buttons:
                assert _inside(app, button), (key, button.label, button.region)
                assert dialog.region.contains_region(button.region), (key, button.label)
            await pilot.press("escape")
            await pilot.pause()
            assert len(app.screen_stack) == 1, key

        app.config = app.config.override(autosave=False)  # Ctrl+W then asks
        await pilot.press("ctrl+w")
        await pilot.pause()
        dialog = app.screen.query_one("#close-dialog")
        assert _inside(app, dialog), dialog.region
        assert "Save it before closing?" in widget_text(dialog)
        for button in app.screen.query(Button):
            assert dialog.region.contains_region(button.region), button.label
        await pilot.press("escape")
        await pilot.pause()
        assert app.active_conversation() is conversation


async def test_ctrl_b_shows_the_hidden_sidebar_on_a_narrow_screen(make_app):
    app = make_app()
    async with app.run_test(size=(60, 20)) as pilot:
        await settle(pilot)
        assert not app.sidebar.display
        await pilot.press("ctrl+b")
        await pilot.pause()
        assert app.sidebar.display and app.sidebar.region.width == 28
        assert "KV cache" in widget_text(app.sidebar)
        await pilot.press("ctrl+b")
        await pilot.pause()
        assert not app.sidebar.display


async def test_the_picker_rows_fit_80_columns(make_app, tmp_path):
    """Every column of the picker, the time last used included, is on screen at 80x24 for
    a session on a long model id; long names and ids end in an ellipsis."""
    from datetime import datetime, timedelta

    from kvchat.store import SessionSummary
    from kvchat.tui.screens.picker import SessionPicker
    from kvchat.tui.textual_compat import screen_text

    earlier = (datetime.now().astimezone() - timedelta(days=400)).isoformat()
    today = datetime.now().astimezone().replace(hour=9, minute=41).isoformat()
    sessions = [
        SessionSummary(
            "chat-1", "demo:qwen2.5-0.5b@q4", "standard", 3, 1234, 5 << 20, today, tmp_path
        ),
        SessionSummary(
            "a-session-with-a-very-long-name",
            "mlx-community/Qwen2.5-3B-Instruct-4bit",
            "quantized:8",
            12,
            56789,
            300 << 20,
            earlier,
            tmp_path,
        ),
    ]
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        app.push_screen(SessionPicker(sessions))
        await until(pilot, lambda: bool(app.screen.query("#picker-table")))
        await pilot.pause(0.1)
        lines = screen_text(app).splitlines()
    row = next(line for line in lines if "chat-1" in line and "standard" in line)
    assert "demo:qwen2.5-0.…" in row and row.rstrip(" █").endswith("09:41")
    long_row = next(line for line in lines if "a-session-with-…" in line)
    assert "mlx-community/Q…" in long_row
    assert long_row.rstrip(" █").endswith(earlier[:10])
