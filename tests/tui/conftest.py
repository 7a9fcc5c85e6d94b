"""Helpers for driving the TUI with the demo model in a private home."""

from __future__ import annotations

import asyncio

import pytest

from kvchat.config import Config
from kvchat.engine.generation.threads import MlxThreadPool
from kvchat.tui.app import KvChatApp
from kvchat.tui.textual_compat import screen_text

SIZE = (120, 40)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh data and config dir for each test (no saved sessions)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture
def make_app(demo_model, home):
    def make(max_tokens: int = 8, **kwargs) -> KvChatApp:
        config = Config(model="demo", max_tokens=max_tokens, autosave=False)
        kwargs.setdefault("volatile", False)
        return KvChatApp(config, lm=demo_model, **kwargs)

    return make


async def settle(pilot, conversation=None, timeout: float = 30.0) -> None:
    """Wait until the workers are done and the conversation is idle again."""
    app = pilot.app
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await app.workers.wait_for_complete()
        if not app.conversations() and len(app.screen_stack) == 1 and app.lm is not None:
            await pilot.pause(0.02)  # the first tab is being mounted
        await pilot.pause()
        busy = conversation is not None and conversation.busy
        if not busy and not any(c.busy for c in app.conversations()):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the app did not settle")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    """One turn in the active tab (the keys that send are tested on their own)."""
    conversation = pilot.app.active_conversation()
    assert await conversation.turns.send(text)
    await settle(pilot, conversation)


def _mlx_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose thread workers clear their MLX state as they end, as the app's
    own (kvchat/tui/run.py): one that ends with it in place can abort the test process as
    it exits, after every test passed (ml-explore/mlx#3126)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(MlxThreadPool())
    return loop


@pytest.fixture
def anyio_backend():
    """Pilot tests run on asyncio (through anyio's pytest plugin), on :func:`_mlx_loop`."""
    return ("asyncio", {"loop_factory": _mlx_loop})


async def until(pilot, condition, timeout: float = 30.0) -> None:
    """Pause until ``condition()`` holds (TimeoutError after ``timeout`` seconds): how a
    TUI test waits, never a fixed pause (tests/helpers.py's ``wait_until`` outside the app)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition never held")
        await pilot.pause(0.01)


async def idle_past_ttl(pilot, name: str) -> None:
    """Until the pool's entry ``name`` has been idle longer than the pool's ``ttl_s`` (what
    the expiry timer's tick looks for)."""
    pool = pilot.app.pool
    await until(pilot, lambda: pool.clock() - pool.entry(name).last_used > pool.ttl_s)


def widget_text(widget) -> str:
    """The text a widget draws in its region of the screen, rows joined by newlines."""
    region = widget.region
    rows = screen_text(widget.app).splitlines()[region.y : region.bottom]
    return "\n".join(row[region.x : region.right] for row in rows)


async def new_tab(pilot):
    """Ctrl+T; return the new tab's conversation (now the active one)."""
    await pilot.press("ctrl+t")
    await settle(pilot)
    return pilot.app.active_conversation()


async def palette_pick(pilot, query: str) -> str:
    """Ctrl+P, type ``query``, Enter on the first match; return that match's title."""
    from textual.command import CommandPalette
    from textual.widgets import OptionList

    app = pilot.app
    await pilot.press("ctrl+p")
    await until(pilot, lambda: isinstance(app.screen, CommandPalette))
    await pilot.press(*query)
    options = app.screen.query_one(OptionList)
    await until(pilot, lambda: options.option_count > 0)
    first = str(options.get_option_at_index(0).prompt)
    await pilot.press("enter")
    return first
