"""Cache shards of a sharded run: each rank's part of the prompt cache, beside ``session.json``.

Rank 0 writes ``cache.safetensors`` and ``session.json`` as on one machine
(:func:`kvchat.store.save_load.save`); rank ``r`` > 0 writes ``cache.rank<r>.safetensors``
in its own sessions folder (the same one when the ranks share a machine) with
:func:`write_shard`, atomically, *before* rank 0 writes ``session.json``, which
records each shard's sha256 under ``cache.shards``. A shard is read by
:func:`~kvchat.store.cache_file.read_cache` with its rank; one that does not match
(missing, damaged, another layout, a save cut short) makes every rank rebuild
the cache from the transcript. A drop removes each rank's shard with
:func:`delete_shard` (rank 0's, with the whole folder, by ``store.delete``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.store.base import CACHE_FILE, cache_metadata, session_dir
from kvchat.store.files import check_folder, make_dir, write_caches_atomic

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session


def shard_file(rank: int) -> str:
    """The file name of rank ``rank``'s cache (rank 0's is the ordinary cache file)."""
    return CACHE_FILE if rank == 0 else f"cache.rank{rank}.safetensors"


SHARD_RE = re.compile(r"cache\.rank([1-9][0-9]*)\.safetensors")


def drop_shards(folder: Path, keep: int) -> None:
    """Remove the shards of ranks past ``keep`` (a save by fewer ranks, or one machine)."""
    for path in folder.iterdir():
        found = SHARD_RE.fullmatch(path.name)
        if found and int(found[1]) > keep and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)


def shard_sha(info: dict[str, Any], rank: int) -> str | None:
    """The sha256 ``session.json``'s cache record lists for rank ``rank``'s file."""
    if rank == 0:
        return info.get("sha256")
    shards = info.get("shards") or []
    return shards[rank - 1] if rank <= len(shards) else None


def write_shard(session: Session, name: str, rank: int) -> str | None:
    """Write this rank's cache of ``session`` for session ``name`` atomically; return its
    sha256 (None, and the old shard removed, when the cache is empty)."""
    folder = session_dir(name)
    make_dir(folder)
    path = folder / shard_file(rank)
    if not session.ledger:
        path.unlink(missing_ok=True)
        return None
    return write_caches_atomic(path, session.cache, cache_metadata(session))[0]


def delete_shard(name: str, rank: int) -> None:
    """Delete rank ``rank``'s cache shard of session ``name`` (dropped), and the session's
    folder when that leaves it empty, as on a host that keeps no ``session.json``.
    A symlink or file in place of the folder is refused (StoreError), never followed."""
    folder = session_dir(name)
    if not check_folder(folder):
        return
    (folder / shard_file(rank)).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # not empty: rank 0's own files, which store.delete removes
        pass
