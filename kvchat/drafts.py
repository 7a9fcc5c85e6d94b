"""Messages not in their session yet, kept on disk: the one being sent, and the one being
typed. Imports no Textual.

A message is written to ``drafts/<session>.txt`` in the data directory, durably
(atomic write and fsync, :func:`~kvchat.atomic.write_atomic`), before
its prefill starts, and removed once its turn has ended in a running app or the
session was saved with it (``kvchat ask``: once saved). A kill -9 or an
out-of-memory kill during a long prefill therefore loses no message, whatever
its size (the prompt history keeps only short ones): the next time the session is
opened, kvchat offers it back.

What the message box holds (typed, or sent and held back by a dialog) is kept the
same way in ``drafts/typed/<session>.txt`` a moment after each change, and removed
when the box is emptied: quitting, or the app dying, loses none of it, and the box
gets it back when the session is opened again. :func:`unsent` lists every session
with either, so the session picker can offer those never saved.

Drafts are read like the store's files (never through a symlink, size-capped); one
that cannot be read counts as none.
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


def typed_file(name: str) -> Path:
    check_name(name)
    return locations.drafts_dir() / "typed" / f"{name}.txt"


def keep(name: str, text: str) -> None:
    """Write ``text`` as session ``name``'s draft, durably, replacing any older one."""
    write_atomic(draft_file(name), text.encode("utf-8"))


def clear(name: str) -> None:
    """Forget session ``name``'s draft (its message is saved, or the user let it go)."""
    draft_file(name).unlink(missing_ok=True)


def pending(name: str, messages: list[dict]) -> str | None:
    """Session ``name``'s draft if there is one that ``messages`` (the session as opened)
    do not end with; a draft the session holds already is removed."""
    text = _read(draft_file(name))
    if text is None:
        return None
    if not text.strip() or _sent(text, messages):
        clear(name)
        return None
    return text


def keep_typed(name: str, text: str) -> None:
    """Keep what session ``name``'s message box holds (nothing to keep: forget it)."""
    if text.strip():
        path = typed_file(name)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, text.encode("utf-8"))
    else:
        typed_file(name).unlink(missing_ok=True)


def typed(name: str, messages: list[dict]) -> str | None:
    """What session ``name``'s message box held when kvchat last stopped, if anything but
    the message ``messages`` (the session as opened) end with (then it was sent, and the
    draft is removed)."""
    text = _read(typed_file(name))
    if not text or not text.strip():
        return None
    if _sent(text, messages):
        keep_typed(name, "")
        return None
    return text


def unsent() -> dict[str, str]:
    """Every session with a message not in it (being sent, or typed), by name: the message
    (the one being sent first)."""
    found: dict[str, str] = {}
    folder = locations.drafts_dir()
    for path in sorted([*folder.glob("typed/*.txt"), *folder.glob("*.txt")]):
        try:
            name = check_name(path.stem)
        except StoreError:
            continue
        text = _read(path)
        if text and text.strip():
            found[name] = text
    return found


def _sent(text: str, messages: list[dict]) -> bool:
    """Whether ``text`` is the last user message of ``messages``: it reached the session."""
    sent = [m.get("content") for m in messages if m.get("role") == "user"]
    return bool(sent) and sent[-1] == text


def _read(path: Path) -> str | None:
    try:
        return read_regular(path, JSON_LIMIT).decode("utf-8")
    except (FileNotFoundError, StoreError, OSError, UnicodeDecodeError):
        return None
