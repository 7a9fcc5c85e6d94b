"""The decoding steps of a Session: the prompt's last token, the first sampled token and
the rest of the reply. Each sampled token comes with the log-probability vector it was
sampled from (:data:`Step`); a turn asked for them reports them as :class:`TokenLogprobs`.
A session's ``logits_processors`` (mlx-lm's kind) shape every sampled token's logits,
the first included; each is called once per sampled token, in order.

A mixin of :class:`~kvchat.engine.session.Session` (it uses the session's ``lm``,
``cache``, ``ledger``, ``settings``, ``checkpoints`` and ``_logits``). The ledger
stays exact: a token joins it when its keys and values join the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from .events import TokenLogprobs
from .sampling import LogitsProcessor, after, for_settings, process

Step = tuple[int, mx.array]  # a sampled token and the log probabilities it was sampled from


class Decoding:
    """Sample a reply token by token into the session's cache."""

    def _sampler(self) -> Callable[[mx.array], mx.array]:
        """This turn's sampler (a sharded run makes every rank take rank 0's token)."""
        return for_settings(self.settings)[0]

    def _processors(self) -> list[LogitsProcessor]:
        """This turn's logits processors, applied before the sampler: the settings'
        penalties, then the session's own ``logits_processors`` (constrained decoding)."""
        return [*for_settings(self.settings)[1], *self.logits_processors]

    def _recent(self) -> list[int]:
        """The ledger's last tokens, as many as the penalties look at."""
        return list(self.ledger[-self.settings.repetition_context_size:])

    def _evaluate_last(self, token: int) -> None:
        """Evaluate the prompt's last token and keep the log probabilities at its position,
        from which the reply's first token is sampled (and a regenerate's, with no prefill)."""
        with mx.stream(generation_stream):
            self.ledger.append(token)
            logits = self.lm.model(mx.array([[token]]), cache=self.cache)[:, -1, :]
            logprobs = (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)
            mx.eval(logprobs, [c.state for c in self.cache])
        self._logits = (len(self.ledger), logprobs)

    def _first_token(self, sampler, processors: Sequence[LogitsProcessor] = ()) -> Step:
        """Checkpoint the prompt (for a regenerate or an edit of this turn), then sample
        the reply's first token from the last prompt position's log probabilities
        (returned with it)."""
        self.checkpoints.keep(self.cache, len(self.ledger))
        logits = process(processors, self._recent(), self._logits[1][None])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return int(sampler(logprobs).item()), logprobs[0]

    def _continue(self, prompt: list[int], max_tokens: int, sampler,
                  processors: Sequence[LogitsProcessor] = ()) -> Iterator[Step]:
        """Feed ``prompt`` (the reply's first token) and yield up to ``max_tokens`` more
        sampled tokens, each with the log probabilities it was sampled from, keeping
        the ledger exact.

        mlx-lm's ``generate_step`` feeds every token it yields into the cache
        before yielding it (it computes the next step while the caller reads
        this one), so each yielded token joins the ledger.

        On the CPU fast path (the model's ``fast_path``) the model runs eagerly,
        so that look-ahead would put a whole second step before the first token; there
        :meth:`_continue_eager` yields each token before feeding it.
        """
        if not prompt or max_tokens <= 0:
            return
        if self.lm.fast_path is not None and self.lm.fast_path.on:
            yield from self._continue_eager(prompt, max_tokens, sampler, processors)
            return
        history = self._recent()
        self.ledger.extend(prompt)
        gen = generate_step(
            mx.array(prompt), self.lm.model, prompt_cache=self.cache,
            sampler=sampler, max_tokens=max_tokens,
            logits_processors=after(history, processors, self.settings.repetition_context_size),
        )
        try:
            for token, logprobs in gen:
                self.ledger.append(token)
                yield token, logprobs
        finally:
            gen.close()

    def _continue_eager(self, prompt: list[int], max_tokens: int, sampler,
                        processors: Sequence[LogitsProcessor] = ()) -> Iterator[Step]:
        """:meth:`_continue` without look-ahead: a token joins the ledger when it is fed,
        so the last one sampled (at a stop, an end token or the length limit) is not in
        the cache, and the next turn's prefix match evaluates it with the new message."""
        feed = list(prompt)
        with mx.stream(generation_stream):
            for _ in range(max_tokens):
                self.ledger.extend(feed)
                logits = self.lm.model(mx.array(feed)[None], cache=self.cache)[:, -1, :]
                logits = process(processors, self._recent(), logits)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                sampled = sampler(logprobs)
                mx.eval(sampled, logprobs)  # nothing lazy survives into another thread's turn
                token = int(sampled.item())
                yield token, logprobs.squeeze(0)
                feed = [token]


def chain(first: list[Step], rest: Iterator[Step]) -> Iterator[Step]:
    """``first``'s steps, then ``rest``'s."""
    yield from first
    yield from rest


def token_logprobs(token: int, logprobs: mx.array, top: int) -> TokenLogprobs:
    """The event reporting ``token``'s log probability and the ``top`` likeliest tokens'
    (most likely first) from the vector it was sampled from."""
    vector = logprobs.reshape(-1).astype(mx.float32)
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        ids = mx.argpartition(-vector, top - 1)[:top]
        alternatives = sorted(zip(ids.tolist(), vector[ids].tolist()), key=lambda p: -p[1])
    return TokenLogprobs(token, float(vector[token].item()), tuple(alternatives))
