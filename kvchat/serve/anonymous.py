"""The sessions the server names itself (``serve-XXXXXXXX``), and their budget.

A request that names no session continues the one whose transcript is its
history, or gets a new one. Clients that send one-off prompts would leave a
session folder each time, so the server keeps at most ``budget`` of its own
sessions in the sessions folder: after each reply the least recently saved
ones beyond that are deleted. Sessions with other names (the TUI's, ``kvchat
ask``'s, ones a client named with ``X-Session-Id``) are never touched.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Container
from typing import TYPE_CHECKING

from kvchat import locations, store

if TYPE_CHECKING:
    from kvchat.runtime.pool import SessionPool

DEFAULT_BUDGET = 64
_NAME = re.compile(r"serve-[0-9a-f]{8}")


def owns(name: str) -> bool:
    """True for a name the server gave (and may therefore delete)."""
    return _NAME.fullmatch(name) is not None


def new_name(pool: SessionPool) -> str:
    """A fresh ``serve-XXXXXXXX`` name, neither in ``pool`` nor on disk."""
    while True:
        name = f"serve-{secrets.token_hex(4)}"
        if name not in pool and not store.exists(name):
            return name


def keep_within(pool: SessionPool, budget: int, keep: Container[str]) -> list[str]:
    """Delete the server's own saved sessions beyond the ``budget`` most recently saved
    (never one in ``keep``, those requests are using, nor one another process holds);
    return their names."""
    if budget <= 0:
        return []
    saved = []
    for name in _saved_names():
        try:
            saved.append((os.stat(store.session_dir(name) / store.SESSION_FILE).st_mtime_ns, name))
        except OSError:
            continue
    saved.sort(reverse=True)
    removed = []
    for _, name in saved[budget:]:
        if name in keep:
            continue
        try:
            if name in pool:
                session = pool.entry(name).session
                pool.drop(name, delete_from_disk=True)
                # its cache's memory goes now: the session's own reference cycles would
                # keep it until Python's next full collection, which comes rarely
                session.close()
            else:
                store.delete(name, timeout=0)
        except (store.StoreError, OSError):
            continue  # in use elsewhere, or gone meanwhile: the next reply tries again
        removed.append(name)
    return removed


def _saved_names() -> list[str]:
    try:
        return [n for n in os.listdir(locations.sessions_dir()) if owns(n)]
    except OSError:
        return []
