"""Per-turn statistics: the one definition of the fields the TUI, ``--json`` and benchmarks show."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TurnStats:
    """What one turn cost and what the cache holds after it.

    ``reused_tokens + evaluated_tokens == prompt_tokens``, except for a turn
    ``stopped`` during its prefill: then ``evaluated_tokens`` counts only what
    reached the cache, and ``ttft_s`` is 0 as no token came. ``rebuilt`` is
    None, or why the cache had to be recomputed this turn.
    ``reevaluated_reply_tokens`` counts the evaluated tokens that re-render the last
    reply, because the chat template drops its ``<think>`` blocks (see
    :mod:`kvchat.engine.conversation.thoughts`). ``not_batched`` names the cache kind that kept
    this turn's decoding out of a merged batch (it ran beside the others, one
    forward pass of its own a step), or is None. ``batch_size`` is the most
    sequences one forward pass decoded while this reply was decoding.
    """

    prompt_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    prompt_eval_s: float
    ttft_s: float
    generated_tokens: int
    gen_tps: float
    cache_tokens: int
    cache_bytes: int
    cache_kind: str
    active_memory_bytes: int
    peak_memory_bytes: int
    rebuilt: str | None = None
    stopped: bool = False
    reevaluated_reply_tokens: int = 0
    not_batched: str | None = None
    batch_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TurnStats":
        """Rebuild from :meth:`to_dict` output, ignoring keys this version does not know."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class CacheChange:
    """Work done on a session's cache since its last turn (undo, trim, kind change, reset,
    branch switch...): what it was, what it evaluated, what the cache holds after it. A view
    shows this rather than the last turn's figures, which no longer describe the cache."""

    action: str
    cache_tokens: int
    evaluated_tokens: int = 0


@dataclass(frozen=True)
class Refilled:
    """What a branch switch or a deletion did to the cache: tokens kept, tokens evaluated."""

    reused: int
    evaluated: int


@dataclass(frozen=True)
class CacheFigures:
    """A session's figures at one moment, taken on the thread that runs its turns, so a
    view can show them while the next turn runs without reading the live session."""

    cache_tokens: int
    cache_bytes: int
    checkpoints: tuple[int, int]  # how many, their bytes
    user_turns: int
    last: TurnStats | None
    prompt_eval_history: tuple[float, ...]
    pending_rebuild: str | None


STAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TurnStats))


def memory() -> tuple[int, int]:
    """Process memory held by mlx: (active bytes, peak bytes since the last reset)."""
    import mlx.core as mx  # here: `kvchat sessions list` reads stats without loading MLX

    return mx.get_active_memory(), mx.get_peak_memory()
