"""Files in a session folder: opened only when they are what they claim to be.

Every file kvchat opens in a session folder is opened with ``O_NOFOLLOW`` and
checked with ``fstat`` to be a regular file (never a symlink, FIFO, device or
folder), and reads are capped; a session folder that is a symlink or not a
folder is refused. Writes go through :mod:`kvchat.atomic`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from kvchat import locations
from kvchat.atomic import write_atomic_with
from kvchat.store.base import StoreError, one_line

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
JSON_LIMIT = 64 << 20  # session.json and other small files: more is not a session
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}  # a full disk or quota


def check_folder(folder: Path) -> bool:
    """Whether ``folder`` exists as a real folder; :class:`StoreError` if something
    else (a symlink, a file) is in its place, which kvchat leaves alone."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise StoreError(
            f"{folder} is a symbolic link, not a session folder; kvchat does not follow it "
            "(remove it yourself if it should go)."
        )
    if not stat.S_ISDIR(mode):
        raise StoreError(f"{folder} is not a folder; kvchat leaves it alone.")
    return True


def make_dir(folder: Path) -> None:
    """Create ``folder`` (and the sessions folder) readable by the user only; refuse
    a symlink or a file in its place."""
    locations.sessions_dir()
    if not check_folder(folder):
        folder.mkdir(mode=0o700, exist_ok=True)
        check_folder(folder)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_regular(path: Path, limit: int, write: bool = False) -> BinaryIO:
    """Open ``path`` (for reading, or read-write creating it when ``write``) only if it
    is a regular file of at most ``limit`` bytes; else :class:`StoreError`.

    A symlink is refused without being followed; a FIFO, device or folder is
    refused without blocking. FileNotFoundError passes through for reads.
    """
    extra = _NOFOLLOW | (os.O_CREAT if write else 0)
    try:  # open() rather than os.fdopen: mlx reads and writes through the file's name
        f = open(path, "r+b" if write else "rb", opener=lambda p, fl: os.open(p, fl | extra, 0o600))
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link; kvchat does not follow it.") from None
        if exc.errno == errno.EISDIR:
            raise StoreError(f"{path} is a folder, not a file; kvchat leaves it alone.") from None
        raise StoreError(f"{path} cannot be opened ({one_line(exc)}).") from None
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        f.close()
        raise StoreError(f"{path} is not a regular file; kvchat leaves it alone.")
    if info.st_size > limit:
        f.close()
        raise StoreError(f"{path} is {info.st_size:,} bytes, more than the {limit:,} kvchat reads.")
    os.set_blocking(f.fileno(), True)
    return f


def read_regular(path: Path, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of regular file ``path``, refused as :func:`open_regular` says; at most
    ``limit`` even if it grows while read."""
    with open_regular(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StoreError(f"{path} is more than the {limit:,} bytes kvchat reads.")
    return data


def write_caches_atomic(
    path: Path,
    caches: list[Any],
    metadata: dict[str, str],
    before_rename: Callable[[str, int], None] | None = None,
) -> tuple[str, int]:
    """Write ``caches`` to ``path`` atomically with mlx-lm's ``save_prompt_cache`` (no
    pickle; buffers compacted to their live tokens); return the file's sha256 and size.
    ``before_rename(sha256, size)`` runs once the new file is on disk, before it takes
    ``path``'s place."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvchat.engine.caches.kinds import compacted

    def write(file: BinaryIO) -> None:
        # mlx-lm annotates file_name as str; mx.save_safetensors, which it calls, takes a file.
        save_prompt_cache(file, compacted(caches), metadata)  # type: ignore[arg-type]

    return write_atomic_with(path, write, before_rename=before_rename)
