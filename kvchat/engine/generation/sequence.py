"""One request of the generation core: a prompt to evaluate into a session's cache, then
tokens sampled one a step until an end token, the length limit or a stop.

A :class:`Sequence` is three things, kept apart: its :class:`Request` (what the turn asks,
fixed once submitted: the prompt, the sampler and processors, the limits, the stop flag,
the session's hooks), its :class:`State` (what the core changes as it runs: the cache and
its ledger, the prompt tokens fed, the tokens sampled, the logits fed ahead, the figures
the turn reports) and its :class:`Channel` (the messages to the turn's thread, and the two
events between that thread and the core's).

The cache contract: the ledger lists exactly the tokens whose keys and values
are in the cache whenever a sequence joins or leaves the core. A token joins both
when it is fed to the model. The last sampled token is never fed (nothing asks for
the token after it), so after a turn the cache holds the prompt and the reply but its
last token; the next turn's prefix match evaluates that one with the new message.
While the core decodes a step ahead (:attr:`State.ahead`), the cache holds one
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


Message = Prefill | int | Left  # what a sequence's channel carries


@dataclass(frozen=True)
class Request:
    """What a turn asks of the core. ``prompt`` is evaluated into the state's cache, then
    tokens are sampled by ``sampler`` after ``processors`` (which see the ledger), until one
    in ``eos``, ``max_tokens`` of them, or ``stop``. ``on_prompt(logprobs)`` is called once
    the whole prompt is in the cache, before the first token is sampled; ``on_mark(n)`` at
    each ledger length in ``marks`` the prefill reaches (the session keeps a checkpoint)."""

    prompt: list[int]
    sampler: Sampler
    processors: list[LogitsProcessor]
    max_tokens: int
    stop: StopFlag
    eos: frozenset[int] = frozenset()
    prefill_step: int = 512
    marks: frozenset[int] = frozenset()  # ledger lengths where the prefill keeps a checkpoint
    report_logprobs: bool = False  # keep each sampled token's log probabilities
    kind: str = "standard"  # the cache kind's name, said when it cannot batch
    on_prompt: Callable[[mx.array], None] | None = None
    on_mark: Callable[[int], None] | None = None


@dataclass(eq=False)
class State:
    """What the core keeps of a sequence while it runs. ``cache`` and ``ledger`` are the
    session's (the core appends what it feeds); ``logprobs`` the log probabilities at the
    prompt's end: given, for an empty prompt, from an earlier turn, else set when the
    prompt is in."""

    cache: list[Any]
    ledger: list[int]
    logprobs: mx.array | None = None
    fed: int = 0  # prompt tokens in the cache so far
    tokens: list[int] = field(default_factory=list)  # sampled so far
    sampled_logprobs: list[mx.array] = field(default_factory=list)  # one a token, if reported
    # the logits (1, V) after its last sampled token, fed (lazily) before that token was
    # read, while the step before it computed; the ledger gets the token when it is used
    ahead: mx.array | None = None
    # the token after that one, sampled (lazily) from ``ahead`` in the same graph, so
    # that the step after reads a token already computed (see Sequence.draws_ahead)
    drawn: mx.array | None = None
    not_batched: str | None = None  # why its cache decodes alone, if it does
    batch_peak: int = 1  # the most rows of a forward pass that decoded it


@dataclass(eq=False)
class Channel:
    """Between the core and the turn's thread: the messages it reads (``Prefill``
    progress, token ids, a final :class:`Left`), ``cancelled`` (its reader went away) and
    ``left`` (the sequence left the core: its cache is the session's again)."""

    messages: queue.Queue[Message] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    left: threading.Event = field(default_factory=threading.Event)

    def post(self, message: Message) -> None:
        self.messages.put(message)

    def close(self, message: Left) -> None:
        """Post the last message and say the sequence left."""
        self.messages.put(message)
        self.left.set()

    def pending(self) -> list[Message]:
        """The messages posted and not read yet, taken (none waited for)."""
        taken = []
        while not self.messages.empty():
            taken.append(self.messages.get())
        return taken


@dataclass(eq=False)
class Sequence:
    """A request submitted to the core, with its running state and its channel."""

    request: Request
    state: State
    channel: Channel = field(default_factory=Channel)

    @property
    def feeding(self) -> list[int]:
        """The tokens the next decode step feeds: the last sampled one, or before the first,
        the rest of the prompt (its last token, or a short prompt whole, when the decode
        step evaluates it with the other rows)."""
        state = self.state
        return state.tokens[-1:] if state.tokens else self.request.prompt[state.fed :]

    def prompt_left(self) -> int:
        """Prompt tokens not in the cache yet."""
        return len(self.request.prompt) - self.state.fed

    def ended(self) -> bool:
        """Whether the token just sampled ends the reply (and then is not fed)."""
        tokens = self.state.tokens
        return (
            tokens[-1] in self.request.eos
            or len(tokens) >= self.request.max_tokens
            or self.halted()
        )

    def halted(self) -> bool:
        """A stop or a cancel (a consumer that went away) was asked for."""
        return self.channel.cancelled.is_set() or self.request.stop.is_set()

    def opened(self, logits: mx.array) -> None:
        """Its prompt's last token was fed by a decode step, ``logits`` ``(1, V)`` after
        it: the prompt is all in; keep its end's log probabilities, as a prefill does."""
        self.state.fed = len(self.request.prompt)
        self.prompt_done(log_probs(logits)[0])

    def prompt_done(self, logprobs: mx.array) -> None:
        """The whole prompt is in the cache, ``logprobs`` at its end: keep them (evaluated)
        and tell the session."""
        mx.eval(logprobs)
        self.state.logprobs = logprobs
        if self.request.on_prompt is not None:
            self.request.on_prompt(logprobs)

    def draws_ahead(self) -> bool:
        """Whether its next token may be sampled as soon as the token before it is fed, in
        the same graph (as mlx-lm's ``generate_step`` does): not when its processors
        must see that token in the ledger first, nor when it reports log probabilities
        (evaluated as they are sampled)."""
        return not self.request.processors and not self.request.report_logprobs

    def alike(self) -> Hashable | None:
        """What another row must share to be sampled in one call with this one (see
        :func:`~.sampling.alike`); None when it samples alone (when it does not sample
        from its row of logits alone: see :meth:`draws_ahead`)."""
        return alike(self.request.sampler) if self.draws_ahead() else None

    def sample(self, logits: mx.array) -> mx.array:
        """This sequence's next token from its row of logits ``(1, vocab)`` (lazy). Its draws
        are its own: a seeded sampler carries its key (:mod:`kvchat.engine.generation.sampling`)."""
        if self.request.processors:
            so_far = mx.array(self.state.ledger)  # everything fed so far, this prompt included
            for processor in self.request.processors:
                logits = processor(so_far, logits)
        logprobs = log_probs(logits)
        if self.request.report_logprobs:  # read by the consumer's thread with the token:
            row = logprobs[0]  # evaluated here, on the core's stream (streams are per thread)
            mx.eval(row)
            self.state.sampled_logprobs.append(row)
        return self.request.sampler(logprobs)


def log_probs(logits: mx.array) -> mx.array:
    """Each row of ``logits`` ``(B, V)`` as log probabilities, as mlx-lm's samplers take
    them: the same arithmetic for a row sampled alone or stacked with others."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_rows(rows: list[tuple[Sequence, mx.array]]) -> mx.array:
    """Each row's next token, ``(B,)`` (lazy), for ``rows`` of a sequence and its logits
    ``(1, V)``: the token a step before drew from those logits where it did
    (:attr:`State.drawn`, taken), else rows that sample alike (:meth:`Sequence.alike`)
    in one call over their logits stacked, the others each on its own
    (:meth:`Sequence.sample`)."""
    groups: dict[Hashable, list[int]] = {}
    picked: list[mx.array | None] = [None] * len(rows)
    for i, (seq, row) in enumerate(rows):
        if seq.state.drawn is not None:
            picked[i], seq.state.drawn = seq.state.drawn, None
        elif (key := seq.alike()) is None:
            picked[i] = seq.sample(row)
        else:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        logits = mx.concatenate([rows[i][1] for i in members])
        tokens = rows[members[0]][0].request.sampler(log_probs(logits))
        if len(members) == len(rows):
            return tokens
        for j, i in enumerate(members):
            picked[i] = tokens[j : j + 1]
    return mx.concatenate(cast(list[mx.array], picked))
