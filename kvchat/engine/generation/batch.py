"""How one decode step runs the model for several sequences: the forward backends.

:class:`Merged` holds the caches of sequences that decode together in one of
mlx-lm's batch caches (``BatchKVCache``, ``ArraysCache`` for recurrent layers),
merged when a sequence joins and extracted back into its own cache objects when
it leaves, as ``mlx_lm.generate.BatchGenerator`` does. :func:`separate` runs
sequences whose caches stay apart: through the CPU fast path's batched step
where it exists and takes them, else one forward pass each.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from kvchat.engine.generation.sequence import Sequence


def blocker(model: nn.Module, cache: list[Any], kind: str) -> str | None:
    """Why ``cache`` cannot join a merged batch (the cache kind's name, or the model's
    type when its layers do not take mlx-lm's batch caches), or None."""
    odd = [c for c in cache if not (type(c) is KVCache or isinstance(c, ArraysCache))]
    if odd:
        return kind if kind != "standard" else type(odd[0]).__name__
    if not merges(model):
        return f"model {getattr(model, 'model_type', type(model).__name__)}"
    return None


_merges: dict[int, bool] = {}  # by id(model): whether a merged batch decodes as alone


def merges(model: nn.Module) -> bool:
    """Whether ``model`` decodes a merged batch as it decodes each row alone, found out
    once with a probe (two short sequences of different lengths): some architectures'
    attention does not take a batch cache's mask, and must not be fed one."""
    key = id(model)
    if key not in _merges:
        _merges[key] = _probe(model)
        weakref.finalize(model, _merges.pop, key, None)
    return _merges[key]


def _probe(model: nn.Module) -> bool:
    """Two sequences of 3 and 1 tokens decode one token merged (the shorter one padded);
    each row must agree with the same sequence decoded in a batch of two copies of
    itself, merged without padding. Both are batches of two, so their matrix products
    run the same kernels: where MLX runs a batch's float32 products at reduced precision
    and one row's at full precision (TF32 on NVIDIA and M5-class GPUs, MLX_ENABLE_TF32),
    a row alone differs from any batch by about 1e-3, and comparing with it refused
    every model there. A mask that attention ignores shows in the padded row."""
    try:
        caches = []
        for prompt in ([1, 2, 3], [4]):
            cache = (
                model.make_cache()
                if hasattr(model, "make_cache")
                else [KVCache() for _ in model.layers]
            )
            if not all(type(c) is KVCache or isinstance(c, ArraysCache) for c in cache):
                return False
            model(mx.array([prompt]), cache=cache)
            caches.append(cache)

        def step(pair: list[list[Any]]) -> mx.array:
            # merging copies each cache into new arrays: the probe's own stay as they were
            batch = [merge([c[i] for c in pair]) for i in range(len(pair[0]))]
            logits: mx.array = model(mx.array([[5], [5]]), cache=batch)[:, -1]
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

        together = step(caches)
        for row, cache in zip(together, caches):
            twin = step([cache, cache])[0]
            if cast(float, mx.abs(row - twin).max().item()) > 1e-3:
                return False
    except Exception:  # noqa: BLE001  a model whose layers cannot take a batch cache
        return False
    return True


class Merged:
    """Sequences decoding in one forward pass over one batch cache, row i for ``seqs[i]``."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = list(seqs)
        layers = len(seqs[0].state.cache)
        self.cache = [merge([s.state.cache[i] for s in seqs]) for i in range(layers)]
        _lend(self.cache, seqs)

    def join(self, seqs: list[Sequence]) -> None:
        """Add ``seqs`` (their own caches hold their prompts) at the end of the batch."""
        for i, layer in enumerate(self.cache):
            layer.extend(merge([s.state.cache[i] for s in seqs]))
        _lend(self.cache, seqs)
        self.seqs.extend(seqs)

    def step(self, model: nn.Module, tokens: mx.array | None = None) -> mx.array:
        """Feed every row's pending token (one a row: a merged batch folds no prompt in),
        or ``tokens`` ``(B, 1)`` (sampled, maybe not yet evaluated); the logits ``(B, V)``."""
        if tokens is None:
            tokens = mx.array([s.feeding for s in self.seqs])
        logits: mx.array = model(tokens, cache=self.cache)[:, -1, :]
        return logits

    def leave(self, gone: list[Sequence]) -> None:
        """Give ``gone`` their caches back (and, when one row is left, that one too)."""
        rows = [i for i, s in enumerate(self.seqs) if s in gone]
        for i in rows:
            give_back(self.cache, i, self.seqs[i].state.cache)
        kept = [i for i in range(len(self.seqs)) if i not in rows]
        self.seqs = [self.seqs[i] for i in kept]
        if len(self.seqs) == 1:
            give_back(self.cache, kept[0], self.seqs[0].state.cache)
            self.seqs = []
        elif rows and self.seqs:
            index = mx.array(kept)
            for layer in self.cache:
                layer.filter(index)
        if not self.seqs:
            self.cache = []


def merge(layers: list[Any]) -> Any:
    if isinstance(layers[0], ArraysCache):
        return ArraysCache.merge(layers)
    return BatchKVCache.merge(layers)


def _lend(batch: list[Any], seqs: list[Sequence]) -> None:
    """The batch holds the sequences' keys and values now: let go of their own copies
    (they come back at :func:`give_back`), so a batch does not hold every cache twice.
    A lent cache holds nothing, and says so (offset 0): one that kept its offset
    without its keys was copied by a new session forked from it as if it held the
    prefix (issue 37)."""
    mx.eval([c.state for c in batch])
    for seq in seqs:
        for mine in seq.state.cache:
            if isinstance(mine, ArraysCache):
                mine.cache = [None] * len(mine.cache)
            else:
                mine.offset = 0  # first: a reader on another thread never sees the
                mine.keys = mine.values = None  # offset without the keys it counts


def give_back(batch: list[Any], row: int, own: list[Any]) -> None:
    """Put row ``row`` of the batch cache into the sequence's own cache objects."""
    for layer, mine in zip(batch, own):
        got = layer.extract(row)
        if isinstance(mine, ArraysCache):
            mine.cache, mine.left_padding, mine.lengths = got.cache, None, None
        else:
            mine.keys, mine.values, mine.offset = got.keys, got.values, got.offset
    mx.eval([c.state for c in own])
