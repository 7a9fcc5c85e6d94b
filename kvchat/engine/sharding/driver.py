"""Rank 0 of a model sharded over MLX distributed ranks (``kvchat launch``): the session
whose every change of the cache goes to every rank first.

Rank 0 runs the command (``ask``, ``replay``, the TUI); every other rank runs
:func:`~kvchat.runtime.sharded.follower.follow`. Each engine operation that changes a cache
(load the model, new session, load, send, regenerate, edit, undo, a restore from
the archive, reset, cache kind, trim, system prompt, save, drop) goes to every rank
over the link (kvchat/engine/sharding/link.py), and rank 0 then performs it on its own
:class:`Session`; each follower performs it on its own, in the same order. A turn's op
carries the session's settings and the request's :class:`TurnOptions`, so that every rank
samples, feeds and reports alike. Every rank thus runs the same forward passes on the same
tokens, so the collectives inside the sharded model meet, every rank's cache shard holds
the one ledger, and greedy sampling agrees (the logits are the same on every rank after
the model's own all-sum or all-gather), and every rank takes rank 0's sampled token all
the same (temperature sampling is seeded alike on every rank too). Loading, saving and
dropping a session's files on every rank is the layer above the engine and the store
(kvchat/runtime/sharded/disk.py).

A session's stop flag is shared (:class:`SharedStop`): each check of it during a
turn is a collective carrying rank 0's flag, so a stop ends the turn after the
same token everywhere.

After each operation rank 0 gathers every rank's cache bytes ("bytes", for the
sidebar). A rank that dies makes ``mlx.launch`` (or, for the TUI,
kvchat/cli/ring.py) end the others; ``kvchat launch`` (kvchat/cli/launch.py)
says which rank it was in one sentence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar, cast

import mlx.core as mx

from kvchat.engine.caches.kinds import applicable_kinds, parse_kind
from kvchat.engine.conversation.events import (
    ASK_NOTHING,
    Event,
    GenerationSettings,
    SessionError,
    Turn,
    TurnDone,
    TurnOptions,
)
from kvchat.engine.conversation.session import Session
from kvchat.engine.generation.sampling import Sampler
from kvchat.engine.sharding.link import Link, Op, OpError, SharedStop, linked
from kvchat.engine.sharding.sharded_model import ShardedModel, load_sharded

if TYPE_CHECKING:
    from kvchat.engine.caches.kinds import CacheKind

Progress = Callable[[int, int], None]
T = TypeVar("T")

# How a sharded run does each public name of a Session, besides the operations that
# ShardedSession sends to every rank (its own methods). A name in neither set is
# refused with AttributeError (tests/test_distributed.py fails on one): a new method
# that changes the cache or the transcript must not run on rank 0 alone unnoticed.
LOCAL = frozenset(  # read from rank 0's session: figures, the transcript, flags
    {
        "allocated_bytes",
        "answering",
        "archived",
        "branch_position",
        "branch_positions",
        "branch_record",
        "branches",
        "cache",
        "cache_bytes",
        "cache_tokens",
        "checkpoints",
        "figures",
        "history",
        "keeper",
        "kind",
        "last_change",
        "last_stats",
        "ledger",
        "lm",
        "messages",
        "pending_rebuild",
        "prompt_logprobs",
        "render",
        "runner",
        "stop",  # the stop flag is every rank's (SharedStop)
        "system",
        "talk",
        "turn_ends",
        "turns",
    }
)
UNSHARED = frozenset(  # they change the cache or the transcript; not sent to the followers
    {
        "answer",
        "attach",
        "close",
        "complete",
        "delete_pair",
        "fork_prefix",
        "keep_in_step",
        "rebuild",
        "replace_history",
        "restore",
        "revise_reply",
        "switch_branch",
        "sync",
        "unload",
    }
)


def load_model(spec: str) -> ShardedModel:
    """Rank 0: load ``spec`` sharded over every rank (ModelLoadError as load_model)."""
    seed = time.time_ns() % (1 << 31)
    link = linked()
    link.broadcast({"op": "model", "spec": spec, "seed": seed})
    mx.random.seed(seed)
    return load_sharded(spec, link.group)


def probe_kinds(lm: ShardedModel, names: list[str]) -> list[str]:
    """Rank 0: which of the cache kinds ``names`` the sharded model takes, found out on
    every rank at once (a probe runs the model, whose collectives need every rank). The
    answers are kept (kvchat/engine/caches/fit.py), so asking again later runs nothing."""
    linked().broadcast({"op": "kinds", "names": names})
    return applicable_kinds(lm.model, names)


def bind(session: Session, link: Link) -> Session:
    """Make ``session`` keep in step with the other ranks: a shared stop flag (each check
    is a collective from now on) and rank 0's sampled token on every rank (the logits
    agree, but float sums over more than two ranks need not agree to the last bit)."""

    def share(sample: Sampler) -> Sampler:
        def shared(logprobs: mx.array) -> mx.array:
            token = sample(logprobs)
            mine = token if link.rank == 0 else mx.zeros_like(token)
            return mx.distributed.all_sum(mine, group=link.group, stream=mx.cpu)

        return shared

    session.keep_in_step(SharedStop(link), share)
    return session


def new_session(
    lm: ShardedModel,
    *,
    kind: str | CacheKind,
    system: str | None,
    settings: GenerationSettings | None = None,
) -> Session:
    """A new :class:`Session` on every rank (a session on one machine is a plain
    :class:`Session`; kvchat/runtime/sessions.py picks).

    The ranks make it together: a kind other than ``standard`` runs the model once to
    see that it fits (:func:`~kvchat.engine.caches.kinds.make_cache`), a collective here.
    """
    settings = settings or GenerationSettings()
    link = linked()
    link.broadcast(
        {"op": "new", "kind": parse_kind(kind).name, "system": system, "settings": asdict(settings)}
    )
    session = Session(lm, kind=kind, system=system, settings=settings)
    return standing_in(ShardedSession(link, bind(session, link)).count_bytes())


class ShardedSession:
    """Rank 0's :class:`Session` of a sharded run: each call that changes the cache is
    sent to every rank first; everything else is the local session's. ``rank_bytes``
    holds each rank's cache bytes as of the end of the last operation."""

    def __init__(self, link: Link, local: Session):
        self._link, self.local = link, local
        self.rank_bytes: list[int] = [0] * link.size

    @property
    def settings(self) -> GenerationSettings:  # set by the TUI: sent with each turn
        return self.local.settings

    @settings.setter
    def settings(self, value: GenerationSettings) -> None:
        self.local.settings = value

    def count_bytes(self) -> ShardedSession:
        """Ask every rank for its cache bytes (into ``rank_bytes``)."""
        self._send("bytes")
        self.rank_bytes = self._link.per_rank(self.local.cache_bytes)
        return self

    def __getattr__(self, name: str) -> Any:
        if name in LOCAL:
            return getattr(self.local, name)
        if name in UNSHARED:
            raise SessionError(
                f"A sharded run cannot {name.replace('_', ' ')} yet; run "
                "this session on one machine for that."
            )
        raise AttributeError(f"a sharded session does not say how every rank does {name!r}")

    def _send(self, op: str, **fields: Any) -> None:
        self._link.broadcast({"op": op, **fields})

    def _turn(self, op: str, options: TurnOptions, **fields: Any) -> Turn:
        """Send the turn ``op`` with the session's settings and the request's ``options``
        (every rank samples, feeds and reports alike), then run it here."""
        if options.logits_processors:  # functions: they cannot travel to the other ranks
            raise SessionError(
                "A sharded run cannot constrain a reply's tokens yet; run this session "
                "on one machine for that."
            )
        fields["options"] = options_record(options)
        self._send(op, settings=asdict(self.local.settings), **fields)
        events: Turn = perform(self.local, {"op": op, **fields}, self._link)
        return self._counted(events)

    def _counted(self, events: Iterator[Event]) -> Turn:
        yield from events
        self.count_bytes()

    def send(self, text: str, options: TurnOptions = ASK_NOTHING) -> Turn:
        return self._turn("send", options, text=text)

    def regenerate(self, index: int | None = None, options: TurnOptions = ASK_NOTHING) -> Turn:
        return self._turn("regenerate", options, index=index)

    def edit(self, index: int, text: str, options: TurnOptions = ASK_NOTHING) -> Turn:
        return self._turn("edit", options, index=index, text=text)

    def _then_count(self, op: str, call: Callable[[], T], **fields: Any) -> T:
        """Send ``op``, make ``call()`` here, then count every rank's cache bytes."""
        self._send(op, **fields)
        result = call()
        self.count_bytes()
        return result

    def undo(self, turns: int = 1) -> None:
        self._then_count("undo", lambda: self.local.undo(turns), turns=turns)

    def restore_archived(self, index: int) -> None:
        self._then_count("restore", lambda: self.local.restore_archived(index), index=index)

    def reset(self) -> bool:
        return self._then_count("reset", self.local.reset)

    def set_kind(self, kind: str | CacheKind, progress: Progress | None = None) -> str | None:
        name = parse_kind(kind).name
        return self._then_count("kind", lambda: self.local.set_kind(name, progress), kind=name)

    def trim_history(self, max_tokens: int, progress: Progress | None = None) -> int:
        return self._then_count(
            "trim", lambda: self.local.trim_history(max_tokens, progress), max_tokens=max_tokens
        )

    def set_system(self, text: str | None) -> int:
        return self._then_count("system", lambda: self.local.set_system(text), text=text)


def standing_in(session: ShardedSession) -> Session:
    """Rank 0's :class:`ShardedSession`, handed out where a :class:`Session` goes (the
    TUI's tabs, ``ask``): it sends the calls that change the cache to every rank, and
    every other attribute is its local session's."""
    return cast(Session, session)


def perform(session: Session, op: Op, link: Link) -> Any:
    """Run ``op`` on ``session``: what rank 0 and the followers both do."""
    name = op["op"]
    if "settings" in op:
        session.settings = GenerationSettings(**op["settings"])
    if name in ("send", "regenerate", "edit"):
        options = options_from(op["options"])
        events = (
            session.send(op["text"], options)
            if name == "send"
            else session.regenerate(op["index"], options)
            if name == "regenerate"
            else session.edit(op["index"], op["text"], options)
        )
        return _watched(events, link)
    if name == "undo":
        return session.undo(op["turns"])
    if name == "restore":
        return session.restore_archived(op["index"])
    if name == "reset":
        return session.reset()
    if name == "kind":
        return session.set_kind(op["kind"])
    if name == "trim":
        return session.trim_history(op["max_tokens"])
    if name == "system":
        return session.set_system(op["text"])
    raise OpError(f"The ranks are out of step: {name!r} is not a session operation.")


def options_record(options: TurnOptions) -> dict[str, Any]:
    """A turn's ``options`` as an op carries them (JSON; logits processors never travel)."""
    return {
        "settings": None if options.settings is None else asdict(options.settings),
        "start": options.start,
        "tools": options.tools,
        "variables": None if options.variables is None else dict(options.variables),
        "report_logprobs": options.report_logprobs,
    }


def options_from(record: dict[str, Any]) -> TurnOptions:
    """The :class:`TurnOptions` an op's ``record`` (:func:`options_record`) holds."""
    settings = record["settings"]
    return TurnOptions(
        settings=None if settings is None else GenerationSettings(**settings),
        start=record["start"],
        tools=record["tools"],
        variables=record["variables"],
        report_logprobs=record["report_logprobs"],
    )


def _watched(events: Iterator[Event], link: Link) -> Turn:
    """The turn's events; a turn left before its end leaves the ranks out of step."""
    finished = False
    try:
        for event in events:
            finished = isinstance(event, TurnDone)
            yield event
    finally:
        if not finished:
            link.broken = True
