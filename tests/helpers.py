"""Helpers shared by the engine and store tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from kvchat.engine.session import Session, TurnDone

# What each rank of a test's sharded run may run in place of kvchat's entry
# (kvchat/cli/ring.py's ENTRY): rank 1 kills itself at the third token of each turn.
LOSING_RANK_1 = """
import os, signal
from kvchat.cli import main

def die(i):
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)

main(on_token=die if os.environ.get("MLX_RANK") == "1" else None)
"""


def wait_until(condition, timeout: float = 10.0, every: float = 0.01) -> None:
    """Poll ``condition()`` until it holds; AssertionError after ``timeout`` seconds (how a
    test waits on another thread or process, never a fixed sleep; TUI tests use
    tests/tui/conftest.py's ``until``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(every)


def turn(session: Session, text: str) -> TurnDone:
    """Run one turn of ``session`` to its end; return its ``TurnDone``."""
    return [e for e in session.send(text) if isinstance(e, TurnDone)][0]


def run_bounded(argv: list[str], timeout: float, env: dict | None = None,
                ) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own, the whole group killed if it
    outlives ``timeout`` (a launch's ranks would otherwise wait on each other forever)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
