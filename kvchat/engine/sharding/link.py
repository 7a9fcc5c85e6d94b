"""The link between the ranks of a sharded run: engine operations out from rank 0, short
reports back, and the shared stop flag.

An operation is a small JSON object (``{"op": name, ...its fields}``) that rank 0
sends to every rank with ``mx.distributed.all_sum`` over a uint8 buffer, its length
first; after some operations every rank sends back a number or a row of bytes, gathered
the same way. :func:`start` joins the ring the environment names. It needs only MLX,
so a rank joins as soon as it starts, before it imports mlx-lm (and with it
transformers, seconds on a busy machine): the ranks reach the ring within their
start-up jitter of each other, which keeps MLX's retries of a refused connection
(after 1 s, then 2 s, 4 s...) to the first.
"""

from __future__ import annotations

import json
import threading
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvchat.engine.conversation.events import SessionError

Op = dict[str, Any]  # an engine operation, as JSON has it: {"op": name, ...its fields}

OPS = frozenset(
    {
        "model",
        "new",
        "load",
        "send",
        "regenerate",
        "edit",
        "undo",
        "restore",
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
