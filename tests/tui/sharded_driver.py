"""Rank 0 of a two-rank sharded TUI, run by tests/tui/test_sharded.py in its own process
(a process joins one ring, once): ``python -m tests.tui.sharded_driver PORT LOG TEXT [lost|resume=NAME]``.

It starts rank 1 through ``kvchat launch``'s own code, drives the real app under
``App.run_test`` (one message, the cache kind dialog and a switch to quantized:8, a
refused tab, a refused branch switch, a drop from disk (F8) and the message again in
the new session, Ctrl+Q; rank 1 keeps its sessions in a home of its own, as on
another machine, and rank 1's shard as first saved is copied to LOG's folder; with
``lost``, one message during which rank 1 kills itself; with ``resume=NAME``, that
saved session resumed, one message and a drop from memory), and prints what it saw as
JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from kvchat import locations, store
from kvchat.cli.launch import sharded_tui
from kvchat.cli.ring import Ring, ring_hosts
from kvchat.engine.generation.threads import mlx_event_loop
from kvchat.tui.textual_compat import notifications
from tests.helpers import LOSING_RANK_1

from .conftest import SIZE, send, settle, until, widget_text


class OwnHome(Ring):
    """The ring, rank 1 keeping its sessions in ``home`` (its shards only, then)."""

    home: Path

    def start(self) -> None:
        here = os.environ["KVCHAT_HOME"]
        self.envs.append(f"KVCHAT_HOME={self.home}")
        super().start()  # (it sets the envs in this process's environment too)
        os.environ["KVCHAT_HOME"] = here


class LosingRank1(Ring):
    """The ring, rank 1 killing itself in the middle of each turn."""

    entry = LOSING_RANK_1


def said(app, start: str) -> bool:
    """Whether a notification that starts with ``start`` shows."""
    return any(str(n.message).startswith(start) for n in notifications(app))


def listed(*homes: Path) -> list[dict]:
    """Each home's saved sessions and their files (a lease, ``.locks/NAME.PID.open``, that
    says the session is open in this process, as ``NAME.open``)."""

    def name(f: Path) -> str:
        return f.name.replace(f".{os.getpid()}.open", ".open")

    return [
        {d.name: sorted(name(f) for f in d.iterdir()) for d in (home / "sessions").iterdir()}
        for home in homes
    ]


def main() -> None:
    port, log, text = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    seen: dict = {}
    rank1_home = log.parent / "rank1-home"

    async def resume(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            conversation = app.active_conversation()
            notices = [str(n.content) for n in conversation.query("NoticeMessage")]
            await send(pilot, text)
            session = conversation.session
            seen.update(
                name=conversation.session_name,
                notices=notices,
                stats=session.last_stats.__dict__,
                rank_bytes=session.rank_bytes,
            )
            await pilot.press("f8")
            await settle(pilot)
            await pilot.click("#drop-memory")
            await until(pilot, lambda: said(app, "Saved"), timeout=30)
            await settle(pilot)
            seen["after_drop"] = {
                "tabs": [c.session_name for c in app.conversations()],
                "notices": [str(n.message) for n in notifications(app)],
            }
            await pilot.press("ctrl+q")
        return app.return_code

    async def lose_rank_1(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert await app.active_conversation().turns.send(text)
            await until(pilot, lambda: app.return_code is not None, timeout=30)
        return app.return_code

    async def drive(app) -> int:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            conversation = app.active_conversation()
            await send(pilot, text)
            session = conversation.session
            name = conversation.session_name
            seen.update(
                reply=session.messages[-1]["content"],
                ledger=session.ledger,
                rank_bytes=session.rank_bytes,
                local_bytes=session.local.cache_bytes,
                sidebar=widget_text(app.sidebar),
                session=name,
            )
            shutil.copy(rank1_home / "sessions" / name / "cache.rank1.safetensors", log.parent)
            app.action_cache_kind()  # its kinds were found out on every rank at the start
            await settle(pilot, conversation)
            seen["dialog"] = type(app.screen).__name__
            await pilot.press("escape")
            conversation.jobs.run(
                "switching cache", lambda progress: session.set_kind("quantized:8", progress)
            )
            await settle(pilot, conversation)
            seen["quantized_bytes"] = session.rank_bytes
            await pilot.press("ctrl+t")  # a second tab: refused in one sentence
            conversation.jobs.run("switching", lambda progress: session.switch_branch(0, 1))
            await settle(pilot, conversation)
            seen["tabs"] = len(app.conversations())
            seen["notices"] = [str(n.message) for n in notifications(app)]

            homes = locations.data_dir(), rank1_home
            seen["before_drop"] = listed(*homes)
            await pilot.press("f8")
            await settle(pilot)
            seen["drop_dialog"] = widget_text(app.screen.query_one("#drop-dialog"))
            await pilot.click("#drop-disk")
            await until(pilot, lambda: said(app, "Dropped"), timeout=30)
            fresh = app.active_conversation()
            await settle(pilot, fresh)
            seen["after_drop"] = {
                "listed": listed(*homes),
                "tabs": [c.session_name for c in app.conversations()],
                "messages": list(fresh.session.messages),
                "ledger": list(fresh.session.ledger),
                "rank_bytes": list(fresh.session.rank_bytes),
                "widgets": [type(w).__name__ for w in fresh.log.children],
                "notices": [str(n.message) for n in notifications(app)],
                "saved": store.exists(name),
            }
            await send(pilot, text)
            seen["again"] = {
                "reply": fresh.session.messages[-1]["content"],
                **fresh.session.last_stats.__dict__,
            }
            await pilot.press("ctrl+q")
        return app.return_code

    mode = sys.argv[4] if len(sys.argv) > 4 else None  # None, "lost" or "resume=NAME"
    flags = {"model": "demo", "flags": {"max_tokens": 8}}
    if mode and mode.startswith("resume="):
        flags["resume"] = mode.partition("=")[2]
    ring = {None: OwnHome, "lost": LosingRank1}.get(mode, Ring)(
        ring_hosts(2, None, None), port, log
    )
    ring.home = rank1_home
    how = {None: drive, "lost": lose_rank_1}.get(mode, resume)
    status = sharded_tui(ring, flags, run=lambda app: _run(how, app))
    seen.update(status=status, followers=[p.returncode for p in ring.followers])
    print(json.dumps(seen), flush=True)
    sys.exit(0)


def _run(drive, app) -> int:
    with mlx_event_loop() as loop:
        return loop.run_until_complete(drive(app))


if __name__ == "__main__":
    main()
