"""Rank 0 of a two-rank sharded TUI, run by tests/tui/test_sharded.py in its own process
(a process joins one ring, once): ``python -m tests.tui.sharded_driver PORT LOG TEXT [lost|resume=NAME]``.

It starts rank 1 through ``kvchat launch``'s own code, drives the real app under
``App.run_test`` (one message, the cache kind dialog and a switch to quantized:8, a
refused tab, a refused branch switch, Ctrl+Q; with ``lost``, one message during which
rank 1 kills itself; with ``resume=NAME``, that saved session resumed and one message),
and prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvchat.cli.launch import sharded_tui
from kvchat.cli.ring import Ring, ring_hosts
from kvchat.engine.distributed import DIE_ENV
from kvchat.tui.app import exit_now

from .conftest import SIZE, send, settle, until, widget_text


def main() -> None:
    port, log, text = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    seen: dict = {}

    async def resume(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            conversation = app.active_conversation()
            notices = [str(n.content) for n in conversation.query("NoticeMessage")]
            await send(pilot, text)
            session = conversation.session
            seen.update(name=conversation.session_name, notices=notices,
                        stats=session.last_stats.__dict__, rank_bytes=session.rank_bytes)
            await pilot.press("ctrl+q")
        return app.return_code

    async def lose_rank_1(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert await app.active_conversation().send(text)
            await until(pilot, lambda: app.return_code is not None, timeout=30)
        return app.return_code

    async def drive(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            conversation = app.active_conversation()
            await send(pilot, text)
            session = conversation.session
            seen.update(
                reply=session.messages[-1]["content"], ledger=session.ledger,
                rank_bytes=session.rank_bytes, local_bytes=session.local.cache_bytes,
                sidebar=widget_text(app.sidebar), session=conversation.session_name)
            app.action_cache_kind()  # its kinds were found out on every rank at the start
            await settle(pilot, conversation)
            seen["dialog"] = type(app.screen).__name__
            await pilot.press("escape")
            conversation.run_job("switching cache",
                                 lambda progress: session.set_kind("quantized:8", progress))
            await settle(pilot, conversation)
            seen["quantized_bytes"] = session.rank_bytes
            await pilot.press("ctrl+t")  # a second tab: refused in one sentence
            conversation.run_job("switching", lambda progress: session.switch_branch(0, 1))
            await settle(pilot, conversation)
            seen["tabs"] = len(app.conversations())
            seen["notices"] = [str(n.message) for n in app._notifications]
            await pilot.press("ctrl+q")
        return app.return_code

    mode = sys.argv[4] if len(sys.argv) > 4 else None  # None, "lost" or "resume=NAME"
    if mode == "lost":
        os.environ[DIE_ENV] = "1"  # rank 1 kills itself in the middle of each turn
    flags = {"model": "demo", "max_tokens": 8}
    if mode and mode.startswith("resume="):
        flags["resume"] = mode.partition("=")[2]
    ring = Ring(ring_hosts(2, None, None), port, log)
    how = {None: drive, "lost": lose_rank_1}.get(mode, resume)
    status = sharded_tui(ring, flags, run=lambda app: _run(how, app))
    seen.update(status=status, followers=[p.returncode for p in ring.followers])
    print(json.dumps(seen), flush=True)
    exit_now(0)


def _run(drive, app) -> int:
    import asyncio

    return asyncio.run(drive(app))


if __name__ == "__main__":
    main()
