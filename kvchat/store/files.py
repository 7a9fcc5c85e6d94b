"""Files in a session folder: atomic writes, fsync, temporary files, checksums."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from kvchat import locations
from kvchat.store.base import PAUSE_ENV, TMP_PREFIX


def make_dir(folder: Path) -> None:
    """Create a session folder (and the sessions folder), readable by the user only."""
    locations.sessions_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pause(stage: str) -> None:
    """Test hook: with ``KVCHAT_STORE_TEST_PAUSE=<stage>`` a save stops here to be killed."""
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"kvchat-store-paused:{stage}", file=sys.stderr, flush=True)
        time.sleep(3600)


def temp_path(folder: Path, suffix: str) -> Path:
    """Create a new, empty temporary file in ``folder`` and return its path."""
    path = folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{suffix}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def commit(tmp: Path, final: Path, stage: str) -> str:
    """fsync ``tmp``, rename it over ``final``, fsync the folder; return its sha256."""
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    pause(stage)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return digest.hexdigest()


def write_bytes_atomic(path: Path, data: bytes, stage: str) -> str:
    """Replace ``path`` with ``data`` atomically; return its sha256."""
    tmp = temp_path(path.parent, ".json")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
        return commit(tmp, path, stage)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
