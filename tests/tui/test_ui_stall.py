"""The UI thread never waits on the engine: while three tabs stream and a fourth opens,
a 10 ms timer on the app's loop keeps its beat (issue 39: the longest stall ≤ 100 ms).
Measured on this 2-core VM: 49-87 ms quiet, 71 ms beside two busy loops."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import SIZE, settle, until
from .test_tabs_at_once import _reply_text

pytestmark = pytest.mark.anyio

BEAT = 0.01  # the timer's interval, seconds
LONGEST = 0.1  # the longest the loop may fall behind it
# A stall the app causes (the loop waiting on the engine) comes back each time a tab opens;
# a busy machine's (another process had the cores) does not: up to this many tries.
TRIES = 3


async def _stall_while_a_tab_opens(pilot) -> float:
    """Open a tab (a new session, its panel and its figures) with a timer beating on the
    app's loop; the longest the loop fell behind the beat, in seconds."""
    app, loop = pilot.app, asyncio.get_running_loop()
    tabs = len(app.conversations())
    beats = [loop.time()]
    timer = app.set_interval(BEAT, lambda: beats.append(loop.time()))
    await pilot.press("ctrl+t")
    await until(pilot, lambda: len(app.conversations()) == tabs + 1, timeout=30)
    new = app.active_conversation()
    await until(pilot, lambda: new.state == "idle" and len(beats) > 100, timeout=30)
    timer.stop()
    return max(b - a for a, b in zip(beats, beats[1:])) - BEAT


async def test_the_loop_keeps_its_beat_while_three_tabs_stream_and_a_fourth_opens(make_app):
    app = make_app(max_tokens=4000)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        tabs = [app.active_conversation()]
        for _ in range(2):
            await pilot.press("ctrl+t")
            await until(pilot, lambda: app.active_conversation() not in tabs, timeout=30)
            tabs.append(app.active_conversation())
            await until(pilot, lambda: tabs[-1].state == "idle", timeout=30)
        for n, tab in enumerate(tabs):
            tab.session.settings.ignore_eos = True  # the demo's replies are over in a blink
            assert await tab.turns.send(f"Tell me a long story, number {n}.")
        await until(pilot, lambda: all(_reply_text(t) for t in tabs), timeout=60)
        stalls = []  # the longest the loop fell behind its beat, in each try
        while len(stalls) < TRIES and (not stalls or min(stalls) > LONGEST):
            stalls.append(await _stall_while_a_tab_opens(pilot))
            assert all(t.state == "answering" for t in tabs)  # they streamed all along
        streamed = [len(_reply_text(t)) for t in tabs]
        for tab in tabs:
            tab.turns.stop()
        await settle(pilot)
        assert all(len(_reply_text(t)) >= n > 0 for t, n in zip(tabs, streamed))
        assert min(stalls) <= LONGEST, stalls
