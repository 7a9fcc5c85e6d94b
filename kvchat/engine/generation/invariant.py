"""What holds between two steps of the generation core, checked after each step in debug
mode (``KVCHAT_DEBUG_BATCH=1``; the test suite turns it on).

Each sequence's cache holds exactly its ledger (one token more while the core
decodes a step ahead: the last sampled token, fed before it was read), and the
ledger's last token is the one the core fed last: the token sampled before the
last, or the prompt's last. A sequence merged into a batch is checked against its
row of the batch cache; its own cache, lent to the batch, holds nothing meanwhile.
A break raises, and the step's sequences leave with the error: a reply never goes
on from a cache that is not its own.
"""

from __future__ import annotations

import os
from typing import cast

from mlx_lm.models.cache import BatchKVCache

from kvchat.engine.caches.kinds import cache_offset
from kvchat.engine.generation.batch import Merged
from kvchat.engine.generation.sequence import Sequence


def debugging() -> bool:
    """Whether the core checks :func:`check` after each step."""
    return os.environ.get("KVCHAT_DEBUG_BATCH", "") not in ("", "0")


def check(own: list[Sequence], merged: Merged | None) -> None:
    """Raise RuntimeError where a sequence's cache and ledger disagree (see the module's
    docstring): ``own``, those on their own caches (joining, or decoding apart), and
    those of the ``merged`` batch, if any."""
    for seq in own:
        _agree(seq, cache_offset(seq.state.cache))
    if merged is None or not merged.seqs:
        return
    rows = [layer for layer in merged.cache if isinstance(layer, BatchKVCache)]
    offsets = cast(list[int], rows[0].offset.tolist()) if rows else []  # one a row
    if offsets and len(offsets) != len(merged.seqs):
        raise RuntimeError(f"A batch cache has {len(offsets)} rows for {len(merged.seqs)}.")
    for i, seq in enumerate(merged.seqs):
        if cache_offset(seq.state.cache) not in (None, 0):
            raise RuntimeError("A merged sequence's own cache holds tokens the batch holds.")
        _agree(seq, offsets[i] if offsets else None)


def _agree(seq: Sequence, held: int | None) -> None:
    """``held`` (None where the cache has no position: recurrent state) against the ledger."""
    state, prompt = seq.state, seq.request.prompt
    expected = len(state.ledger) + (state.ahead is not None)
    if held is not None and held != expected:
        raise RuntimeError(
            f"A sequence's cache holds {held} tokens where its ledger says {expected}."
        )
    fed = state.tokens[-2] if len(state.tokens) > 1 else None
    if len(state.tokens) == 1 and prompt:
        fed = prompt[-1]
    if fed is not None and state.ledger[-1:] != [fed]:
        raise RuntimeError("A sequence's ledger does not end with the token it was fed last.")
