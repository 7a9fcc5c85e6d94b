"""Atomic file writes: the one way kvchat writes a file (sessions, caches, checkpoints,
the prompt history, exports, the clipboard copy, the config, bench reports).

A write goes to a new temporary file beside the target (``O_EXCL | O_NOFOLLOW``, mode
0600), is fsynced, renamed over the target and the folder is fsynced: a reader (or a
crash) sees the old file or the new one, never a mix. A symlink at the target is
replaced, never written through. Imports nothing from kvchat.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"  # a killed write leaves ``.tmp-<pid>-<random><suffix>``; see remove_stale
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP}  # link(2) on FAT, some FUSE

Writer = Callable[[BinaryIO], object]  # what it returns (a byte count, None) is not used


def write_atomic(path: Path | str, data: bytes, *, replace: bool = True) -> str:
    """Write ``data`` to ``path`` atomically; return its sha256.

    With ``replace`` False an existing ``path`` (file or symlink) stays and
    ``FileExistsError`` is raised: the new file appears whole or not at all. Any
    ``OSError`` leaves no temporary file behind.
    """
    return write_atomic_with(Path(path), lambda f: f.write(data), replace=replace)[0]


def write_atomic_with(
    path: Path,
    write: Writer,
    *,
    replace: bool = True,
    before_rename: Callable[[str, int], None] | None = None,
) -> tuple[str, int]:
    """:func:`write_atomic` for content that ``write(file)`` writes itself (mlx's
    ``save_prompt_cache``, which writes through the file's name too); return the
    file's sha256 and size. ``before_rename(sha256, size)`` runs once the new file
    is on disk, before it takes ``path``'s place."""
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}{path.suffix}"
    flags = os.O_CREAT | os.O_EXCL | _NOFOLLOW
    try:
        with open(tmp, "w+b", opener=lambda p, fl: os.open(p, fl | flags, 0o600)) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
            sha = sha256_of(f)
        if before_rename is not None:
            before_rename(sha, size)
        _rename_into_place(tmp, path, replace)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sha, size


def _rename_into_place(tmp: Path, final: Path, replace: bool) -> None:
    """Rename ``tmp`` over ``final`` (a symlink there is replaced, never followed), or
    without ``replace`` to ``final`` only if nothing is there; fsync the folder."""
    if replace:
        os.replace(tmp, final)
    else:
        try:
            os.link(tmp, final)
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            # a file system without hard links: claim the name, then rename over the claim
            os.close(os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
            os.replace(tmp, final)
        else:
            os.unlink(tmp)
    fsync_dir(final.parent)


def sha256_of(f: BinaryIO) -> str:
    """The sha256 of an open file's bytes, read from the start."""
    f.seek(0)
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    f.seek(0)
    return digest.hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(folder: Path) -> None:
    """Delete temporary files that a killed write left in ``folder`` (regular files
    only; a symlink or folder with a temporary name is left alone)."""
    for entry in os.scandir(folder):
        if entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
