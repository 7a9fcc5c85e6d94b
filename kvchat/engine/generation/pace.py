"""How many prompt tokens a step evaluates while other conversations wait on it.

A step runs its prompt chunks, then every decoding sequence's next token: a
decoding conversation gets no token until the step's prompts are in. A chunk of
the prefill step's 512 tokens took 2.6-4.9 s on two CPU cores
(`demo:qwen2.5-0.5b`, the deeper into a long paste the longer), and every other
conversation stood still that long. So while any
sequence decodes, a step takes only as many prompt tokens as the core evaluates
in about :data:`PACE_S` at its measured rate: the paste goes on a chunk at a
time beside the others, who keep streaming. With nobody decoding, the whole
budget goes in (the prompt's owner waits for its end either way, and larger
chunks evaluate faster a token). A sharded model's core is not paced: its ranks
must cut the same chunks, and each would measure its own rate.

The rate is the last prompt pass's tokens over its seconds: it follows the
device, the model, and the depth of the cache the chunks attend to. A pass of
a few tokens measures a lower rate than the chunks the budget then allows (the
weights stream once a pass, however few its rows), so the estimate errs towards
short steps and rises as the chunks grow.

On two CPU cores, a 2,000-token paste beside a streaming reply (2026-11-28): the
streaming reply's longest wait 1.3 s rather than 3.2-4.1 s, and twice its tokens
while the paste went in; the paste's first token 15-25% later (chunks of about
130 tokens, each step also decoding the other). Half a second halved the chunks and
doubled the paste's time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PACE_S = 1.0  # seconds of prompt a step takes while others decode, at the measured rate
FLOOR = 32  # tokens a paced step takes at least: fewer would stream the weights for little


class Pace:
    """The prompt-token budget of a core's steps, from its own measured prompt rate."""

    def __init__(self, seconds: float = PACE_S):
        self.seconds = seconds
        self.rate: float | None = None  # prompt tokens a second, from the last measured pass

    def budget(self, full: int, others_decoding: bool) -> int:
        """The prompt tokens this step may evaluate: ``full`` (the prefill step) with nobody
        decoding, else about :attr:`seconds` of them (:data:`FLOOR` before any pass is
        measured), never more than ``full``."""
        if not others_decoding:
            return full
        paced = FLOOR if self.rate is None else int(self.rate * self.seconds)
        return max(1, min(full, max(FLOOR, paced)))

    @contextmanager
    def timed(self, tokens: int) -> Iterator[None]:
        """Measure the rate of the prompt pass of ``tokens`` tokens the block evaluates
        (none: nothing measured; a pass that fails: neither)."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        if tokens > 0 and seconds > 0:
            self.rate = tokens / seconds
