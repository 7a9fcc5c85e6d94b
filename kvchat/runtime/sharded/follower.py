"""A follower rank of a sharded run (kvchat/engine/sharding/driver.py): it performs every
operation rank 0 sends, in the same order, on its own part of the model and its own
:class:`Session`, until rank 0 sends "end". Loads, saves and drops read and write this
rank's cache shard (kvchat/runtime/sharded/disk.py is rank 0's side of them)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

from kvchat.engine.caches.kinds import CacheKindError, applicable_kinds
from kvchat.engine.conversation.events import GenerationSettings, SessionError
from kvchat.engine.conversation.session import Session
from kvchat.engine.models.model import ModelLoadError
from kvchat.engine.sharding.driver import bind, perform
from kvchat.engine.sharding.link import ROW, Link, OpError
from kvchat.engine.sharding.sharded_model import ShardedModel, load_sharded
from kvchat.runtime.sharded.disk import load_here
from kvchat.store import StoreError
from kvchat.store.shards import delete_shard, write_shard

T = TypeVar("T")


def follow(link: Link, on_token: Callable[[int], object] | None = None) -> int:
    """A follower rank: perform every operation rank 0 sends until it sends "end".

    ``on_token``, when given, is called with each token's index in a turn (0, 1, ...)
    as this rank's send, regenerate or edit produces it (tests lose a rank mid-turn
    through it)."""
    lm: ShardedModel | None = None
    session: Session | None = None
    while True:
        op = link.broadcast()
        name = op["op"]
        if name == "end":
            return 0
        if name == "model":
            mx.random.seed(op["seed"])
            try:
                lm = load_sharded(op["spec"], link.group)
            except ModelLoadError as exc:
                print(f"kvchat (rank {link.rank}): {exc}", file=sys.stderr, flush=True)
                return 2
        elif name == "new":
            settings = GenerationSettings(**op["settings"])
            try:
                session = bind(
                    Session(
                        _held(lm, "model"), kind=op["kind"], system=op["system"], settings=settings
                    ),
                    link,
                )
            except CacheKindError:
                pass  # rank 0 meets it too, and says so
        elif name == "load":
            session = load_here(op["name"], _held(lm, "model"), op["data"], link).session
        elif name == "save":
            try:
                sha = write_shard(_held(session, "session"), op["name"], link.rank)
                row = b"sha:" + sha.encode() if sha else b"empty"
            except (OSError, StoreError) as exc:
                row = _said(exc)
            link.gather(row)
        elif name == "drop":
            session = None  # rank 0 sends "new" next
            try:
                delete_shard(op["name"], link.rank)
                row = b""
            except (OSError, StoreError) as exc:
                row = _said(exc)
            link.gather(row)
        elif name == "bytes":
            link.per_rank(_held(session, "session").cache_bytes)
        elif name == "kinds":
            applicable_kinds(_held(lm, "model").model, op["names"])
        else:
            try:
                result = perform(_held(session, "session"), op, link)
                for i, _ in enumerate(result if name in ("send", "regenerate", "edit") else ()):
                    if on_token is not None:
                        on_token(i)
            except (SessionError, CacheKindError):
                pass  # rank 0 meets the same error on the same state and reports it


def _held(thing: T | None, what: str) -> T:
    """The model or session an operation works on (rank 0 sends "model", then "new" or
    "load", before the operations that use them)."""
    if thing is None:
        raise OpError(f"The ranks are out of step: an operation came before its {what}.")
    return thing


def _said(exc: Exception) -> bytes:
    """``exc`` as a row of :meth:`Link.gather`, never empty (empty: it worked)."""
    return str(exc).encode("utf-8", "ignore")[:ROW] or b"error"
