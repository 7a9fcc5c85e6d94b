"""What every decoding path does the same way: a step's prompt chunks, then one decode
step of its rows (feed, sample, post).

A :class:`Path` holds the sequences decoding on one core and runs their forward passes;
the core has one, chosen from how its model runs (``paths.choose``). A path says how its
prompts go in (:attr:`Path.paced`, :attr:`Path.folds`, :attr:`Path.opens`,
:meth:`Path.together`) and how its rows run (:meth:`Path.join`, :meth:`Path.forward`,
:meth:`Path.evaluate`, :meth:`Path.leave`); :meth:`Path.prefill` and :meth:`Path.decode`
are the rest, written once here, and the core calls only those two, :meth:`Path.join`,
:meth:`Path.leave` and :meth:`Path.fed_ahead`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from kvchat.engine.generation import prefill
from kvchat.engine.generation.batch import Merged, merges
from kvchat.engine.generation.pace import Pace
from kvchat.engine.generation.sequence import Sequence, sample_rows

Row = tuple[Sequence, mx.array]  # a decoding sequence and its logits (1, V) after what it fed


class Path(ABC):
    """The sequences decoding on one core, and how a step runs them: those in
    :attr:`merged` in one forward pass over a batch cache, those :attr:`apart` each on
    its own cache."""

    paced = True  # a step's prompt tokens are fewer while rows decode (pace.py)
    folds = False  # the decode step takes short prompts whole (prefill.folded)
    # the decode step feeds a prompt's last token with the other rows, its logits the
    # prompt's end; else the prefill feeds it alone and samples the first token itself
    opens = True

    def __init__(self) -> None:
        self.merged: Merged | None = None  # a batch cache holding its merged rows, if any
        self.apart: list[Sequence] = []  # decoding on their own caches

    @property
    def seqs(self) -> list[Sequence]:
        """Its decoding sequences, in the order of a step's rows: the merged ones first."""
        return [*self.merged.seqs, *self.apart] if self.merged else self.apart

    @abstractmethod
    def join(self, model: nn.Module, ready: list[Sequence]) -> None:
        """Take ``ready`` (their prompts in but maybe the last token) as decoding rows."""

    @abstractmethod
    def forward(self, model: nn.Module) -> list[Row]:
        """Feed each row its pending tokens (:attr:`Sequence.feeding`), lazily; each row's
        logits after them, in the order of :attr:`seqs`."""

    def leave(self, ended: list[Sequence]) -> None:
        """Let ``ended`` go, their caches their own and holding their ledgers (those not
        here: nothing to do)."""
        self.apart = [s for s in self.apart if s not in ended]

    def width(self, seq: Sequence) -> int:
        """The rows of the forward pass that decodes ``seq``."""
        return 1

    def together(self, model: nn.Module, chunks: list[prefill.Chunk]) -> bool:
        """Whether ``chunks`` go in one forward pass: on plain caches of a model whose
        rows merge."""
        plain = all(type(c) is KVCache for seq, _ in chunks for c in seq.state.cache)
        return plain and merges(model)

    def evaluate(
        self, model: nn.Module, rows: list[Row], sampled: mx.array, newcomers: bool
    ) -> None:
        """Compute the step: the tokens ``sampled`` from ``rows``, and the caches that took
        the tokens fed. ``newcomers``: sequences wait to join."""
        mx.eval(sampled, [c.state for s in self.apart for c in s.state.cache], self._batch())

    def _batch(self) -> list[object]:
        return [c.state for c in self.merged.cache] if self.merged else []

    def fed_ahead(self) -> bool:
        """Whether the step before fed its rows' tokens ahead (nobody joins this step)."""
        return any(s.state.ahead is not None for s in self.seqs)

    def prefill(
        self, model: nn.Module, joining: list[Sequence], pace: Pace
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Evaluate about one chunk's worth of prompt tokens among ``joining`` (fewer while
        rows decode, on a paced path). Returns the sequences ready to decode (their
        prompts in, or all but the last token, which the decode step feeds), and those
        that ended (stopped, or ended by the first token the prefill sampled)."""
        gone = [s for s in joining if s.halted() and s.prompt_left() > 0]
        live = [s for s in joining if s not in gone]
        if not live:
            return [], gone
        budget = pace.budget(max(1, live[0].request.prefill_step), self.paced and bool(self.seqs))
        folded = prefill.folded(live, budget) if self.folds else []
        for seq in folded:
            prefill.started(seq)
        live = [s for s in live if s not in folded]
        used = sum(s.prompt_left() for s in folded)
        chunks = prefill.plan(live, max(1, budget - used)) if live else []
        with pace.timed(sum(len(t) for _, t in chunks)):
            prefill.feed(model, chunks, self.together(model, chunks))
        ready = list(folded)
        for seq in live:
            if prefill.body_left(seq):
                continue
            if seq.halted() and seq.request.prompt:
                gone.append(seq)  # stopped at the end of its prefill
            elif self.opens and seq.prompt_left() == 1:
                prefill.started(seq)  # its last token goes in with this step's decode
                ready.append(seq)
            else:
                prefill.first_token(model, seq)
                (gone if seq.ended() else ready).append(seq)
        return ready, gone

    def decode(self, model: nn.Module, newcomers: bool) -> list[Sequence]:
        """One decode step of every row (fed ahead by the step before, or fed here), its
        tokens sampled and posted; the sequences that ended. ``newcomers``: sequences
        wait to join."""
        if not self.seqs:  # prompts going in, nobody decoding yet
            return []
        rows = self.forward(model)
        for seq, _ in rows:
            seq.state.batch_peak = max(seq.state.batch_peak, self.width(seq), 1)
        for seq, _ in rows:  # fed: their keys and values are in the cache (the processors
            seq.state.ledger.extend(seq.feeding)  # that sample the next token see them too)
        opening = [s for s, _ in rows if not s.state.tokens]  # fed their prompt's last token
        sampled = sample_rows(rows)  # or drawn by the step before (State.drawn)
        self.evaluate(model, rows, sampled, newcomers)
        for seq, row in rows:
            if seq in opening:
                seq.opened(row)
        if [s for s, _ in rows] != self.seqs:
            raise RuntimeError("The rows of a decoding path changed while its step ran.")
        ended = []
        for (seq, _), token in zip(rows, cast(list[int], sampled.tolist()), strict=True):
            seq.state.tokens.append(token)
            seq.channel.post(token)
            if seq.ended():
                ended.append(seq)
        return ended


def alone(model: nn.Module, seqs: list[Sequence]) -> list[Row]:
    """Each sequence's pending tokens fed on its own cache, a forward pass each (lazy)."""
    return [(s, model(mx.array([s.feeding]), cache=s.state.cache)[:, -1, :]) for s in seqs]
