"""Sessions as a collection: list, summary, delete, prune."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvchat import locations
from kvchat.store.base import (
    CACHE_FILE,
    NAME_RE,
    SESSION_FILE,
    SessionSummary,
    StoreError,
    one_line,
    session_dir,
)
from kvchat.store.files import check_folder
from kvchat.store.lock import remove_lock_file, session_lock
from kvchat.store.search_index import drop_session
from kvchat.store.session_file import read_json

REMOVING_PREFIX = ".removing-"  # not a valid session name, so never listed


def _folder_size(folder: Path) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def _summary(folder: Path) -> SessionSummary | None:
    """The summary of ``folder``; None when it holds no session (yet, or any more)."""
    try:
        info = os.lstat(folder)
        check_folder(folder)
    except FileNotFoundError:
        return None
    except StoreError as exc:  # a symlink or a file: listed with a note, never followed
        mtime = datetime.fromtimestamp(info.st_mtime, timezone.utc).isoformat(timespec="seconds")
        return SessionSummary(folder.name, "?", "?", 0, 0, 0, mtime, folder, note=str(exc))
    json_path = folder / SESSION_FILE
    if not os.path.lexists(json_path) and not os.path.lexists(folder / CACHE_FILE):
        return None  # being created (only temporary files so far) or being removed
    size = _folder_size(folder)
    mtime = datetime.fromtimestamp(info.st_mtime, timezone.utc).isoformat(timespec="seconds")
    try:
        data = read_json(json_path)
    except StoreError as exc:
        return SessionSummary(folder.name, "?", "?", 0, 0, size, mtime, folder, note=str(exc))
    cache = data.get("cache") or {}
    return SessionSummary(
        name=folder.name,
        model_id=str(data.get("model_id", "?")),
        cache_kind=str(data.get("cache_kind", "?")),
        turns=sum(1 for m in data["messages"] if m["role"] == "user"),
        cache_tokens=int(cache.get("tokens", 0)) if isinstance(cache, dict) else 0,
        size_bytes=size,
        last_used=str(data.get("updated", mtime)),
        path=folder,
    )


def list_sessions() -> list[SessionSummary]:
    """Every saved session, newest first; a damaged one, or a symlink or file where a
    session folder should be, appears with a ``note``."""
    out = []
    for folder in locations.sessions_dir().iterdir():
        if not NAME_RE.fullmatch(folder.name):
            continue  # .locks, folders being removed
        summary = _summary(folder)
        if summary is not None:
            out.append(summary)
    return sorted(out, key=lambda s: s.last_used, reverse=True)


def summary(name: str) -> SessionSummary:
    """The summary of one saved session (``kvchat sessions show``)."""
    folder = session_dir(name)
    found = _summary(folder)
    if found is None:
        raise StoreError(f"No saved session named {name!r} (no {folder / SESSION_FILE}).")
    return found


def delete(name: str, timeout: float | None = 5.0) -> None:
    """Remove session ``name`` and its files, under its lock (waits up to ``timeout``
    seconds for it; None: ``KVCHAT_LOCK_TIMEOUT`` or 60, as ``kvchat sessions rm`` does).

    A symlink in place of the folder is refused, never followed. Whoever waited
    for the lock meanwhile finds no session afterwards and starts a new one.
    """
    folder = session_dir(name)
    if not check_folder(folder):
        raise StoreError(f"No saved session named {name!r} (no {folder}).")
    with session_lock(name, timeout=timeout):
        if not check_folder(folder):  # removed while this waited
            raise StoreError(f"No saved session named {name!r} (no {folder}).")
        _remove(folder)
        remove_lock_file(name)
    drop_session(name)


def _remove(folder: Path) -> None:
    """Rename ``folder`` out of sight in one step, then delete it: nobody ever sees a
    half-deleted session (a crash leaves a ``.removing-*`` folder that :func:`prune` clears)."""
    gone = folder.with_name(f"{REMOVING_PREFIX}{folder.name}-{os.urandom(4).hex()}")
    os.rename(folder, gone)
    shutil.rmtree(gone)  # fd-based: symlinks inside are removed, never followed


@dataclass
class Pruned:
    """What :func:`prune` removed (or would remove) and what it left alone, and why."""

    removed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def prune(
    older_than_seconds: float, dry_run: bool = False, only: Collection[str] | None = None
) -> Pruned:
    """Delete sessions last used more than ``older_than_seconds`` ago (of ``only``, when
    given: the ones a person confirmed from a ``dry_run``).

    Damaged sessions, symlinks and sessions in use (their lock held) are left
    alone and reported in ``skipped``. With ``dry_run`` nothing is deleted and
    ``removed`` names what would be.
    """
    cutoff = time.time() - older_than_seconds
    result = Pruned()
    for s in sorted(list_sessions(), key=lambda s: s.name):  # reported in name order
        if only is not None and s.name not in only:
            continue
        if s.note:
            result.skipped.append((s.name, s.note))
        elif _last_used(s) < cutoff:
            if dry_run:
                result.removed.append(s.name)
                continue
            try:
                with session_lock(s.name, timeout=0):
                    current = _summary(s.path)  # it may have been used or removed meanwhile
                    if current is None or current.note or _last_used(current) >= cutoff:
                        continue
                    _remove(s.path)
                    remove_lock_file(s.name)
                drop_session(s.name)
            except StoreError:
                result.skipped.append((s.name, "it is in use by another kvchat"))
                continue
            except OSError as exc:
                result.skipped.append((s.name, f"it could not be removed ({one_line(exc)})"))
                continue
            result.removed.append(s.name)
    if not dry_run:
        _clear_leftovers()
    return result


def _last_used(s: SessionSummary) -> float:
    """When ``s`` was last used (from its ``updated`` time, else its folder's)."""
    try:
        return datetime.fromisoformat(s.last_used).timestamp()
    except ValueError:
        return s.path.lstat().st_mtime


def _clear_leftovers() -> None:
    """Delete folders a removal left half-deleted (the process died during it)."""
    for entry in os.scandir(locations.sessions_dir()):
        if entry.name.startswith(REMOVING_PREFIX) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30d``, ``12h``, ``90m``, ``45s`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "", flags=re.ASCII)
    if not match:
        raise StoreError(f"Invalid duration {text!r}; use a number and a unit, e.g. 30d, 12h, 90m.")
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * unit
