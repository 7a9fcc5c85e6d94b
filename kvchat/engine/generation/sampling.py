"""A sequence's sampler and logits processors, made from its :class:`GenerationSettings`.

The filters (top-p, min-p, top-k) and the penalties (repetition, presence,
frequency) are mlx-lm's own (``mlx_lm.sample_utils``). The chain is put
together here rather than by ``make_sampler`` for two reasons: ``make_sampler``
draws from MLX's global random state, which every sequence of a batch shares,
so a seed could not make one sequence's reply reproducible; here a seeded
sampler carries its own key (split at every token). And ``make_sampler``
raises for a ``top_k`` at or above the vocabulary size, which here simply
keeps every token.

A logits processor takes ``(tokens, logits)``, ``tokens`` being the sequence
so far (prompt and reply); the penalties look at its last
``repetition_context_size`` tokens. The generation core applies each
sequence's own sampler and processors to its own row; rows that sample alike
(:func:`alike`: no processors, greedy or the same unseeded settings) go in one call
over their rows stacked, as ``mlx_lm.generate.BatchGenerator`` does for a batch that
shares its sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from kvchat.engine.conversation.events import GenerationSettings, TokenLogprobs

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def for_settings(settings: GenerationSettings) -> tuple[Sampler, list[LogitsProcessor]]:
    """The sampler (log-probabilities in, token ids out) and the logits processors of one
    sequence's turn. Make them anew for each turn: a seeded sampler restarts its key, so
    the same seed, prompt and cache give the same reply."""
    return _sampler(settings), _processors(settings)


def _sampler(s: GenerationSettings) -> Sampler:
    if s.temp <= 0:
        return greedy_sampler
    key = mx.random.key(s.seed % (1 << 64)) if s.seed is not None else None
    return Draw(s.top_p, s.min_p, s.top_k, s.temp, key)


@dataclass(eq=False)
class Draw:
    """A sampled turn's sampler (temperature above 0): mlx-lm's filters, then a draw at
    the temperature, from MLX's global random state, or with a seed from its own
    ``key``, split at every token. Takes log probabilities ``(B, V)``, gives ``(B,)``."""

    top_p: float
    min_p: float
    top_k: int
    temp: float
    key: mx.array | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        scaled = logprobs * (1.0 / self.temp)
        if self.key is None:
            return mx.random.categorical(scaled)
        self.key, step = mx.random.split(self.key)
        return mx.random.categorical(scaled, key=step)


def alike(sampler: Sampler) -> Hashable | None:
    """What rows of a step must share to be sampled in one call of either's sampler
    (over their log probabilities stacked): greedy rows, or unseeded draws with the same
    settings. None for a sampler that draws alone: a seeded one (its key is its own, so
    that its reply does not depend on who else is in the batch), or one made elsewhere."""
    if sampler is greedy_sampler:
        return "greedy"
    if isinstance(sampler, Draw) and sampler.key is None:  # every setting a draw has
        return tuple(getattr(sampler, f.name) for f in fields(Draw) if f.name != "key")
    return None


def _processors(s: GenerationSettings) -> list[LogitsProcessor]:
    context = s.repetition_context_size
    return make_logits_processors(
        repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
        repetition_context_size=context,
        presence_penalty=s.presence_penalty or None,
        presence_context_size=context,
        frequency_penalty=s.frequency_penalty or None,
        frequency_context_size=context,
    )


def token_logprobs(token: int, logprobs: mx.array, top: int) -> TokenLogprobs:
    """The event reporting ``token``'s log probability and the ``top`` likeliest tokens'
    (most likely first) from the vector it was sampled from."""
    vector = np.asarray(logprobs.reshape(-1).astype(mx.float32))
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(-vector, top - 1)[:top]
        alternatives = sorted(((int(i), float(vector[i])) for i in ids), key=lambda p: -p[1])
    return TokenLogprobs(token, float(vector[token]), tuple(alternatives))
