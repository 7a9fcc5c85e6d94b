"""One open session as the pool sees it, and the digest that says whether it changed since
its last save or load. Imports no Textual."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvchat import store

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session


@dataclass
class PoolEntry:
    """One open session as the pool sees it (what the TUI shows)."""

    name: str
    session: Session
    last_used: float
    in_memory: bool = True
    saved_state: str | None = None  # signature at the last save or load; None: never saved
    notice: str | None = None  # what the last load from disk said, if anything
    kept: bool = False  # the copy on disk was asked for (opened from or saved to disk), not
    # only written by an offload: :meth:`SessionPool.discard` leaves it
    generation: store.Generation = field(default_factory=store.Generation)  # of the copy on
    # disk this process last loaded or saved: a save refuses when another process saved since

    @property
    def cache_bytes(self) -> int:
        """Memory its cache holds (allocated buffers, not only the live tokens, and its
        checkpoints)."""
        session = self.session
        return session.allocated_bytes + session.checkpoints.nbytes if self.in_memory else 0

    @property
    def cache_tokens(self) -> int:
        return self.session.cache_tokens if self.in_memory else 0

    @property
    def dirty(self) -> bool:
        return self.saved_state != signature(self.session)


def signature(session: Session) -> str:
    """A digest of everything :func:`store.save` writes that can change."""
    body = json.dumps(
        [
            session.kind.name,
            session.messages,
            session.archived,
            session.ledger,
            [t.to_dict() for t in session.turns],
            asdict(session.settings),
            session.branch_record(),
        ],
        ensure_ascii=False,
    )
    return hashlib.sha256(body.encode()).hexdigest()
