"""Names, constants and result types shared by the store modules."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import __version__, locations

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session

FORMAT = 1
SESSION_FILE = "session.json"
CACHE_FILE = "cache.safetensors"
CACHE_SUM_FILE = "cache.sha256"  # the newest cache's checksum, written before the cache
CHECKPOINTS_FILE = "checkpoints.safetensors"  # copies of layers that cannot be cut back
LOCK_TIMEOUT_S = 60.0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class StoreError(Exception):
    """A session on disk cannot be read or written; one sentence that names the file."""


@dataclass
class SessionSummary:
    """One line of ``kvchat sessions list``; ``note`` says what is wrong with a damaged one."""

    name: str
    model_id: str
    cache_kind: str
    turns: int
    cache_tokens: int
    size_bytes: int
    last_used: str
    path: Path
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass
class Generation:
    """Which ``session.json`` a process last loaded or saved: its ``generation`` field
    (0 where it has none) and the sha256 of its bytes (None: nothing was on disk).
    A checked save moves it forward in place; keep one per open session."""

    number: int = 0
    sha256: str | None = None

    def describes(self, raw: bytes | None) -> bool:
        """Whether ``raw`` (a ``session.json``'s bytes, None when there is none) is the
        file this generation was taken from."""
        return self.sha256 == (hashlib.sha256(raw).hexdigest() if raw is not None else None)


@dataclass
class Loaded:
    """What :func:`load` returns: the session, whether its cache came from disk, why not,
    and the generation of the ``session.json`` it read (a checked save's ``base``)."""

    session: Session
    resumed_from_disk: bool
    notice: str | None
    generation: Generation = field(default_factory=Generation)  # of the file it read


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid session name, else raise :class:`StoreError`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        shown = (
            repr(name[:100]) + ("…" if len(name) > 100 else "")
            if isinstance(name, str)
            else repr(name)
        )
        raise StoreError(
            f"Invalid session name {shown}: use up to 100 letters, digits, '-', '_' or '.', "
            "starting with a letter or digit."
        )
    return name


def session_dir(name: str) -> Path:
    """The folder of session ``name`` (it may not exist)."""
    return locations.sessions_dir() / check_name(name)


def exists(name: str) -> bool:
    """Whether something is saved under ``name``: a ``session.json`` (whatever it is)
    or a symlink or file in place of the folder. Reading it then says what is wrong."""
    folder = session_dir(name)
    if not os.path.lexists(folder):
        return False
    return not folder.is_dir() or folder.is_symlink() or os.path.lexists(folder / SESSION_FILE)


def ledger_hash(ledger: list[int]) -> str:
    """A short, stable hash of a token ledger."""
    return hashlib.sha256(",".join(map(str, ledger)).encode()).hexdigest()


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def now() -> str:
    """The current UTC time, ISO 8601 to the millisecond."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def cache_metadata(session: Session) -> dict[str, str]:
    """What a cache file's safetensors metadata says of the cache and the ledger it holds."""
    ledger = session.ledger
    return {
        "kvchat_version": __version__,
        "format": str(FORMAT),
        "model_fingerprint": session.lm.fingerprint,
        "cache_kind": session.kind.name,
        "ledger_len": str(len(ledger)),
        "ledger_sha256": ledger_hash(ledger),
        "ledger": ",".join(map(str, ledger)),
    }
