"""The per-session lock: one kvchat at a time works on a session."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvchat.store.base import LOCK_FILE, LOCK_TIMEOUT_S, StoreError, session_dir
from kvchat.store.files import make_dir

_held: dict[str, tuple[int, int, int]] = {}  # name -> (fd, depth, thread id)
_held_guard = threading.Lock()


@contextlib.contextmanager
def session_lock(name: str, timeout: float | None = None) -> Iterator[Path]:
    """Hold the exclusive lock of session ``name`` (``fcntl.flock`` on ``.lock`` in its folder).

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
        timeout = float(os.environ.get("KVCHAT_LOCK_TIMEOUT", LOCK_TIMEOUT_S))
    make_dir(folder)
    lock_path = folder / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
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
        os.close(fd)
        raise
    with _held_guard:
        _held[key] = (fd, 1, me)
    try:
        yield folder
    finally:
        with _held_guard:
            _held.pop(key, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
