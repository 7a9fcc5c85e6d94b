"""How a reply's tokens are drawn: the sampler and logits processors of a turn's settings.

The one place that turns :class:`~kvchat.engine.events.GenerationSettings` into
mlx-lm's sampling pieces (``mlx_lm.sample_utils``): a sampler takes log
probabilities ``(B, vocab)`` and returns token ids ``(B,)``; a logits processor
takes the tokens so far (an ``mx.array``) and logits ``(1, vocab)`` and returns
logits. The generation core applies each sequence's own pieces to its own row.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def for_settings(settings) -> tuple[Sampler, list[LogitsProcessor]]:
    """The sampler and logits processors of ``settings`` (temperature 0 is greedy)."""
    top_p = settings.top_p if 0.0 < settings.top_p < 1.0 else 0.0
    return make_sampler(temp=settings.temp, top_p=top_p), []
