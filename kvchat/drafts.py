"""The message being sent, kept on disk while it is in flight. Imports no Textual.

A message is written to ``drafts/<session>.txt`` in the data directory, durably
(atomic write and fsync, :func:`~kvchat.atomic.write_atomic`), before
its prefill starts, and removed once its turn has ended in a running app or the
session was saved with it (``kvchat ask``: once saved). A kill -9 or an
out-of-memory kill during a long prefill therefore loses no message, whatever
its size (the prompt history keeps only short ones): the next time the session is
opened, kvchat offers it back. Drafts are read like the store's files (never
through a symlink, size-capped); one that cannot be read counts as none.
"""

from __future__ import annotations

from pathlib import Path

from kvchat import locations
from kvchat.atomic import write_atomic
from kvchat.store.base import StoreError, check_name
from kvchat.store.files import JSON_LIMIT, read_regular

OFFER = "A message was being sent when kvchat stopped: restore it?"


def draft_file(name: str) -> Path:
    check_name(name)
    return locations.drafts_dir() / f"{name}.txt"


def keep(name: str, text: str) -> None:
    """Write ``text`` as session ``name``'s draft, durably, replacing any older one."""
    write_atomic(draft_file(name), text.encode("utf-8"))


def clear(name: str) -> None:
    """Forget session ``name``'s draft (its message is saved, or the user let it go)."""
    draft_file(name).unlink(missing_ok=True)


def pending(name: str, messages: list[dict]) -> str | None:
    """Session ``name``'s draft if there is one that ``messages`` (the session as opened)
    do not end with; a draft the session holds already is removed."""
    try:
        text = read_regular(draft_file(name), JSON_LIMIT).decode("utf-8")
    except (FileNotFoundError, StoreError, OSError, UnicodeDecodeError):
        return None
    sent = [m.get("content") for m in messages if m.get("role") == "user"]
    if not text.strip() or (sent and sent[-1] == text):
        clear(name)
        return None
    return text
