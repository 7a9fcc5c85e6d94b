"""What a turn yields and how replies are sampled: the plain data of the engine's API.

:meth:`kvchat.engine.session.Session.send` yields :class:`Prefill` while the
prompt is evaluated, :class:`Chunk` for each piece of streamed text and a final
:class:`TurnDone`; :class:`SessionError` says, in one sentence, why a request
cannot be carried out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .stats import TurnStats


@dataclass
class GenerationSettings:
    """How replies are sampled. ``temp`` 0 is greedy, so runs are reproducible.
    ``ignore_eos`` generates ``max_tokens`` whatever the model says (benchmarks
    measure fixed lengths). ``seed`` makes a sampled reply's draws its own, whoever
    decodes beside it."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    prefill_step: int = 512
    ignore_eos: bool = False
    seed: int | None = None  # draws of a sampled reply repeat for the same seed


@dataclass(frozen=True)
class Prefill:
    """Prompt evaluation progress: ``done`` of ``total`` new tokens are in the cache."""

    done: int
    total: int


@dataclass(frozen=True)
class Chunk:
    """A piece of the streamed reply (untrusted model output)."""

    text: str


@dataclass(frozen=True)
class TurnDone:
    """The turn is over: the reply as kept in the transcript, what it cost, and the
    token ids that were generated (an end-of-sequence token included)."""

    reply: str
    stats: TurnStats
    stopped: bool
    tokens: tuple[int, ...] = ()


Event = Prefill | Chunk | TurnDone


class SessionError(Exception):
    """A request the session cannot carry out; the message says why, in one sentence."""


class SessionBusy(SessionError):
    """Another turn of this session is still running."""
