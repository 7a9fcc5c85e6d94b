"""MLX's own decoding path (every device but the CPU fast path's): sequences whose
caches merge decode in one forward pass over mlx-lm's batch caches
(:class:`~kvchat.engine.generation.batch.Merged`), the others (caches that cannot batch,
a model that fails the merge probe, a lone row) one forward pass each; and each step
feeds the tokens it samples before they are read (:func:`feed_ahead`), so that the next
step computes while they are read and posted, as mlx-lm's ``generate_step`` does.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from kvchat.engine.generation.batch import Merged, blocker
from kvchat.engine.generation.paths.base import Path, Row, alone
from kvchat.engine.generation.sequence import Sequence, sample_rows


class Batched(Path):
    """Rows merged into one batch cache where they can, the others apart; fed ahead."""

    def join(self, model: nn.Module, ready: list[Sequence]) -> None:
        """Merge the caches that batch (two or more rows: a lone one decodes on its own
        cache); the others decode apart, their turns told why."""
        for seq in ready:
            seq.state.not_batched = blocker(model, seq.state.cache, seq.request.kind)
        mergeable = [s for s in [*self.apart, *ready] if s.state.not_batched is None]
        self.apart += [s for s in ready if s not in mergeable]
        if self.merged:
            if any(s in mergeable for s in ready):
                self.merged.join([s for s in ready if s in mergeable])
        elif len(mergeable) > 1:
            self.apart = [s for s in self.apart if s not in mergeable]
            self.merged = Merged(mergeable)
        else:
            self.apart += [s for s in mergeable if s not in self.apart]

    def forward(self, model: nn.Module) -> list[Row]:
        """The logits fed ahead by the step before, where it did (for every row: a step
        is fed ahead for all or none), else a forward pass for the merged rows and one for
        each row apart."""
        if self.fed_ahead():
            rows = [(s, cast(mx.array, s.state.ahead)) for s in self.seqs]
            for seq in self.seqs:
                seq.state.ahead = None
            return rows
        rows = []
        if self.merged:
            logits = self.merged.step(model)
            rows += [(s, logits[i : i + 1]) for i, s in enumerate(self.merged.seqs)]
        return rows + alone(model, self.apart)

    def width(self, seq: Sequence) -> int:
        return len(self.merged.seqs) if self.merged and seq in self.merged.seqs else 1

    def evaluate(
        self, model: nn.Module, rows: list[Row], sampled: mx.array, newcomers: bool
    ) -> None:
        """Fed ahead where every row's cache is plain (``KVCache``, from which a sequence
        that ends has that token trimmed again; other kinds trim differently, or not at
        all: recurrent layers' state) and nobody waits to join (a step fed ahead has no
        row for a newcomer): the sampled tokens are fed, not read, and the step's graph
        is computed while the core goes on. Else as every path."""
        if newcomers or not all(type(c) is KVCache for s in self.seqs for c in s.state.cache):
            super().evaluate(model, rows, sampled, newcomers)
            return
        feed_ahead(model, self.merged, self.apart, sampled, [s for s, _ in rows])
        ahead = [a for s, _ in rows for a in (s.state.ahead, s.state.drawn) if a is not None]
        mx.async_eval(sampled, ahead)

    def leave(self, ended: list[Sequence]) -> None:
        """Ended rows' caches extracted from the batch (the last row left decodes on its
        own cache again); a token fed ahead trimmed again (not in the ledger)."""
        if self.merged:
            gone = [s for s in ended if s in self.merged.seqs]
            if gone:
                stay = [s for s in self.merged.seqs if s not in gone]
                self.merged.leave(gone)
                if not self.merged.seqs:
                    self.apart += stay
                    self.merged = None
        super().leave(ended)
        for seq in ended:
            if seq.state.ahead is not None:
                trim_prompt_cache(seq.state.cache, 1)
                seq.state.ahead = seq.state.drawn = None


def feed_ahead(
    model: nn.Module,
    merged: Merged | None,
    apart: list[Sequence],
    tokens: mx.array,
    order: list[Sequence],
) -> None:
    """Feed each decoding sequence the token just sampled for it (``tokens[i]`` for
    ``order[i]``, not evaluated yet), keeping the logits after it as the sequence's
    ``state.ahead``; for those that :meth:`~kvchat.engine.generation.sequence.Sequence.draws_ahead`,
    sample the token after from them too (``state.drawn``), so that
    what the next step reads was computed by this one's graph, while the next computes
    (reading a token sampled at the head of the next step's graph waits for that whole
    graph where the device signals a graph's outputs when it completes)."""
    row = {seq: i for i, seq in enumerate(order)}
    if merged and merged.seqs:
        # a step lists its rows with the batch's together, in the batch's order:
        # checked, by identity, before the batch's tokens are cut from them
        first = row[merged.seqs[0]]
        if order[first : first + len(merged.seqs)] != merged.seqs:
            raise RuntimeError("A step's rows are not its merged batch's, in its order.")
        logits = merged.step(model, tokens[first : first + len(merged.seqs)][:, None])
        for i, seq in enumerate(merged.seqs):
            seq.state.ahead = logits[i : i + 1]
    for seq in apart:
        i = row[seq]
        seq.state.ahead = model(tokens[i : i + 1].reshape(1, 1), cache=seq.state.cache)[:, -1, :]
    drawing = [seq for seq in order if seq.draws_ahead()]
    if drawing:
        drawn = sample_rows([(seq, cast(mx.array, seq.state.ahead)) for seq in drawing])
        for i, seq in enumerate(drawing):
            seq.state.drawn = drawn[i : i + 1]
