"""The cache keeper: a session's prompt cache, its ledger, its checkpoints and the log
probabilities at the end of the last prompt.

The ledger is exactly the token ids whose keys and values the cache holds, in order;
every method here leaves it so, and the only other writer is the generation core,
which appends what it feeds through the :class:`~kvchat.engine.generation.sequence.Sequence`
that :meth:`CacheKeeper.sequence` makes. The keeper knows nothing of messages or
templates: the :class:`~kvchat.engine.conversation.session.Session` says which tokens
the cache should hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from kvchat.engine.caches.checkpoints import Checkpoints, stateful_paths, what_cannot_go_back
from kvchat.engine.caches.kinds import (
    CacheKind,
    after_turn,
    allocated_bytes,
    cache_bytes,
    convert_cache,
    copy_cache,
    group_size,
    held_tokens,
    make_cache,
    settle,
    trim_to,
)
from kvchat.engine.conversation.events import Prefill
from kvchat.engine.conversation.stats import CacheChange
from kvchat.engine.generation.sampling import LogitsProcessor, Sampler
from kvchat.engine.generation.sequence import Request, Sequence, State

if TYPE_CHECKING:
    from kvchat.engine.generation.sequence import StopFlag
    from kvchat.engine.models.model import LoadedModel

Progress = Callable[[int, int], None]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CacheKeeper:
    """One cache object per model layer of ``lm``, of ``kind``, and what describes it.

    ``head`` says how many tokens a new cache keeps at its start whatever it evicts
    (a rotating cache's system prompt): it is asked each time a cache is made.
    """

    def __init__(self, lm: LoadedModel, kind: CacheKind, head: Callable[[], int]):
        self.lm = lm
        self._kind = kind
        self._head = head
        self._cache: list[Any] = make_cache(lm.model, kind, keep=head())
        self._ledger: list[int] = []
        self.checkpoints = Checkpoints()  # of sliding-window and recurrent layers, by turn
        self._logits: tuple[int, mx.array] | None = None
        self.last_change: CacheChange | None = None  # maintenance since the last turn
        self.pending_rebuild: str | None = None  # why the cache was emptied, until refilled
        self.recomputed = 0  # tokens a load-time rebuild put in the cache, no turn counted

    # ----------------------------------------------------------------- reading

    @property
    def kind(self) -> CacheKind:
        return self._kind

    @property
    def cache(self) -> list[Any]:
        return self._cache

    @property
    def ledger(self) -> list[int]:
        """The tokens the cache holds (the list itself: read it, change it only through
        this keeper or a sequence it made)."""
        return self._ledger

    @property
    def tokens(self) -> int:
        """Tokens whose keys and values the cache holds now."""
        return held_tokens(self._cache, len(self._ledger))

    @property
    def nbytes(self) -> int:
        """Bytes the held tokens take (what a save writes)."""
        return cache_bytes(self._cache)

    @property
    def allocated(self) -> int:
        """Bytes the cache's buffers hold in memory, free slots included."""
        return allocated_bytes(self._cache)

    @property
    def head(self) -> int:
        """The tokens a cache made now keeps at its start, whatever it evicts."""
        return self._head()

    @property
    def stateful(self) -> bool:
        """Whether the cache has sliding-window or recurrent layers (it keeps checkpoints)."""
        return bool(stateful_paths(self._cache))

    @property
    def prompt_logprobs(self) -> tuple[int, mx.array] | None:
        """The log-probabilities at the end of the last prompt and its length."""
        return self._logits

    @prompt_logprobs.setter
    def prompt_logprobs(self, value: tuple[int, mx.array]) -> None:
        if not 0 < value[0] <= len(self._ledger):
            raise ValueError(f"log-probabilities at token {value[0]} of {len(self._ledger)}")
        self._logits = value

    def logprobs_at(self, n: int) -> mx.array | None:
        """The kept log-probabilities if they are those at token ``n``, else None."""
        return self._logits[1] if self._logits is not None and self._logits[0] == n else None

    def copy_upto(self, n: int) -> tuple[list[Any], list[int]] | None:
        """A copy of the cache holding ``ledger[:n]`` or, failing that, up to the nearest
        checkpoint before ``n``, with its ledger; None when it would hold nothing."""
        copied = copy_cache(self._cache)
        kept = n if n and trim_to(copied, n) else self.checkpoints.restore(copied, n)
        if kept and held_tokens(copied) == kept:
            return copied, self._ledger[:kept]
        return None

    # ----------------------------------------------------------------- evaluating

    def sequence(
        self,
        prompt: list[int],
        *,
        sampler: Sampler,
        processors: list[LogitsProcessor],
        max_tokens: int,
        stop: StopFlag,
        eos: frozenset[int] = frozenset(),
        prefill_step: int = 512,
        logprobs: mx.array | None = None,
        marks: frozenset[int] = frozenset(),
        report_logprobs: bool = False,
    ) -> Sequence:
        """A :class:`Sequence` evaluating ``prompt`` into this cache (the core appends what
        it feeds to the ledger), then sampling; once the prompt is in, a checkpoint and the
        log probabilities there are kept, and a checkpoint at each ledger length in
        ``marks``. The other arguments are :class:`Request`'s."""
        request = Request(
            prompt=prompt,
            sampler=sampler,
            processors=processors,
            max_tokens=max_tokens,
            stop=stop,
            eos=eos,
            prefill_step=prefill_step,
            marks=marks,
            report_logprobs=report_logprobs,
            kind=self._kind.name,
            on_prompt=self._prompt_done,
            on_mark=self._mark,
        )
        return Sequence(request, State(self._cache, self._ledger, logprobs=logprobs))

    def prefill(
        self,
        tokens: list[int],
        total: int,
        *,
        step: int,
        stop: StopFlag,
        marks: frozenset[int] = frozenset(),
    ) -> Iterator[Prefill]:
        """Evaluate ``tokens`` into the cache in chunks of ``step``, yielding progress; ends
        early once ``stop`` is set. A checkpoint is kept where the ledger reaches a length
        in ``marks``."""
        step = max(1, step)
        start = len(self._ledger)
        end = start + len(tokens)
        cuts = sorted(
            {*range(start + step, end, step), *(m for m in marks if start < m < end), end}
        )
        yield Prefill(0, total)
        with mx.stream(generation_stream):
            for cut in cuts if tokens else ():
                if stop.is_set():
                    return
                chunk = tokens[len(self._ledger) - start : cut - start]
                self.lm.model(mx.array(chunk)[None], cache=self._cache)
                mx.eval([c.state for c in self._cache])
                self._ledger.extend(chunk)
                if cut in marks:
                    self._mark(cut)
                yield Prefill(cut - start, total)
                mx.clear_cache()

    def fill(
        self,
        tokens: list[int],
        *,
        step: int,
        stop: StopFlag,
        marks: frozenset[int] = frozenset(),
        progress: Progress | None = None,
    ) -> int:
        """Evaluate the rest of ``tokens`` (which start with the ledger: :meth:`rewind`
        first) so the cache holds them all; returns how many were evaluated."""
        held = len(self._ledger)
        if tokens[:held] != self._ledger:
            raise ValueError("the tokens to fill do not start with what the cache holds")
        for event in self.prefill(
            tokens[held:], len(tokens) - held, step=step, stop=stop, marks=marks
        ):
            if progress:
                progress(event.done, event.total)
        after_turn(self._cache)
        self.pending_rebuild = None  # the whole transcript is in the cache again
        return len(tokens) - held

    def _prompt_done(self, logprobs: mx.array) -> None:
        """The prompt is in the cache: keep a checkpoint there (for a regenerate or an edit
        of this turn) and the log probabilities at its end."""
        self.keep_checkpoint()
        self._logits = (len(self._ledger), logprobs)

    def _mark(self, tokens: int) -> None:
        self.checkpoints.keep(self._cache, tokens)

    def keep_checkpoint(self) -> None:
        """Keep a checkpoint of the cache as it is now."""
        self._mark(len(self._ledger))

    def after_turn(self) -> None:
        """The cache's end-of-turn housekeeping (mlx-lm's, for the kinds that need one)."""
        after_turn(self._cache)

    # ----------------------------------------------------------------- going back

    def rewind(self, n: int) -> tuple[int, str | None]:
        """Make the cache hold ``ledger[:n]``, or failing that the ledger up to the nearest
        checkpoint before ``n``, or failing that nothing (:meth:`discard`).

        Returns how many tokens the cache holds now, and the reason it had to be
        emptied (None when it was not).
        """
        if n >= len(self._ledger):
            return len(self._ledger), None
        kept = n if trim_to(self._cache, n) else self.checkpoints.restore(self._cache, n)
        if kept is not None:
            settle(self._cache)
            self._cut(kept)
            return kept, None
        reason = f"the {self._kind.name} cache could not be trimmed back to token {n}"
        stateful = what_cannot_go_back(self._cache)
        if stateful:
            reason += f": it holds {stateful}, and no checkpoint is that early"
        self.discard(reason)
        return 0, reason

    def _cut(self, n: int) -> None:
        del self._ledger[n:]
        self.checkpoints.forget_after(n)
        if self._logits is not None and self._logits[0] > n:
            self._logits = None

    def discard(self, reason: str) -> None:
        """Replace the cache with an empty one; the next turn evaluates everything."""
        self.unload()
        self.pending_rebuild = reason
        self.recomputed = 0

    def unload(self) -> None:
        """Let go of the cache's memory (it was saved elsewhere)."""
        self._cache = make_cache(self.lm.model, self._kind, keep=self.head)
        self._ledger = []
        self._logits = None
        self.checkpoints.clear()

    def close(self) -> None:
        """Let go of the cache and the model for good."""
        self._cache, self._ledger, self._logits = [], [], None
        self.checkpoints.clear()
        del self.lm
        mx.clear_cache()

    def attach(self, cache: list[Any], ledger: list[int]) -> None:
        """Take a cache holding exactly ``ledger`` (as loaded from disk)."""
        self._cache, self._ledger = cache, list(ledger)
        self._logits = None
        self.checkpoints.clear()
        settle(cache)

    def reset(self) -> bool:
        """Empty the cache: the next turn prefills it all again. False (and nothing
        changes) when it was empty already."""
        if not self._ledger:
            return False
        self.discard("the cache was reset")
        self.changed("reset")
        return True

    def set_kind(self, kind: CacheKind) -> str | None:
        """Switch to ``kind``, converting the cache where the data allows. Returns None
        when it was converted in place, else why it was emptied (the caller refills it).
        Raises ``CacheKindError`` for a kind that cannot apply to this model, before
        anything changes."""
        make_cache(self.lm.model, kind)  # raises if the kind cannot apply to this model
        old, self._kind = self._kind, kind
        converted = convert_cache(self._cache, old, kind, group_size(self.lm.model, kind))
        if converted is not None:
            # Only plain key/value layers changed: the sliding-window and recurrent layers,
            # which are all a checkpoint holds, are the same objects, so the checkpoints stay.
            self._cache, self._logits = converted, None
            settle(converted)
            return None
        reason = f"cache kind changed from {old.name} to {kind.name}"
        self.discard(reason)
        return reason

    # ----------------------------------------------------------------- figures

    def changed(self, action: str, evaluated: int = 0) -> None:
        """Record maintenance work on the cache (the next turn clears it)."""
        self.last_change = CacheChange(action, self.tokens, evaluated)
