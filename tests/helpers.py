"""Helpers shared by the engine and store tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess

from kvchat.engine.session import Session, TurnDone


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
