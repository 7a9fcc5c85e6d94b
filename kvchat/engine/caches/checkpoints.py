"""Checkpoints: copies of the cache layers that cannot be cut back, kept at turn boundaries.

A sliding-window layer that has wrapped (``RotatingKVCache``) and a recurrent
state (``ArraysCache``: Mamba, LFM2's convolutions, the state half of a
Falcon-H1 ``CacheList``) cannot return to an earlier token: without help,
every undo, regenerate or edit re-evaluates the whole transcript. So a
session keeps, at the end of each prompt and of each reply, a copy of just
those layers with the ledger length it belongs to. Going back to token ``n``
then restores the nearest checkpoint at or before ``n``, trims the other
layers (plain key/value caches, which can be cut anywhere) to the same
length, and evaluates only what follows. Checkpoints are bounded in number
and in bytes, newest kept first; a model without such layers keeps none.
They are saved with the session (kvchat/store/checkpoint_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

from kvchat.engine.caches.kinds import allocated_bytes, copy_cache, trim_to
from kvchat.engine.caches.trees import flatten

MAX_CHECKPOINTS = 16
CHECKPOINT_BUDGET = 512 << 20  # bytes of checkpoints one session keeps at most

Path = tuple[int, ...]  # a layer's place: (layer,) or (layer, part of a CacheList)


@dataclass(frozen=True)
class Checkpoint:
    """The non-trimmable layers of a cache as they stood when it held ``tokens`` tokens."""

    tokens: int
    layers: dict[Path, Any]
    nbytes: int

    @classmethod
    def of(cls, tokens: int, layers: dict[Path, Any]) -> Checkpoint:
        """A checkpoint of ``layers`` (evaluated now) at ``tokens`` tokens."""
        arrays = [
            v
            for layer in layers.values()
            for _, v in flatten(layer.state)
            if isinstance(v, mx.array)
        ]
        mx.eval(arrays)
        return cls(tokens, layers, sum(a.nbytes for a in arrays))


class Checkpoints:
    """A session's checkpoints, oldest first."""

    def __init__(self) -> None:
        self.kept: list[Checkpoint] = []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def clear(self) -> None:
        self.kept = []

    def keep(self, cache: list[Any], tokens: int) -> None:
        """Checkpoint ``cache``, which holds ``tokens`` tokens (nothing if it needs none,
        or if one checkpoint of it would be over the whole budget)."""
        paths = stateful_paths(cache)
        if not paths or any(c.tokens == tokens for c in self.kept):
            return
        parts = dict(layer_parts(cache))
        if allocated_bytes([parts[p] for p in paths]) > CHECKPOINT_BUDGET:
            return
        self.adopt(
            [*self.kept, Checkpoint.of(tokens, {p: copy_cache([parts[p]])[0] for p in paths})]
        )

    def adopt(self, points: list[Checkpoint]) -> None:
        """Keep ``points`` (as read from disk), within the bounds, newest first."""
        self.kept = sorted(points, key=lambda c: c.tokens)
        while len(self.kept) > MAX_CHECKPOINTS or self.nbytes > CHECKPOINT_BUDGET:
            self.kept.pop(0)

    def forget_after(self, tokens: int) -> None:
        """Drop the checkpoints past ``tokens`` (the ledger was cut there)."""
        self.kept = [c for c in self.kept if c.tokens <= tokens]

    def restore(self, cache: list[Any], n: int) -> int | None:
        """Put ``cache`` back to the nearest checkpoint at or before token ``n``; return its
        token count, or None (cache unchanged) when no checkpoint can serve."""
        for point in reversed(self.kept):
            if point.tokens <= n and _restore(cache, point):
                return point.tokens
        return None


def what_cannot_go_back(cache: list[Any]) -> str | None:
    """ "a sliding window", "a recurrent state" or both, for ``cache``; None for neither."""
    kinds = [
        name
        for name, cls in (("a sliding window", RotatingKVCache), ("a recurrent state", ArraysCache))
        if any(isinstance(part, cls) for _, part in layer_parts(cache))
    ]
    return " and ".join(kinds) or None


def stateful_paths(cache: list[Any]) -> list[Path]:
    """Where ``cache``'s sliding-window and recurrent-state layers are."""
    return [p for p, part in layer_parts(cache) if isinstance(part, (RotatingKVCache, ArraysCache))]


def layer_parts(cache: list[Any]) -> list[tuple[Path, Any]]:
    """Every layer of ``cache`` with its place, the parts of a ``CacheList`` one by one."""
    out: list[tuple[Path, Any]] = []
    for i, layer in enumerate(cache):
        if isinstance(layer, CacheList):
            out.extend(((i, j), part) for j, part in enumerate(layer.caches))
        else:
            out.append(((i,), layer))
    return out


def _restore(cache: list[Any], point: Checkpoint) -> bool:
    """Trim every other layer to ``point.tokens`` and put copies of the checkpoint's
    layers in place; False (cache unchanged) when the other layers cannot get there."""
    others = [part for path, part in layer_parts(cache) if path not in point.layers]
    if others and not trim_to(others, point.tokens):
        return False
    for path, layer in point.layers.items():
        _set(cache, path, copy_cache([layer])[0])
    return True


def _set(cache: list[Any], path: Path, layer: Any) -> None:
    if len(path) == 1:
        cache[path[0]] = layer
    else:
        parts = list(cache[path[0]].caches)
        parts[path[1]] = layer
        cache[path[0]].caches = parts
