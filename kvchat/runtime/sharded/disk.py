"""A sharded session on disk: rank 0 loads, saves and deletes it on every rank, each
rank reading and writing its own cache shard (kvchat/store/shards.py).

Rank 0 sends the operation ("load", "save", "drop") over the engine's link
(kvchat/engine/sharding/link.py), does its own part with the store, and
gathers one row from every rank saying how its part went; the followers do theirs
in :func:`~kvchat.runtime.sharded.follower.follow`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import store
from kvchat.engine.sharding.driver import ShardedSession, bind, standing_in
from kvchat.engine.sharding.link import ROW, Link, linked
from kvchat.store.cache_file import read_cache

if TYPE_CHECKING:
    from kvchat.engine.caches.cache_check import Reference
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.engine.sharding.sharded_model import ShardedModel
    from kvchat.store.cache_file import CacheRead


def load_session(name: str, lm: ShardedModel) -> store.Loaded:
    """``store.load`` on every rank: each rank reads its own cache shard, and when any
    rank cannot use its shard every rank rebuilds from the transcript."""
    data, generation = store.read_with_generation(name)
    link = linked()
    link.broadcast({"op": "load", "name": name, "data": data})
    loaded = load_here(name, lm, data, link)
    loaded.generation = generation
    loaded.session = standing_in(ShardedSession(link, loaded.session).count_bytes())
    return loaded


def load_here(name: str, lm: LoadedModel, data: dict[str, Any], link: Link) -> store.Loaded:
    """``store.load`` on this rank, with its own cache shard; every rank rebuilds from the
    transcript when any one cannot use its shard."""

    def reader(
        folder: Path,
        data: dict[str, Any],
        lm: LoadedModel,
        ledger: list[int],
        empty: Session,
        reference: Reference,
    ) -> CacheRead:
        cache, kept, problem = read_cache(
            folder, data, lm, ledger, empty, reference, rank=link.rank
        )
        if problem is None and kept is not None and len(kept) != len(ledger):
            cache, kept, problem = None, None, "a save was cut short"
        rows = link.gather(problem.encode("utf-8")[:ROW] if problem else b"")
        if problem is None:
            bad = [(r, row) for r, row in enumerate(rows) if row]
            if bad:
                rank, why = bad[0]
                why_said = why.decode("utf-8", "ignore")
                return None, None, f"rank {rank}'s cache shard could not be used: {why_said}"
        return cache, kept, problem

    loaded = store.load(name, lm, data=data, reader=reader)
    bind(loaded.session, link)
    return loaded


def save_session(session: ShardedSession, name: str, base: store.Generation | None = None) -> Path:
    """``store.save`` (``base``: the generation it builds on) after every other rank has
    written its own shard; a rank that could not leaves ``session.json`` as it was."""
    link = linked()
    link.broadcast({"op": "save", "name": name})
    rows = link.gather(b"")
    for rank, row in enumerate(rows[1:], 1):
        if not row.startswith((b"sha:", b"empty")):
            raise store.StoreError(
                f"Could not save session {name}: rank {rank} could not write its cache shard "
                f"({row.decode('utf-8', 'ignore')}); session.json was not changed."
            )
    shas = [row[4:].decode() for row in rows[1:] if row.startswith(b"sha:")]
    return store.save(session.local, name, shards=shas or None, base=base)


def delete_session(name: str) -> str | None:
    """Drop saved session ``name``: delete it here with ``store.delete``, as on one
    machine (a StoreError then leaves every rank's files as they were), then every other
    rank deletes its own cache shard and forgets its session (a new one is made on every
    rank next). Returns the sentence naming a rank whose shard could not be deleted, or
    None."""
    if store.exists(name):
        store.delete(name)
    link = linked()
    link.broadcast({"op": "drop", "name": name})
    for rank, row in enumerate(link.gather(b"")[1:], 1):
        if row:
            return (
                f"Dropped {name}, but rank {rank} could not delete its cache shard "
                f"({row.decode('utf-8', 'ignore')}); it stays on that host."
            )
    return None
