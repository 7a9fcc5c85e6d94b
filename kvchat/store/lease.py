"""Which kvchat processes have a session open: a small lease file per process and
session, ``.locks/<name>.<pid>.open`` (the pid and the process's start time), made
when a front end opens the session and removed when it closes it. A lease whose
process is gone (or whose pid now belongs to another process) is stale: ignored and
removed. Only a warning rests on it; the generations (``generations.py``) keep saves safe.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvchat.atomic import write_atomic
from kvchat.store.base import StoreError, check_name
from kvchat.store.files import read_regular
from kvchat.store.lock import lock_file


def _lease(name: str, pid: int) -> Path:
    return lock_file(name).with_name(f"{check_name(name)}.{pid}.open")


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc; "" where there
    is no /proc): with the pid, it names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]


def hold_open(name: str) -> None:
    """Record that this process has session ``name`` open."""
    pid = os.getpid()
    write_atomic(_lease(name, pid), f"{pid} {_started(pid)}".encode())


def let_go(name: str) -> None:
    """Record that this process closed session ``name``."""
    _lease(name, os.getpid()).unlink(missing_ok=True)


def open_elsewhere(name: str) -> list[int]:
    """The pids of the other live kvchat processes that have session ``name`` open
    (stale leases are removed on the way)."""
    prefix = f"{check_name(name)}."
    pids = []
    for path in lock_file(name).parent.glob(f"{prefix}*.open"):
        middle = path.name[len(prefix) : -len(".open")]
        if not middle.isdigit() or int(middle) == os.getpid():
            continue
        pid = int(middle)
        try:
            recorded = read_regular(path, 256).decode("ascii", "replace").split()
        except (OSError, StoreError):
            continue
        alive = _alive(pid) and recorded[1:] == ([_started(pid)] if _started(pid) else [])
        if alive:
            pids.append(pid)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
