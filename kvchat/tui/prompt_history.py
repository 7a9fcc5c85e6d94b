"""Prompt history: the messages a user sent, for Up/Down in the message box. Imports no Textual.

A tab walks its own user messages first (newest first), then the recent prompts of
every session, kept in ``history.json`` in the data directory: at most
:data:`MAX_ENTRIES` prompts of at most :data:`MAX_ENTRY_CHARS` characters each (a
longer message, such as an inserted file, is not kept). The file is read and
written like the store's files: never through a symlink, replaced atomically,
readable by the user only, and updated under a lock (``history.lock``, the store's
:func:`~kvchat.store.lock.file_lock`), so two kvchats sending at once lose no prompt. A file that cannot be read is treated as empty (the
history is a convenience, never a reason to refuse a message).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from kvchat import locations
from kvchat.atomic import write_atomic
from kvchat.store.base import StoreError
from kvchat.store.files import read_regular
from kvchat.store.lock import file_lock

MAX_ENTRIES = 200
MAX_ENTRY_CHARS = 16_384
FILE_LIMIT = 8 << 20  # well above MAX_ENTRIES × MAX_ENTRY_CHARS in UTF-8


def history_file() -> Path:
    return locations.data_dir() / "history.json"


def lock_file() -> Path:
    return locations.data_dir() / "history.lock"


def load() -> list[str]:
    """The saved prompts, newest first; empty when the file is missing or unreadable."""
    try:
        data = json.loads(read_regular(history_file(), FILE_LIMIT).decode("utf-8"))
    except (FileNotFoundError, StoreError, OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    return [p for p in data if isinstance(p, str) and p.strip()][:MAX_ENTRIES]


def remember(prompt: str) -> None:
    """Put ``prompt`` first in the saved history (once: an older copy moves up)."""
    if not prompt.strip() or len(prompt) > MAX_ENTRY_CHARS:
        return
    with file_lock(lock_file(), "The prompt history", timeout=5):
        entries = [prompt, *(p for p in load() if p != prompt)][:MAX_ENTRIES]
        body = json.dumps(entries, ensure_ascii=False, indent=0).encode("utf-8")
        write_atomic(history_file(), body)


def merged(own: Iterable[str], saved: Iterable[str]) -> list[str]:
    """``own`` (a tab's messages, newest first) then ``saved``, each prompt once."""
    seen: set[str] = set()
    result = []
    for prompt in [*own, *saved]:
        if prompt.strip() and prompt not in seen:
            seen.add(prompt)
            result.append(prompt)
    return result
