"""The live sessions of one process, and when their caches leave memory (each one a
:class:`~kvchat.runtime.pool_entry.PoolEntry`). Imports no Textual.

Every open conversation keeps its transcript in memory; its prompt cache
may be **offloaded**: saved to disk (if it changed since the last save) and
dropped from memory. The next :meth:`SessionPool.get` loads it back, so the
caller never sees the difference except in time. Caches are offloaded when
idle longer than ``ttl_s`` (:meth:`SessionPool.expire`) and, least recently
used first, when the caches in memory, and the weights of the models the
pool's :class:`~kvchat.engine.models.registry.ModelRegistry` holds, pass
``memory_budget_bytes`` (:meth:`SessionPool.enforce_budget`). Each open
session holds its model in that registry: the model is unloaded when the last
session using it is dropped. A new session starts from a copy of a
live session's cache cut to the shared prefix (the system prompt) when one
with the same model, cache kind and system prompt is open.

Call the pool under the scheduler's ticket (work that has the model to itself); a
session that is answering is never offloaded (:meth:`SessionPool.offload` refuses).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvchat import store
from kvchat.runtime.pool_entry import PoolEntry, signature

if TYPE_CHECKING:
    from kvchat.config import Config
    from kvchat.engine.caches.kinds import CacheKind
    from kvchat.engine.conversation.session import GenerationSettings, Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.engine.models.registry import ModelRegistry


class SessionPool:
    """The open sessions of one process, by name.

    ``ttl_s`` (0 or None: never) and ``memory_budget_bytes`` (0 or None: no
    limit) come from the config; ``clock`` returns seconds (tests pass their own).
    With ``models``, every open session holds its model there (see the module's doc).
    """

    def __init__(
        self,
        ttl_s: float | None = 1800,
        memory_budget_bytes: int | None = 0,
        clock: Callable[[], float] = time.time,
        models: ModelRegistry | None = None,
    ):
        self.ttl_s = ttl_s
        self.memory_budget_bytes = memory_budget_bytes
        self.clock = clock
        self.models = models
        self._entries: dict[str, PoolEntry] = {}

    @classmethod
    def for_config(cls, config: Config, models: ModelRegistry) -> SessionPool:
        """A front end's pool (the TUI's, the server's): ``config``'s ``ttl`` and
        ``memory_budget``, the weights of the models ``models`` holds counted in it."""
        return cls(
            ttl_s=config.ttl or None,
            memory_budget_bytes=config.memory_budget or None,
            models=models,
        )

    def _put(self, entry: PoolEntry) -> None:
        if self.models is not None:
            self.models.retain(entry.session.lm)
        store.hold_open(entry.name)  # another kvchat opening it is warned
        old = self._entries.pop(entry.name, None)
        self._entries[entry.name] = entry
        if old is not None and self.models is not None:
            self.models.release(old.session.lm)

    # ------------------------------------------------------------- opening

    def add(
        self, name: str, session: Session, generation: store.Generation | None = None
    ) -> Session:
        """Put a live session in the pool under ``name`` (a valid store name); one loaded
        from disk elsewhere (a sharded run's) comes with the ``generation`` it read."""
        store.check_name(name)
        self._put(
            PoolEntry(name, session, self.clock(), generation=generation or store.Generation())
        )
        return session

    def rename(self, old: str, new: str, generation: store.Generation | None = None) -> None:
        """File ``old``'s entry under ``new``, keeping what it knows of its last save
        (the caller has saved it under the new name, if it was saved at all, and passes
        the ``generation`` that save wrote)."""
        store.check_name(new)
        entry = self._entries.pop(old)
        store.let_go(old)
        store.hold_open(new)
        entry.name = new
        entry.generation = generation or store.Generation()
        self._entries[new] = entry

    def open(self, name: str, lm: LoadedModel, progress=None) -> store.Loaded:
        """Load saved session ``name`` (cache included) into the pool; see :func:`store.load`."""
        if name in self._entries:
            return store.Loaded(self.get(name), resumed_from_disk=False, notice=None)
        return self._adopt(name, store.load(name, lm, progress))

    def _adopt(self, name: str, loaded: store.Loaded) -> store.Loaded:
        """Put a session just loaded from disk in the pool under ``name``."""
        entry = PoolEntry(
            name,
            loaded.session,
            self.clock(),
            notice=loaded.notice,
            kept=True,
            generation=loaded.generation,
        )
        entry.saved_state = signature(loaded.session) if loaded.notice is None else None
        self._put(entry)
        return loaded

    def new_session(
        self,
        lm: LoadedModel,
        kind: str | CacheKind = "standard",
        system: str | None = None,
        settings: GenerationSettings | None = None,
        name: str | None = None,
        busy: Callable[[str], bool] = lambda name: False,
    ) -> Session:
        """A new, empty conversation; shares a live session's cached prefix when it can.

        A live session with the same model fingerprint, cache kind and system
        prompt gives its cache, cut to the system prompt, so the first turn
        evaluates only the new message. Added to the pool when ``name`` is given.
        Never one that is answering, nor one ``busy(name)`` says another request
        holds: the generation core owns a running turn's cache (a merged batch holds
        its keys and values), so a copy of it is not the conversation's prefix.
        """
        from kvchat.engine.caches.kinds import parse_kind
        from kvchat.engine.conversation.session import Session

        kind = parse_kind(kind)
        session = None
        for entry in sorted(self._entries.values(), key=lambda e: -e.last_used):
            other = entry.session
            if (
                entry.in_memory
                and not other.answering
                and not busy(entry.name)
                and other.ledger
                and other.lm.fingerprint == lm.fingerprint
                and other.kind == kind
                and (other.system or None) == (system or None)
            ):
                session = other.fork_prefix()
                if settings is not None:
                    session.settings = settings
                break
        if session is None or not session.ledger:
            session = Session(lm, kind=kind, system=system, settings=settings)
        if name is not None:
            self.add(name, session)
        return session

    # ------------------------------------------------------------- using

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> PoolEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"No open session named {name!r}.") from None

    def entries(self) -> list[PoolEntry]:
        """Every open session, most recently used first."""
        return sorted(self._entries.values(), key=lambda e: -e.last_used)

    def get(self, name: str, progress=None) -> Session:
        """The session ``name``, its cache loaded back from disk first if it was offloaded."""
        entry = self.entry(name)
        if not entry.in_memory:
            session = entry.session
            loaded = store.load(name, session.lm, progress)
            if loaded.generation == entry.generation:
                # Same object for the caller; only the cache and its ledger come back.
                session.attach(loaded.session.cache, loaded.session.ledger)
                entry.notice = loaded.notice
            else:  # another process saved it since: that cache is not this transcript's
                session.rebuild("the saved copy was changed by another kvchat", progress)
                entry.notice = (
                    "Another kvchat saved this session meanwhile; its cache was "
                    "rebuilt from this conversation."
                )
            entry.in_memory = True
            entry.saved_state = signature(session) if entry.notice is None else None
        entry.last_used = self.clock()
        return entry.session

    def touch(self, name: str) -> None:
        """Mark ``name`` as just used (it becomes the last to be offloaded)."""
        self.entry(name).last_used = self.clock()

    def unsaved(self, name: str) -> bool:
        """Whether ``name`` has changes its kept copy on disk lacks: messages never saved,
        or any change since the last save or load (a turn, an undo down to no message, a
        trim, a deleted exchange, a cache kind, settings). An offload's copy is not a save."""
        entry = self.entry(name)
        if not any(m["role"] == "user" for m in entry.session.messages):
            return entry.kept and entry.dirty  # a saved session emptied since (by undo)
        return entry.dirty or not entry.kept or not store.exists(name)

    def save_unsaved(self) -> list[str]:
        """Save every open session with unsaved changes (see :meth:`unsaved`); return their
        names. Call it when no session is running (on quitting, once the workers ended)."""
        names = [name for name in self._entries if self.unsaved(name)]
        for name in names:
            self.save(name)
        return names

    def let_go_all(self) -> None:
        """Record that this process closed every session it has open (on quitting: other
        kvchats see them closed at once, not only once they find this process gone)."""
        for name in self._entries:
            store.let_go(name)

    def save(self, name: str) -> None:
        """Save ``name`` to disk now if it changed since the last save; the copy on disk is
        then one the user keeps (see :meth:`discard`). :class:`store.SessionChanged` when
        another process saved it since this one loaded or saved it (nothing is written:
        see :meth:`keep_as_branch`)."""
        self._write(name)
        self.entry(name).kept = True

    def changed_elsewhere(self, name: str) -> bool:
        """Whether another process saved ``name`` since this one loaded or saved it (one
        small read of ``session.json``; False for a session never saved here, whose first
        save checks that the name is still free, and for one gone or damaged on disk,
        which its save reports)."""
        entry = self.entry(name)
        if entry.generation.sha256 is None:
            return False
        try:
            now = store.generation_of(name)
        except store.StoreError:
            return False
        return now.sha256 is not None and now != entry.generation

    def keep_as_branch(self, name: str, progress=None) -> store.Loaded:
        """After :class:`store.SessionChanged`: keep ``name``'s conversation as branches of
        the copy another process saved (which stays the main line), then load that copy
        in its place (its cache included): the session returned holds both sides."""
        session = self.entry(name).session
        store.save_as_branch(session, name)
        return self._adopt(name, store.load(name, session.lm, progress))

    def _write(self, name: str) -> None:
        entry = self.entry(name)
        if entry.in_memory and (entry.dirty or not store.exists(name)):
            from kvchat.runtime.sessions import save_session  # a sharded run's: every rank's

            save_session(entry.session, name, base=entry.generation)
            entry.saved_state = signature(entry.session)

    # ------------------------------------------------------------- letting go

    def offload(self, name: str) -> bool:
        """Save ``name`` if it changed, then drop its cache from memory (the transcript stays).

        Returns False when it was not in memory, or is answering (its cache belongs to
        the running turn until it ends).
        """
        entry = self.entry(name)
        if not entry.in_memory or entry.session.answering:
            return False
        self._write(name)
        session = entry.session
        session.unload()
        entry.in_memory = False
        return True

    def drop(
        self, name: str, delete_from_disk: bool = False, keep_hold: bool = False
    ) -> LoadedModel | None:
        """Close ``name`` without saving; with ``delete_from_disk`` its copy on disk goes
        too (the one place a close deletes it: :meth:`discard` decides through here).
        Its model is unloaded if no other open session uses it. With ``keep_hold`` the
        session's hold on its model passes to the caller instead, who gives it back with
        ``pool.models.release`` (an unload takes time: a UI does it in a worker); the
        model is returned when there was such a hold."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            store.let_go(name)
        held = entry.session.lm if entry is not None and self.models is not None else None
        if held is not None and not keep_hold and self.models is not None:
            self.models.release(held)
            held = None
        if delete_from_disk and store.exists(name):
            store.delete(name)
        return held

    def discard(self, name: str, keep_hold: bool = False) -> LoadedModel | None:
        """Close ``name`` without saving: as :meth:`drop`, and a copy on disk that only an
        offload wrote (the session was never opened from or saved to disk) goes too."""
        entry = self._entries.get(name)
        return self.drop(
            name, delete_from_disk=entry is not None and not entry.kept, keep_hold=keep_hold
        )

    def expire(self, now: float | None = None) -> list[str]:
        """Offload every cache idle for longer than ``ttl_s``; return their names."""
        if not self.ttl_s or self.ttl_s <= 0:
            return []
        now = self.clock() if now is None else now
        idle = [e.name for e in self.entries() if e.in_memory and now - e.last_used > self.ttl_s]
        return [name for name in idle if self._offload_unless_changed(name)]

    def _offload_unless_changed(self, name: str) -> bool:
        """:meth:`offload`, except that a session another process saved meanwhile stays
        in memory (its next save says so)."""
        try:
            return self.offload(name)
        except store.SessionChanged:
            return False

    def memory_bytes(self) -> int:
        """Bytes of the prompt caches held in memory now, and of the registry's models."""
        weights = self.models.weight_bytes() if self.models is not None else 0
        return weights + sum(e.cache_bytes for e in self._entries.values())

    def enforce_budget(self) -> list[str]:
        """Offload least recently used caches until the rest (and the models) fit
        ``memory_budget_bytes``.

        The most recently used session always stays, and models in use stay loaded. Returns the names offloaded.
        """
        budget = self.memory_budget_bytes
        if not budget or budget <= 0:
            return []
        offloaded = []
        for entry in reversed(self.entries()[1:]):  # oldest first, never the newest
            if self.memory_bytes() <= budget:
                break
            if entry.in_memory and self._offload_unless_changed(entry.name):
                offloaded.append(entry.name)
        return offloaded
