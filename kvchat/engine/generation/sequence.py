"""One request of the generation core: a prompt to evaluate into a session's cache, then
tokens sampled one a step until an end token, the length limit or a stop.

The cache contract: the ledger lists exactly the tokens whose keys and values
are in the cache whenever a sequence joins or leaves the core. A token joins both
when it is fed to the model. The last sampled token is never fed (nothing asks for
the token after it), so after a turn the cache holds the prompt and the reply but its
last token; the next turn's prefix match evaluates that one with the new message.
While the core decodes a step ahead (:attr:`Sequence.ahead`), the cache holds one
token more than the ledger, the last sampled one, fed before it was read; a sequence
that then leaves has it trimmed from its cache.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx

from kvchat.engine.conversation.events import Prefill
from kvchat.engine.generation.sampling import LogitsProcessor, Sampler, alike


class StopFlag(Protocol):
    """A turn's stop request, as ``threading.Event`` has it (a sharded run's is shared by
    every rank: kvchat/engine/sharding/driver.py)."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class Left:
    """The last message of a sequence: it left the core, its cache is its own again.
    ``stopped`` when a stop or a cancel ended it; ``error`` when a step failed (the
    cache is then not to be trusted)."""

    stopped: bool
    error: BaseException | None = None


@dataclass(eq=False)
class Sequence:
    """What a turn asks of the core, and what the core keeps of it while it runs.

    ``prompt`` is evaluated into ``cache`` (whose tokens ``ledger`` lists, and
    to which the core appends what it feeds); an empty prompt samples its first
    token from ``logprobs`` (the log probabilities at the prompt's end, kept
    from an earlier turn). ``on_prompt(logprobs)`` is called once the whole
    prompt is in the cache, before the first token is sampled. ``stop`` is the
    turn's :class:`StopFlag`.
    """

    prompt: list[int]
    cache: list[Any]
    ledger: list[int]
    sampler: Sampler
    processors: list[LogitsProcessor]
    max_tokens: int
    stop: StopFlag
    eos: frozenset[int] = frozenset()
    prefill_step: int = 512
    logprobs: mx.array | None = None
    on_prompt: Callable[[mx.array], None] | None = None
    marks: frozenset[int] = frozenset()  # ledger lengths where the prefill keeps a checkpoint
    on_mark: Callable[[int], None] | None = None  # called with the ledger length at a mark
    report_logprobs: bool = False  # keep each sampled token's log probabilities
    tokens: list[int] = field(default_factory=list)  # sampled so far
    sampled_logprobs: list[mx.array] = field(default_factory=list)  # one a token, if reported
    kind: str = "standard"  # the cache kind's name, said when it cannot batch
    not_batched: str | None = None  # why its cache decodes alone, if it does
    messages: queue.Queue[Prefill | int | Left] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    left: threading.Event = field(default_factory=threading.Event)
    fed: int = 0  # prompt tokens in the cache so far
    # the logits (1, V) after its last sampled token, fed (lazily) before that token was
    # read, while the step before it computed; the ledger gets the token when it is used
    ahead: mx.array | None = None
    # the token after that one, sampled (lazily) from ``ahead`` in the same graph, so
    # that the step after reads a token already computed (see :meth:`draws_ahead`)
    drawn: mx.array | None = None
    batch_peak: int = 1  # the most rows of a forward pass that decoded it

    @property
    def feeding(self) -> list[int]:
        """The tokens the next decode step feeds: the last sampled one, or before the first,
        the rest of the prompt (its last token, or a short prompt whole, when the decode
        step evaluates it with the other rows)."""
        return self.tokens[-1:] if self.tokens else self.prompt[self.fed :]

    def post(self, message: Prefill | int | Left) -> None:
        self.messages.put(message)

    def ended(self) -> bool:
        """Whether the token just sampled ends the reply (and then is not fed)."""
        return self.tokens[-1] in self.eos or len(self.tokens) >= self.max_tokens or self.halted()

    def halted(self) -> bool:
        """A stop or a cancel (a consumer that went away) was asked for."""
        return self.cancelled.is_set() or self.stop.is_set()

    def opened(self, logits: mx.array) -> None:
        """Its prompt's last token was fed by a decode step, ``logits`` ``(1, V)`` after
        it: the prompt is all in; keep its end's log probabilities, as a prefill does."""
        self.fed = len(self.prompt)
        self.logprobs = log_probs(logits)[0]
        mx.eval(self.logprobs)
        if self.on_prompt is not None:
            self.on_prompt(self.logprobs)

    def draws_ahead(self) -> bool:
        """Whether its next token may be sampled as soon as the token before it is fed, in
        the same graph (as mlx-lm's ``generate_step`` does): not when its processors
        must see that token in the ledger first, nor when it reports log probabilities
        (evaluated as they are sampled)."""
        return not self.processors and not self.report_logprobs

    def alike(self) -> Hashable | None:
        """What another row must share to be sampled in one call with this one (see
        :func:`~.sampling.alike`); None when it samples alone (when it does not sample
        from its row of logits alone: see :meth:`draws_ahead`)."""
        return alike(self.sampler) if self.draws_ahead() else None

    def sample(self, logits: mx.array) -> mx.array:
        """This sequence's next token from its row of logits ``(1, vocab)`` (lazy). Its draws
        are its own: a seeded sampler carries its key (:mod:`kvchat.engine.generation.sampling`)."""
        if self.processors:
            so_far = mx.array(self.ledger)  # everything fed so far, this prompt included
            for processor in self.processors:
                logits = processor(so_far, logits)
        logprobs = log_probs(logits)
        if self.report_logprobs:  # read by the consumer's thread with the token: evaluated
            row = logprobs[0]  # here, on the core's stream (MLX streams are per thread)
            mx.eval(row)
            self.sampled_logprobs.append(row)
        return self.sampler(logprobs)


def log_probs(logits: mx.array) -> mx.array:
    """Each row of ``logits`` ``(B, V)`` as log probabilities, as mlx-lm's samplers take
    them: the same arithmetic for a row sampled alone or stacked with others."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_rows(rows: list[tuple[Sequence, mx.array]]) -> mx.array:
    """Each row's next token, ``(B,)`` (lazy), for ``rows`` of a sequence and its logits
    ``(1, V)``: the token a step before drew from those logits where it did
    (:attr:`Sequence.drawn`, taken), else rows that sample alike (:meth:`Sequence.alike`)
    in one call over their logits stacked, the others each on its own
    (:meth:`Sequence.sample`)."""
    groups: dict[Hashable, list[int]] = {}
    picked: list[mx.array | None] = [None] * len(rows)
    for i, (seq, row) in enumerate(rows):
        if seq.drawn is not None:
            picked[i], seq.drawn = seq.drawn, None
        elif (key := seq.alike()) is None:
            picked[i] = seq.sample(row)
        else:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        logits = mx.concatenate([rows[i][1] for i in members])
        tokens = rows[members[0]][0].sampler(log_probs(logits))
        if len(members) == len(rows):
            return tokens
        for j, i in enumerate(members):
            picked[i] = tokens[j : j + 1]
    return mx.concatenate(cast(list[mx.array], picked))
