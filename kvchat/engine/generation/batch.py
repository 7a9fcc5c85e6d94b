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

from kvchat.engine.cpu import decode_batch, native
from kvchat.engine.generation.sequence import Sequence, sample_rows


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


def separate_batches(fast_path: Any) -> bool:
    """Whether decoding sequences keep their caches apart and go through the CPU fast
    path's batched numpy step (``fast_path``, the model's, decodes in numpy), rather
    than merge into mlx-lm's batch caches."""
    return fast_path is not None and fast_path.decodes


def decoding_path(lm: Any) -> str:
    """One line: how loaded model ``lm``'s core decodes a batch of sequences, and why."""
    if getattr(lm, "group", None) is not None:
        return "one sequence at a time (a sharded model: every rank runs the same steps)"
    fast = getattr(lm, "fast_path", None)
    if separate_batches(fast):
        return (
            "CPU fast path: its batched numpy step decodes every row at once, each on its "
            f"own cache (the model's decoding step runs whole in numpy; {native.route()})"
        )
    if fast is None:
        why = f"CPU fast path {getattr(lm, 'fast_path_off', 'off')}"
    elif not fast.on:
        why = "CPU fast path switched off for this model"
    else:
        why = f"no numpy decoding step: {fast.step}"
    if merges(lm.model):
        return f"MLX: rows merged into mlx-lm's batch caches, one forward pass a step ({why})"
    return (
        "MLX, one forward pass a row: this model does not decode a merged batch as it "
        f"decodes each row alone ({why})"
    )


def separate(model: nn.Module, seqs: list[Sequence], fast_path: Any) -> list[mx.array]:
    """Feed each sequence's pending tokens (:attr:`Sequence.feeding`) into its own cache;
    each one's logits after its last ``(1, V)``: on the CPU fast path through its numpy
    step, one sequence too (a short prompt folded into the step computes the output
    projection of its last token only, where the model's forward pass would leave the
    others' to MLX)."""
    if separate_batches(fast_path):
        logits = decode_batch(model, [s.feeding for s in seqs], [s.cache for s in seqs])
        if logits is not None:
            return [logits[i : i + 1] for i in range(len(seqs))]
    return [model(mx.array([s.feeding]), cache=s.cache)[:, -1, :] for s in seqs]


def feeds_ahead(fast_path: Any, decoding: list[Sequence]) -> bool:
    """Whether a decode step of ``decoding`` also feeds the tokens it samples, before they
    are read, so that the next step computes while this one's tokens are read and posted
    (as mlx-lm's ``generate_step`` does): on MLX's own path (the CPU fast path's numpy
    step computes as it goes) and on plain caches (``KVCache``), from which a sequence
    that ends has that token trimmed again (other kinds trim differently, or not at all:
    recurrent layers' state). The core also asks that nobody waits to join (a step fed
    ahead has no row for a newcomer) and that the model is not sharded."""
    return not separate_batches(fast_path) and all(
        type(c) is KVCache for s in decoding for c in s.cache
    )


def feed_ahead(
    model: nn.Module,
    merged: Merged | None,
    alone: list[Sequence],
    tokens: mx.array,
    order: list[Sequence],
) -> None:
    """Feed each decoding sequence the token just sampled for it (``tokens[i]`` for
    ``order[i]``, not evaluated yet), keeping the logits after it as the sequence's
    :attr:`~.sequence.Sequence.ahead`; for those that :meth:`~.sequence.Sequence.draws_ahead`,
    sample the token after from them too (:attr:`~.sequence.Sequence.drawn`), so that
    what the next step reads was computed by this one's graph, while the next computes
    (reading a token sampled at the head of the next step's graph waits for that whole
    graph where the device signals a graph's outputs when it completes)."""
    row = {seq: i for i, seq in enumerate(order)}
    if merged and merged.seqs:
        # the core lists a step's rows with the batch's together, in the batch's order:
        # checked, by identity, before the batch's tokens are cut from them
        first = row[merged.seqs[0]]
        if order[first : first + len(merged.seqs)] != merged.seqs:
            raise RuntimeError("A step's rows are not its merged batch's, in its order.")
        logits = merged.step(model, tokens[first : first + len(merged.seqs)][:, None])
        for i, seq in enumerate(merged.seqs):
            seq.ahead = logits[i : i + 1]
    for seq in alone:
        i = row[seq]
        seq.ahead = model(tokens[i : i + 1].reshape(1, 1), cache=seq.cache)[:, -1, :]
    drawing = [seq for seq in order if seq.draws_ahead()]
    if drawing:
        drawn = sample_rows([(seq, cast(mx.array, seq.ahead)) for seq in drawing])
        for i, seq in enumerate(drawing):
            seq.drawn = drawn[i : i + 1]


class Merged:
    """Sequences decoding in one forward pass over one batch cache, row i for ``seqs[i]``."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = list(seqs)
        self.cache = [merge([s.cache[i] for s in seqs]) for i in range(len(seqs[0].cache))]
        _lend(self.cache, seqs)

    def join(self, seqs: list[Sequence]) -> None:
        """Add ``seqs`` (their own caches hold their prompts) at the end of the batch."""
        for i, layer in enumerate(self.cache):
            layer.extend(merge([s.cache[i] for s in seqs]))
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
            give_back(self.cache, i, self.seqs[i].cache)
        kept = [i for i in range(len(self.seqs)) if i not in rows]
        self.seqs = [self.seqs[i] for i in kept]
        if len(self.seqs) == 1:
            give_back(self.cache, kept[0], self.seqs[0].cache)
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
        for mine in seq.cache:
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
