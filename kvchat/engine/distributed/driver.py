"""One kvchat driving a model sharded over MLX distributed ranks (``kvchat launch``).

Rank 0 runs the command (``ask``, ``replay``, the TUI); every other rank runs
:func:`~kvchat.sharded.follower.follow`. Each engine operation that changes a cache
(load the model, new session, load, send, regenerate, edit, undo, reset, cache
kind, trim, system prompt, save, drop) is a small JSON object that rank 0 sends
to every rank with ``mx.distributed.all_sum`` over a uint8 buffer (its length
first), and then performs on its own :class:`Session`; each follower performs it
on its own, in the same order. Every rank thus runs the same forward passes on
the same tokens, so the collectives inside the sharded model meet, every rank's
cache shard holds the one ledger, and greedy sampling agrees (the logits are the
same on every rank after the model's own all-sum or all-gather), and every rank
takes rank 0's sampled token all the same (temperature sampling is seeded alike on
every rank too). Loading, saving and dropping a session's files on every rank is the
layer above the engine and the store (kvchat/sharded/disk.py).

A session's stop flag is shared (:class:`SharedStop`): each check of it during a
turn is a collective carrying rank 0's flag, so a stop ends the turn after the
same token everywhere.

After each operation rank 0 gathers every rank's cache bytes ("bytes", for the
sidebar). A rank that dies makes ``mlx.launch`` (or, for the TUI,
kvchat/cli/ring.py) end the others; ``kvchat launch`` (kvchat/cli/launch.py)
says which rank it was in one sentence.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar, cast

import mlx.core as mx
import numpy as np

from kvchat.engine.caches.kinds import applicable_kinds, parse_kind
from kvchat.engine.conversation.events import (
    Event,
    GenerationSettings,
    SessionError,
    Turn,
    TurnDone,
)
from kvchat.engine.conversation.session import Session
from kvchat.engine.distributed.sharding import ShardedModel, load_sharded
from kvchat.engine.generation.sampling import Sampler

if TYPE_CHECKING:
    from kvchat.engine.caches.kinds import CacheKind

Op = dict[str, Any]  # an engine operation, as JSON has it: {"op": name, ...its fields}
Progress = Callable[[int, int], None]
T = TypeVar("T")

OPS = frozenset(
    {
        "model",
        "new",
        "load",
        "send",
        "regenerate",
        "edit",
        "undo",
        "reset",
        "kind",
        "trim",
        "system",
        "save",
        "drop",
        "bytes",
        "kinds",
        "end",
    }
)
ROW = 256  # bytes each rank reports after a save, a load or a drop
# Session methods that change the cache and are not sent to the followers (the TUI's).
UNSHARED = frozenset(
    {"switch_branch", "delete_pair", "fork_prefix", "rebuild", "attach", "sync", "unload", "close"}
)


class OpError(ValueError):
    """Bytes that are not an engine operation (ranks out of step, or another program)."""


def encode_op(op: Op) -> bytes:
    """The bytes of ``op`` as they travel between ranks."""
    if not isinstance(op, dict) or op.get("op") not in OPS:
        raise OpError(f"not an engine operation: {op!r:.80}")
    return json.dumps(op, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode_op(data: bytes) -> Op:
    """The operation ``data`` holds, or :class:`OpError` in one sentence."""
    try:
        op: object = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise OpError("The ranks are out of step: an operation arrived damaged.") from None
    if not isinstance(op, dict) or op.get("op") not in OPS:
        raise OpError(f"The ranks are out of step: {op!r:.60} is not an engine operation.")
    return op


class Link:
    """Rank 0's channel to every rank of ``group``: operations out, short reports back."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.broken = False  # rank 0 walked away mid-turn: the followers are not at an op

    def _sum(self, values: mx.array) -> mx.array:
        out = mx.distributed.all_sum(values, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def total(self, value: int) -> int:
        """The sum of ``value`` over the ranks."""
        return cast(int, self._sum(mx.array([value], dtype=mx.int32)).item())  # an int32

    def broadcast(self, op: Op | None = None) -> Op:
        """Rank 0 sends ``op``; every rank (rank 0 too) returns it."""
        if self.rank == 0 and self.broken:
            raise SessionError(
                "The ranks are out of step after a reply left unfinished; start the run again."
            )
        data = encode_op(op or {}) if self.rank == 0 else b""
        length = self.total(len(data))
        buffer = (
            np.frombuffer(data, dtype=np.uint8) if self.rank == 0 else np.zeros(length, np.uint8)
        )
        return decode_op(bytes(np.array(self._sum(mx.array(buffer)))))

    def per_rank(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order (one all-sum of a vector indexed by rank)."""
        vector = np.zeros(self.size, np.int64)
        vector[self.rank] = value
        return [int(v) for v in np.array(self._sum(mx.array(vector)))]

    def gather(self, row: bytes) -> list[bytes]:
        """Every rank's ``row`` (at most ROW bytes, no NUL), in rank order."""
        table = np.zeros((self.size, ROW), np.uint8)
        table[self.rank, : len(row[:ROW])] = np.frombuffer(row[:ROW], np.uint8)
        summed = np.array(self._sum(mx.array(table)))
        return [bytes(r).rstrip(b"\0") for r in summed]


class SharedStop:
    """A session's stop flag (``threading.Event``'s methods), the same on every rank:
    ``is_set`` is a collective that carries rank 0's flag, so every rank must check it
    at the same points, as the same turn on every rank does."""

    def __init__(self, link: Link):
        self._link, self._flag = link, threading.Event()

    def set(self) -> None:
        self._flag.set()

    def clear(self) -> None:
        self._flag.clear()

    def is_set(self) -> bool:
        mine = self._link.rank == 0 and self._flag.is_set()
        return self._link.total(int(mine)) > 0


_link: Link | None = None


def start() -> Link | None:
    """The link of this process when ``mlx.launch`` (or kvchat/cli/ring.py) started it as
    one rank of several (call it only then: it joins the group the environment names)."""
    global _link
    group = mx.distributed.init()
    if group.size() < 2:
        return None
    _link = Link(group)
    return _link


def current() -> Link | None:
    return _link


def linked() -> Link:
    """This rank's link (rank 0 of a sharded run asks: :func:`start` made it)."""
    if _link is None:
        raise SessionError("This is not a sharded run: no other ranks to send to.")
    return _link


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
    :class:`Session`; kvchat/sessions.py picks).

    The ranks make it together: a kind other than ``standard`` runs the model once to
    see that it fits (:func:`~kvchat.engine.caches.kinds.make_cache`), a collective here.
    """
    settings = settings or GenerationSettings()
    link = linked()
    link.broadcast(
        {"op": "new", "kind": parse_kind(kind).name, "system": system, "settings": asdict(settings)}
    )
    session = Session(lm, kind=kind, system=system, settings=settings)
    return standing_in(DistributedSession(link, bind(session, link)).count_bytes())


class DistributedSession:
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

    def count_bytes(self) -> DistributedSession:
        """Ask every rank for its cache bytes (into ``rank_bytes``)."""
        self._send("bytes")
        self.rank_bytes = self._link.per_rank(self.local.cache_bytes)
        return self

    def __getattr__(self, name: str) -> Any:
        if name in UNSHARED:
            raise SessionError(
                f"A sharded run cannot {name.replace('_', ' ')} yet; run "
                "this session on one machine for that."
            )
        return getattr(self.local, name)

    def _send(self, op: str, **fields: Any) -> None:
        self._link.broadcast({"op": op, **fields})

    def _turn(self, op: str, **fields: Any) -> Turn:
        self._send(op, settings=asdict(self.local.settings), **fields)
        events: Turn = perform(self.local, {"op": op, **fields}, self._link)
        return self._counted(events)

    def _counted(self, events: Iterator[Event]) -> Turn:
        yield from events
        self.count_bytes()

    def send(self, text: str) -> Turn:
        return self._turn("send", text=text)

    def regenerate(self, index: int | None = None) -> Turn:
        return self._turn("regenerate", index=index)

    def edit(self, index: int, text: str) -> Turn:
        return self._turn("edit", index=index, text=text)

    def _then_count(self, op: str, call: Callable[[], T], **fields: Any) -> T:
        """Send ``op``, make ``call()`` here, then count every rank's cache bytes."""
        self._send(op, **fields)
        result = call()
        self.count_bytes()
        return result

    def undo(self, turns: int = 1) -> None:
        self._then_count("undo", lambda: self.local.undo(turns), turns=turns)

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


def standing_in(session: DistributedSession) -> Session:
    """Rank 0's :class:`DistributedSession`, handed out where a :class:`Session` goes (the
    TUI's tabs, ``ask``): it sends the calls that change the cache to every rank, and
    every other attribute is its local session's."""
    return cast(Session, session)


def perform(session: Session, op: Op, link: Link) -> Any:
    """Run ``op`` on ``session``: what rank 0 and the followers both do."""
    name = op["op"]
    if "settings" in op:
        session.settings = GenerationSettings(**op["settings"])
    if name in ("send", "regenerate", "edit"):
        events = (
            session.send(op["text"])
            if name == "send"
            else session.regenerate(op["index"])
            if name == "regenerate"
            else session.edit(op["index"], op["text"])
        )
        return _watched(events, link)
    if name == "undo":
        return session.undo(op["turns"])
    if name == "reset":
        return session.reset()
    if name == "kind":
        return session.set_kind(op["kind"])
    if name == "trim":
        return session.trim_history(op["max_tokens"])
    if name == "system":
        return session.set_system(op["text"])
    raise OpError(f"The ranks are out of step: {name!r} is not a session operation.")


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
