"""A front end's sessions, made, loaded and saved on one machine or on every rank.

On one machine a session is the conversation layer's :class:`Session` and the store
loads and saves it. Under ``kvchat launch`` the model is a :class:`ShardedModel` and its
session a :class:`ShardedSession`: those go to every rank (the engine's driver
makes them; kvchat/runtime/sharded/disk.py loads and saves them). ``ask``, ``replay``, the
pool and the TUI call these three and need not know which kind of run they are in.
"""

from __future__ import annotations

from pathlib import Path

from kvchat import store
from kvchat.engine.caches.kinds import CacheKind
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.conversation.session import Session
from kvchat.engine.models.model import LoadedModel
from kvchat.engine.sharding import driver
from kvchat.engine.sharding.driver import ShardedSession
from kvchat.engine.sharding.sharded_model import ShardedModel
from kvchat.runtime.sharded import disk


def new_session(
    lm: LoadedModel,
    *,
    kind: str | CacheKind,
    system: str | None,
    settings: GenerationSettings | None = None,
) -> Session:
    """A new session on ``lm``: on every rank when it is sharded."""
    if isinstance(lm, ShardedModel):
        return driver.new_session(lm, kind=kind, system=system, settings=settings)
    return Session(lm, kind=kind, system=system, settings=settings)


def load_session(name: str, lm: LoadedModel) -> store.Loaded:
    """Saved session ``name`` on ``lm`` (``store.load``): on every rank, each with its
    own cache shard, when ``lm`` is sharded."""
    if isinstance(lm, ShardedModel):
        return disk.load_session(name, lm)
    return store.load(name, lm)


def save_session(session: Session, name: str, base: store.Generation | None = None) -> Path:
    """``store.save`` (``base``: the generation it builds on); a sharded session's every
    rank first writes its own shard."""
    if isinstance(session, ShardedSession):
        return disk.save_session(session, name, base)
    return store.save(session, name, base=base)
