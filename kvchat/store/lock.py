"""The per-session lock: one kvchat at a time works on a session.

Lock files live in ``<sessions>/.locks/<name>.lock``, outside the session
folder: a lock inside it was deleted with it by ``sessions rm``, leaving a
waiter holding a lock on a removed file while a newcomer locked a fresh one
(two holders at once). ``rm`` and ``prune`` take the lock, remove the folder,
then the lock file; whoever got the lock on a file that is no longer at its
path starts again on the new one. A holder must re-check after getting the
lock whether its session still exists (:func:`kvchat.store.exists`): a
session can vanish while someone waits for it, who then starts a new one.
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
from typing import BinaryIO

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
    handle = _acquire(f"Session {name!r}", lock_file(name), timeout)
    fd = handle.fileno()
    with _held_guard:
        _held[key] = (fd, 1, me)
    try:
        yield folder
    finally:
        with _held_guard:
            _held.pop(key, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        handle.close()


@contextlib.contextmanager
def file_lock(lock_path: Path, what: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive lock on ``lock_path`` (created if missing, never through a
    symlink), for a file other than a session's that several kvchats update (the prompt
    history). Waits as :func:`session_lock` does; ``what`` names it in the error."""
    handle = _acquire(what, lock_path, lock_timeout() if timeout is None else timeout)
    try:
        yield
    finally:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


def _acquire(what: str, lock_path: Path, timeout: float) -> BinaryIO:
    """Open ``lock_path`` and flock it, waiting up to ``timeout`` seconds; if the file was
    removed meanwhile (its session deleted), lock the one now at that path instead.
    ``what`` (``"Session 'x'"``) names what is locked in the error."""
    deadline = time.monotonic() + timeout
    while True:
        handle = open_regular(lock_path, limit=4096, write=True)
        try:
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreError(
                            f"{what} is in use by another kvchat (lock {lock_path} "
                            f"held for over {timeout:g} s); try again when it finishes."
                        ) from None
                    time.sleep(0.05)
            if _still_there(handle, lock_path):
                return handle
        except BaseException:
            handle.close()
            raise
        handle.close()


def _still_there(handle: BinaryIO, path: Path) -> bool:
    """Whether the open file ``handle`` is still the file at ``path``."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle.fileno())
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def remove_lock_file(name: str) -> None:
    """Delete the lock file of ``name``, whose session is gone; call it holding the lock."""
    lock_file(name).unlink(missing_ok=True)


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
