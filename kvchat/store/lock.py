"""The per-session lock: one kvchat at a time works on a session.

Lock files live in ``<sessions>/.locks/<name>.lock``, outside the session
folder, and are never deleted: a lock that lived in the folder would be
deleted with it by ``sessions rm``, leaving a waiter holding a lock on a
removed file while a newcomer locks a fresh one (two holders at once). A
holder must therefore re-check after getting the lock whether its session
still exists (:func:`kvchat.store.exists`): ``rm`` and ``prune`` take the same
lock, so a session can vanish while someone waits for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvchat import locations
from kvchat.store.base import LOCK_TIMEOUT_S, StoreError, check_name, session_dir
from kvchat.store.files import check_folder, open_regular

LOCKS_DIR = ".locks"  # not a valid session name, so never listed as one
TIMEOUT_ENV = "KVCHAT_LOCK_TIMEOUT"

_held: dict[str, tuple[int, int, int]] = {}  # name -> (fd, depth, thread id)
_held_guard = threading.Lock()


@contextlib.contextmanager
def session_lock(name: str, timeout: float | None = None) -> Iterator[Path]:
    """Hold the exclusive lock of session ``name`` (``fcntl.flock`` on its lock file).

    Two processes (or threads) never work on one session at once: the second
    waits up to ``timeout`` seconds (``KVCHAT_LOCK_TIMEOUT`` or 60 by default),
    then raises :class:`StoreError`. Re-entrant within one thread, so
    :func:`save` can take it while a caller already holds it. Yields the folder.
    """
    folder = session_dir(name)
    key = str(folder)
    me = threading.get_ident()
    with _held_guard:
        entry = _held.get(key)
        if entry and entry[2] == me:
            _held[key] = (entry[0], entry[1] + 1, me)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield folder
        finally:
            with _held_guard:
                fd, depth, owner = _held[key]
                _held[key] = (fd, depth - 1, owner)
        return

    if timeout is None:
        timeout = lock_timeout()
    lock_path = lock_file(name)
    handle = open_regular(lock_path, limit=4096, write=True)
    fd = handle.fileno()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"Session {name!r} is in use by another kvchat (lock {lock_path} held "
                        f"for over {timeout:g} s); try again when it finishes."
                    ) from None
                time.sleep(0.05)
    except BaseException:
        handle.close()
        raise
    with _held_guard:
        _held[key] = (fd, 1, me)
    try:
        yield folder
    finally:
        with _held_guard:
            _held.pop(key, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        handle.close()


def lock_file(name: str) -> Path:
    """The lock file of session ``name`` (its folder ``.locks`` is created, never followed)."""
    folder = locations.sessions_dir() / LOCKS_DIR
    if not check_folder(folder):
        folder.mkdir(mode=0o700, exist_ok=True)
        check_folder(folder)
    return folder / f"{check_name(name)}.lock"


def lock_timeout() -> float:
    """Seconds to wait for a session's lock: ``KVCHAT_LOCK_TIMEOUT`` or 60."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return LOCK_TIMEOUT_S
    if not re.fullmatch(r"[0-9]{1,7}(\.[0-9]{1,6})?", raw.strip()):
        raise StoreError(
            f"{TIMEOUT_ENV} must be a number of seconds such as 30 or 2.5 (it is {raw!r})."
        )
    return float(raw)
