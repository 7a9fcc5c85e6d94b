"""The CPU fast path's decoding path: every row keeps its own cache, and one numpy step
(:func:`kvchat.engine.cpu.decode_batch`) decodes them all, streaming the weights once for
the batch while each row attends to its own cache. A row may carry several tokens
(causal among them) on a plain ``KVCache``: a short joining prompt goes whole into the
decode step (:func:`~kvchat.engine.generation.prefill.folded`) rather than a prefill pass
of its own. The numpy step computes as it goes: nothing is fed ahead.
"""

from __future__ import annotations

import mlx.nn as nn

from kvchat.engine.cpu import decode_batch
from kvchat.engine.generation.batch import blocker
from kvchat.engine.generation.paths.base import Path, Row, alone
from kvchat.engine.generation.sequence import Sequence


class NumpyRows(Path):
    """Rows apart, decoded by the CPU fast path's batched numpy step."""

    folds = True

    def join(self, model: nn.Module, ready: list[Sequence]) -> None:
        for seq in ready:  # what would keep it out of a merged batch on MLX's path
            seq.state.not_batched = blocker(model, seq.state.cache, seq.request.kind)
        self.apart += ready

    def forward(self, model: nn.Module) -> list[Row]:
        """One numpy step of every row (a short prompt folded into it computes the output
        projection of its last token only, where the model's forward pass would leave the
        others' to MLX); a forward pass a row where the step does not take them (a cache
        class it does not read)."""
        logits = decode_batch(
            model, [s.feeding for s in self.apart], [s.state.cache for s in self.apart]
        )
        if logits is None:
            return alone(model, self.apart)
        return [(s, logits[i : i + 1]) for i, s in enumerate(self.apart)]

    def width(self, seq: Sequence) -> int:
        return len(self.apart)
