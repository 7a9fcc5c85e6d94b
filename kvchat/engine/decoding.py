"""The decoding steps of a Session: the prompt's last token, the first sampled token and
the rest of the reply.

A mixin of :class:`~kvchat.engine.session.Session` (it uses the session's ``lm``,
``cache``, ``ledger``, ``settings``, ``checkpoints`` and ``_logits``). The ledger
stays exact: a token joins it when its keys and values join the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import make_sampler


class Decoding:
    """Sample a reply token by token into the session's cache."""

    def _sampler(self) -> Callable[[mx.array], mx.array]:
        """This turn's sampler (a sharded run makes every rank take rank 0's token)."""
        return make_sampler(temp=self.settings.temp, top_p=self._top_p())

    def _top_p(self) -> float:
        return self.settings.top_p if 0.0 < self.settings.top_p < 1.0 else 0.0

    def _evaluate_last(self, token: int) -> None:
        """Evaluate the prompt's last token and keep the log probabilities at its position,
        from which the reply's first token is sampled (and a regenerate's, with no prefill)."""
        with mx.stream(generation_stream):
            self.ledger.append(token)
            logits = self.lm.model(mx.array([[token]]), cache=self.cache)[:, -1, :]
            logprobs = (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)
            mx.eval(logprobs, [c.state for c in self.cache])
        self._logits = (len(self.ledger), logprobs)

    def _first_token(self, sampler) -> int:
        """Checkpoint the prompt (for a regenerate or an edit of this turn), then sample
        the reply's first token from the last prompt position's log probabilities."""
        self.checkpoints.keep(self.cache, len(self.ledger))
        return int(sampler(self._logits[1][None]).item())

    def _continue(self, prompt: list[int], max_tokens: int, sampler) -> Iterator[int]:
        """Feed ``prompt`` (the reply's first token) and yield up to ``max_tokens`` more
        sampled tokens, keeping the ledger exact.

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
            yield from self._continue_eager(prompt, max_tokens, sampler)
            return
        self.ledger.extend(prompt)
        gen = generate_step(
            mx.array(prompt), self.lm.model, prompt_cache=self.cache,
            sampler=sampler, max_tokens=max_tokens,
        )
        try:
            for token, _ in gen:
                self.ledger.append(token)
                yield token
        finally:
            gen.close()

    def _continue_eager(self, prompt: list[int], max_tokens: int, sampler) -> Iterator[int]:
        """:meth:`_continue` without look-ahead: a token joins the ledger when it is fed,
        so the last one sampled (at a stop, an end token or the length limit) is not in
        the cache, and the next turn's prefix match evaluates it with the new message."""
        feed = list(prompt)
        with mx.stream(generation_stream):
            for _ in range(max_tokens):
                self.ledger.extend(feed)
                logits = self.lm.model(mx.array(feed)[None], cache=self.cache)[:, -1, :]
                sampled = sampler(logits - mx.logsumexp(logits, keepdims=True))
                mx.eval(sampled)  # nothing lazy survives into another thread's turn
                token = int(sampled.item())
                yield token
                feed = [token]


def chain(first: list[int], rest: Iterator[int]) -> Iterator[int]:
    """``first``'s tokens, then ``rest``'s."""
    yield from first
    yield from rest
