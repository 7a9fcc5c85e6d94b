"""A sharded model's decoding path: every rank must perform the same operations in the
same order, so nothing depends on a rank's own clock or a probe, and nothing merges. Its
core runs on the caller's thread (:meth:`~kvchat.engine.generation.core.GenerationCore.run`);
each row decodes a forward pass of its own, computed (the ranks' collectives) before its
token is sampled; the prefill's chunks are cut from the prefill step alone, not paced, each
in a pass of its own, and the prompt's last token is fed alone, the first token sampled
there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kvchat.engine.generation.paths.base import Path, Row, alone
from kvchat.engine.generation.prefill import Chunk
from kvchat.engine.generation.sequence import Sequence


class Sharded(Path):
    """Rows apart, each a forward pass of its own, the same on every rank."""

    paced = False
    opens = False

    def join(self, model: nn.Module, ready: list[Sequence]) -> None:
        self.apart += ready

    def together(self, model: nn.Module, chunks: list[Chunk]) -> bool:
        return False

    def forward(self, model: nn.Module) -> list[Row]:
        rows = alone(model, self.apart)
        # its collectives first, then the sampler's
        mx.eval(
            [logits for _, logits in rows], [c.state for s in self.apart for c in s.state.cache]
        )
        return rows
