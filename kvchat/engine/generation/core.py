"""The generation core of a loaded model: its step loop, the only place replies are decoded.

A session's turn submits a :class:`~.sequence.Sequence` with :meth:`GenerationCore.run`
and reads its messages (``Prefill`` progress, sampled token ids, a final
``Left``). Each step of the loop, under the device gate (:mod:`.gate`):

1. joining sequences evaluate their prompts in chunks, one chunk's worth of tokens a
   step whoever they are, fewer while others decode (:mod:`.pace`): a long paste
   does not freeze the others;
   several sequences' chunks go in one forward pass where their caches merge
   (:mod:`.prefill`); a prompt all in but its last token decodes from this step on:
   that token is fed by the decode step, with the other rows, and its logits give
   the first token (a sharded core evaluates it alone and samples the first token
   in the prefill); on the CPU fast path a short prompt goes whole into the decode
   step instead (:func:`.prefill.folded`), its tokens rows of the same numpy pass;
2. every decoding sequence, those just joined included, feeds its last sampled
   token and samples the next, in one forward pass for those whose caches merge
   (:class:`~.batch.Merged`), the others (caches that cannot batch, or the CPU fast
   path's separate rows) beside; on MLX's path the step also feeds the tokens it
   samples before they are read (:func:`~.batch.feeds_ahead`) and samples the next
   ones from what that gives, in the same graph, so the next step computes while
   they are read and posted, and newcomers join the step after;
3. sequences that ended (an end token, the length limit, a stop, a consumer gone)
   leave with their caches extracted back, and the rest go on.

A batch of one is the same loop. The loop runs on its own thread (ended at interpreter
exit: :mod:`.per_model`); a sharded model's core runs it on the caller's thread, one
sequence at a time, so every rank does the same operations in the same order.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from kvchat.engine.conversation.events import Prefill
from kvchat.engine.generation import invariant, prefill
from kvchat.engine.generation.batch import (
    Merged,
    blocker,
    feed_ahead,
    feeds_ahead,
    merges,
    separate,
    separate_batches,
)
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.pace import Pace
from kvchat.engine.generation.sequence import Left, Sequence, sample_rows
from kvchat.engine.generation.threads import clear_mlx_at_thread_end

GATHER_S = 0.005  # from idle, a step waits while turns keep arriving this close together
GATHER_MAX_S = 0.1  # or while announced turns (expect) are on their way, no longer than this


class GenerationCore:
    """Runs the forward passes of one model for every sequence submitted to it."""

    def __init__(self, model: nn.Module, *, threaded: bool = True, fast_path: Any = None):
        self._model = weakref.ref(model)  # the core never keeps an unloaded model alive
        self.threaded = threaded
        self.fast_path = fast_path  # the model's CPU fast path (kvchat.engine.cpu), if any
        self._cond = threading.Condition()
        self._joining: list[Sequence] = []  # submitted, prompt not all in the cache yet
        self._alone: list[Sequence] = []  # decoding on their own caches
        self._merged: Merged | None = None
        self._thread: threading.Thread | None = None
        self._expected: list[float] = []  # announced turns' deadlines (monotonic), see expect
        self._ending = False  # the interpreter is exiting: the loop's thread ends (end)
        self.pace = Pace()  # a step's prompt tokens while others decode
        self.debug = invariant.debugging()  # check every sequence's cache after each step

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    @property
    def _forward(self) -> nn.Module:
        """The model the loop's steps run (a step fails, and its sequences leave with
        the error, should it have been unloaded meanwhile)."""
        model = self._model()
        if model is None:
            raise RuntimeError("The model was unloaded while it was generating.")
        return model

    def expect(self) -> None:
        """Announce a turn that is being prepared (its prompt templated and tokenized) and will be
        submitted shortly: a first step from idle waits for it, up to :data:`GATHER_MAX_S`, so that
        turns sent at once (tabs, a server's clients) go in one pass rather than the first few alone
        and the rest a whole step later. One never submitted only expires."""
        with self._cond:
            self._expected.append(time.monotonic() + GATHER_MAX_S)

    def run(self, seq: Sequence) -> Generator[Prefill | int | Left, None, None]:
        """Submit ``seq`` and yield its messages until its :class:`Left`. Closing the
        iterator early cancels the sequence and returns once it has left (its cache
        and ledger agree again)."""
        if not self.threaded or GATE.held_here():
            yield from self._inline(seq)
            return
        with self._cond:
            self._joining.append(seq)
            if self._expected:
                self._expected.pop(0)
            self._start()
            self._cond.notify_all()
        try:
            while True:
                message = seq.messages.get()
                yield message
                if isinstance(message, Left):
                    return
        finally:
            if not seq.left.is_set():
                seq.cancelled.set()
                with self._cond:
                    self._cond.notify_all()
                seq.left.wait()

    def _inline(self, seq: Sequence) -> Iterator[Prefill | int | Left]:
        """The loop on the caller's thread, which holds the device gate (a sharded model's
        core, or a caller that has the model to itself): it steps every sequence of
        this core until ``seq`` leaves.

        Closed early (a stop, or the reader failed: on a sharded model, most often a
        collective of the shared stop flag after a rank was lost), ``seq`` leaves at
        once, between two steps, where its cache and ledger agree, its last sampled
        token not fed. No further step runs for it: a sharded model's forward pass
        waits on every rank, and after a lost rank it would never return."""
        with self._cond:
            self._joining.append(seq)
        try:
            while not seq.left.is_set():
                with GATE.step():
                    self._step()
                while not seq.messages.empty():
                    yield seq.messages.get()
        finally:
            if not seq.left.is_set():
                seq.cancelled.set()
                with GATE.step():
                    self._leave([seq])
            while not seq.messages.empty():
                seq.messages.get()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="kvchat-generation", daemon=True
            )
            self._thread.start()

    def end(self) -> None:
        """End the loop's thread now."""
        with self._cond:
            self._ending = True
            self._cond.notify_all()
        if (thread := self._thread) is not None:
            thread.join(5)

    def _loop(self) -> None:
        clear_mlx_at_thread_end()
        while True:
            with self._cond:
                if not self._cond.wait_for(self._called, timeout=30.0) or self._ending:
                    self._thread = None  # idle: the next submit starts a new thread
                    return
                self._gather()
            with GATE.step():
                self._step()

    def _gather(self) -> None:
        """From idle (nothing decoding, no prompt begun), let turns sent at once all join
        the first step: wait while announced turns (:meth:`expect`) are still on their
        way, or submissions keep coming, each within :data:`GATHER_S` of the one before
        (:data:`GATHER_MAX_S` at most), so their prompts go in one pass rather than the
        first alone and the rest a step later. A long prompt's later chunks do not wait.
        Called holding the condition."""
        if self._alone or self._merged_seqs() or any(s.fed for s in self._joining):
            return
        deadline = time.monotonic() + GATHER_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            held = len(self._joining)
            if self._awaited():
                self._cond.wait(min(GATHER_S, left))  # a submission notifies
            elif not self._cond.wait_for(self._arrival(held), min(GATHER_S, left)):
                return

    def _awaited(self) -> bool:
        """Whether an announced turn has yet to be submitted (expired ones dropped)."""
        now = time.monotonic()
        self._expected = [t for t in self._expected if t > now]
        return bool(self._expected)

    def _arrival(self, held: int) -> Callable[[], bool]:
        """Whether a sequence joined since there were ``held`` joining."""
        return lambda: len(self._joining) > held

    def _called(self) -> bool:
        """Whether the loop has work, or must end."""
        return self._ending or bool(self._joining or self._alone or self._merged_seqs())

    def _step(self) -> None:
        with self._cond:
            joining = list(self._joining)
        try:
            with mx.stream(generation_stream):
                decoding = [*self._alone, *self._merged_seqs()]
                if not any(s.ahead is not None for s in decoding):  # else they join next step
                    # a prompt all in decodes in this same step, its first token not waiting
                    self._join(self._prefill(joining, bool(decoding)))
                    decoding = [*self._alone, *self._merged_seqs()]
                ahead = self.threaded and not joining and feeds_ahead(self.fast_path, decoding)
                self._leave(self._decode(decoding, ahead))
                if self.debug:
                    invariant.check(list(self._joining), self._alone, self._merged)
        except Exception as error:  # noqa: BLE001  every sequence learns why, and leaves
            self._fail(error)

    def _prefill(self, joining: list[Sequence], others_decoding: bool) -> list[Sequence]:
        """Evaluate about one chunk's worth of prompt tokens among the joining sequences,
        fewer while others decode (:mod:`.prefill` chooses the chunks, several in one
        forward pass where their caches merge). Returns those ready to decode: on a
        threaded core, those whose prompt is in but its last token (the decode step
        feeds it); on a sharded one, those whose prompt is all in, their first token
        sampled here. Those that ended at once leave here."""
        live = []
        for seq in joining:
            if seq.halted() and seq.fed < len(seq.prompt):
                self._left(seq, Left(stopped=True))
            else:
                live.append(seq)
        if not live:
            return []
        # not paced on a sharded model: its ranks must cut the same chunks, whatever their clocks
        budget = self.pace.budget(max(1, live[0].prefill_step), others_decoding and self.threaded)
        # short prompts go whole into this step's numpy decode, beside the decoding rows
        folded = prefill.folded(live, budget) if self._folds() else []
        for seq in folded:
            if seq.fed == 0:
                seq.post(Prefill(0, len(seq.prompt)))
        live = [s for s in live if s not in folded]
        used = sum(len(s.prompt) - s.fed for s in folded)
        chunks = prefill.plan(live, max(1, budget - used)) if live else []
        plain = all(type(c) is KVCache for seq, _ in chunks for c in seq.cache)
        with self.pace.timed(sum(len(t) for _, t in chunks)):
            prefill.feed(self._forward, chunks, self.threaded and plain and merges(self._forward))
        ready = list(folded)
        for seq in live:
            if prefill.body_left(seq):
                continue
            if seq.halted() and seq.prompt:
                self._left(seq, Left(stopped=True))  # stopped at the end of its prefill
                continue
            if seq.fed == len(seq.prompt) - 1 and (
                self.threaded or separate_batches(self.fast_path)
            ):
                # the prompt's last token is fed by this step's decode, with the other rows
                # (merged, or of the numpy batched step): its logits are the prompt's end
                if seq.fed == 0:
                    seq.post(Prefill(0, len(seq.prompt)))
                ready.append(seq)
                continue
            if seq.fed < len(seq.prompt):
                prefill.feed_last(self._forward, seq)
            elif not seq.prompt and seq.on_prompt is not None and seq.logprobs is not None:
                seq.on_prompt(seq.logprobs)  # the logits kept from an earlier turn
            if seq.logprobs is None:  # the prompt is all in: its end's logits are kept
                raise RuntimeError("A prompt was evaluated without its last logits.")
            seq.tokens.append(cast(int, seq.sample(seq.logprobs[None]).item()))  # a token id
            seq.post(seq.tokens[-1])
            if seq.ended():
                self._left(seq, Left(stopped=seq.halted()))
            else:
                ready.append(seq)
        return ready

    def _folds(self) -> bool:
        """Whether the decode step takes whole short prompts: the CPU fast path's numpy
        step, which feeds several tokens a row (threaded cores only)."""
        return self.threaded and separate_batches(self.fast_path)

    def _decode(self, decoding: list[Sequence], ahead: bool) -> list[Sequence]:
        """One decode step for every decoding sequence (fed ahead by the step before, or
        fed here); those that ended. With ``ahead``, it feeds the tokens it samples too."""
        if not decoding:
            return []
        batch = list(self._merged_seqs())  # the rows of the batch cache, checked at the end
        rows: list[tuple[Sequence, mx.array]] = []
        if decoding[0].ahead is not None:  # all of them: a step is fed ahead for all or none
            rows = [(s, cast(mx.array, s.ahead)) for s in decoding]
            for seq in decoding:
                seq.ahead = None
        else:
            if self._merged and self._merged.seqs:
                logits = self._merged.step(self._forward)
                rows += [(s, logits[i : i + 1]) for i, s in enumerate(self._merged.seqs)]
            if self._alone:
                fed = separate(self._forward, self._alone, self.fast_path)
                rows += list(zip(self._alone, fed))
        merged = self._merged_seqs()
        for seq, _ in rows:  # the most rows of a forward pass that decoded it
            width = len(rows) if separate_batches(self.fast_path) else len(merged) * (seq in merged)
            seq.batch_peak = max(seq.batch_peak, width, 1)
        caches: list[Any] = []  # evaluated with the step (fed ahead: with the logits after it)
        if not ahead:
            caches += [c.state for s in self._alone for c in s.cache]
            caches += [c.state for c in self._merged.cache] if self._merged else []
        if not self.threaded:  # a sharded model: its collectives first, then the sampler's
            mx.eval([row for _, row in rows], caches)
        for seq, _ in rows:  # fed: their keys and values are in the cache (the processors
            seq.ledger.extend(seq.feeding)  # that sample the next token see them too)
        opening = [s for s, _ in rows if not s.tokens]  # fed their prompt's last token
        sampled = sample_rows(rows)  # or drawn by the step before (Sequence.drawn)
        if ahead:
            feed_ahead(self._forward, self._merged, self._alone, sampled, [s for s, _ in rows])
            mx.async_eval(
                sampled, [a for s, _ in rows for a in (s.ahead, s.drawn) if a is not None]
            )
        else:
            mx.eval(sampled, caches)
        for seq, row in rows:
            if seq in opening:
                seq.opened(row)
        if self._merged_seqs() != batch:
            raise RuntimeError("The rows of a merged batch changed while its step ran.")
        ended = []
        for (seq, _), token in zip(rows, cast(list[int], sampled.tolist()), strict=True):
            seq.tokens.append(token)
            seq.post(token)
            if seq.ended():
                ended.append(seq)
        return ended

    def _merged_seqs(self) -> list[Sequence]:
        return self._merged.seqs if self._merged else []

    def _leave(self, ended: list[Sequence]) -> None:
        if self._merged:
            gone = [s for s in ended if s in self._merged.seqs]
            if gone:
                stay = [s for s in self._merged.seqs if s not in gone]
                self._merged.leave(gone)
                if not self._merged.seqs:
                    self._alone += stay  # the last row decodes on its own cache again
                    self._merged = None
        for seq in ended:
            if seq in self._alone:
                self._alone.remove(seq)
            if seq.ahead is not None:  # the token it ended on was fed ahead: not in the ledger
                trim_prompt_cache(seq.cache, 1)
                seq.ahead = seq.drawn = None
            self._left(seq, Left(stopped=seq.halted()))

    def _join(self, ready: list[Sequence]) -> None:
        """Move sequences whose prompt is in from joining to decoding, merging the
        caches that batch."""
        for seq in ready:
            self._remove_joining(seq)
        batching = self.threaded and not separate_batches(self.fast_path)
        for seq in ready:  # a sharded model's sequences run one at a time, on every rank
            seq.not_batched = blocker(self._forward, seq.cache, seq.kind) if self.threaded else None
        mergeable = [s for s in [*self._alone, *ready] if batching and s.not_batched is None]
        self._alone += [s for s in ready if s not in mergeable]
        if self._merged:
            if any(s in mergeable for s in ready):
                self._merged.join([s for s in ready if s in mergeable])
        elif len(mergeable) > 1:
            self._alone = [s for s in self._alone if s not in mergeable]
            self._merged = Merged(mergeable)
        else:
            self._alone += [s for s in mergeable if s not in self._alone]

    def _left(self, seq: Sequence, message: Left) -> None:
        self._remove_joining(seq)
        seq.post(message)
        seq.left.set()

    def _remove_joining(self, seq: Sequence) -> None:
        with self._cond:
            if seq in self._joining:
                self._joining.remove(seq)

    def _fail(self, error: BaseException) -> None:
        """A step failed: every sequence leaves with the error (their caches are not
        trusted: the sessions empty them)."""
        with self._cond:
            everyone = [*self._joining, *self._alone, *self._merged_seqs()]
            self._joining, self._alone, self._merged = [], [], None
        for seq in everyone:
            seq.post(Left(stopped=False, error=error))
            seq.left.set()
