"""Sessions as a collection: list, summary, delete, export, prune."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from kvchat import locations
from kvchat.store.base import (
    CACHE_FILE,
    NAME_RE,
    SESSION_FILE,
    SessionSummary,
    StoreError,
    session_dir,
)
from kvchat.store.lock import session_lock
from kvchat.store.session_file import read, read_json


def _folder_size(folder: Path) -> int:
    total = 0
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def _summary(folder: Path) -> SessionSummary | None:
    json_path = folder / SESSION_FILE
    if not json_path.exists() and not (folder / CACHE_FILE).exists():
        return None  # being created (only a lock or temporary files so far)
    size = _folder_size(folder)
    mtime = datetime.fromtimestamp(folder.stat().st_mtime, timezone.utc).isoformat(
        timespec="seconds"
    )
    try:
        data = read_json(json_path)
    except StoreError as exc:
        return SessionSummary(folder.name, "?", "?", 0, 0, size, mtime, folder, note=str(exc))
    info = data.get("cache") or {}
    return SessionSummary(
        name=folder.name,
        model_id=str(data.get("model_id", "?")),
        cache_kind=str(data.get("cache_kind", "?")),
        turns=sum(1 for m in data["messages"] if m["role"] == "user"),
        cache_tokens=int(info.get("tokens", 0)) if isinstance(info, dict) else 0,
        size_bytes=size,
        last_used=str(data.get("updated", mtime)),
        path=folder,
    )


def list_sessions() -> list[SessionSummary]:
    """Every saved session, newest first; a damaged one appears with a ``note``."""
    out = []
    for folder in locations.sessions_dir().iterdir():
        if not folder.is_dir() or not NAME_RE.fullmatch(folder.name):
            continue
        summary = _summary(folder)
        if summary is not None:
            out.append(summary)
    return sorted(out, key=lambda s: s.last_used, reverse=True)


def summary(name: str) -> SessionSummary:
    """The summary of one saved session (``kvchat sessions show``)."""
    folder = session_dir(name)
    found = _summary(folder) if folder.is_dir() else None
    if found is None:
        raise StoreError(f"No saved session named {name!r} (no {folder / SESSION_FILE}).")
    return found


def delete(name: str) -> None:
    """Remove session ``name`` and its files (waits for its lock)."""
    folder = session_dir(name)
    if not folder.is_dir():
        raise StoreError(f"No saved session named {name!r} (no {folder}).")
    with session_lock(name, timeout=5.0):
        shutil.rmtree(folder)


def export(name: str, fmt: str = "md") -> str:
    """The transcript of ``name`` as Markdown (``md``) or JSON (``json``)."""
    data = read(name)
    if fmt == "json":
        keep = ("name", "model_id", "cache_kind", "created", "updated", "settings",
                "messages", "archived", "turns")
        return json.dumps({k: data.get(k) for k in keep}, ensure_ascii=False, indent=2)
    if fmt != "md":
        raise StoreError(f"Unknown export format {fmt!r}; use md or json.")
    lines = [
        f"# {name}",
        "",
        f"- model: {data.get('model_id')}",
        f"- cache kind: {data.get('cache_kind')}",
        f"- created: {data.get('created')}, last used: {data.get('updated')}",
        "",
    ]
    if data.get("archived"):
        lines += ["## Archived (trimmed from the history)", ""]
        lines += _md_messages(data["archived"], level=3)
    lines += _md_messages(data["messages"], level=2)
    return "\n".join(lines).rstrip() + "\n"


def _md_messages(messages: list[dict], level: int) -> list[str]:
    out = []
    for m in messages:
        title = m["role"].capitalize() + (" (stopped)" if m.get("stopped") else "")
        out += [f"{'#' * level} {title}", "", m["content"], ""]
    return out


def prune(older_than_seconds: float) -> list[str]:
    """Delete sessions last used more than ``older_than_seconds`` ago; return their names.

    Damaged sessions and sessions in use are left alone.
    """
    cutoff = time.time() - older_than_seconds
    removed = []
    for s in list_sessions():
        if s.note:
            continue
        try:
            used = datetime.fromisoformat(s.last_used).timestamp()
        except ValueError:
            continue
        if used < cutoff:
            try:
                with session_lock(s.name, timeout=0):
                    shutil.rmtree(s.path)
            except StoreError:
                continue
            removed.append(s.name)
    return removed


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30d``, ``12h``, ``90m``, ``45s`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match:
        raise StoreError(f"Invalid duration {text!r}; use a number and a unit, e.g. 30d, 12h, 90m.")
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * unit
