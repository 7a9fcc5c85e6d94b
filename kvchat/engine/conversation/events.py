"""What a turn is asked and yields, and how replies are sampled: the plain data of the
engine's API.

:meth:`kvchat.engine.conversation.session.Session.send` takes the request's
:class:`TurnOptions` and yields :class:`Prefill` while the prompt is evaluated,
:class:`Chunk` for each piece of streamed text (with a :class:`TokenLogprobs` per token
when asked) and a final :class:`TurnDone`; :class:`SessionError` says, in one sentence, why
a request cannot be carried out.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvchat.engine.conversation.stats import TurnStats

if TYPE_CHECKING:
    from collections.abc import Callable

    import mlx.core as mx

    from kvchat.engine.conversation.template import Variables


@dataclass
class GenerationSettings:
    """How replies are sampled (``kvchat/engine/generation/sampling.py`` turns these into mlx-lm's
    sampler and logits processors; ranges and help are in ``kvchat/settings.py``).
    ``temp`` 0 is greedy, so runs are reproducible; a ``seed`` makes a sampled reply's
    draws its own and reproducible, whoever decodes beside it. ``ignore_eos`` generates
    ``max_tokens`` whatever the model says (benchmarks measure fixed lengths)."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    prefill_step: int = 512
    ignore_eos: bool = False


@dataclass(frozen=True)
class TurnOptions:
    """What one request asks of a turn besides its message: passed to the turn (never set
    on the session), so the next request, and one running beside it, see the session as
    it was. The default asks nothing: the session's own settings, no tools.

    ``settings``: this turn's sampling in place of the session's (which stay as they are);
    ``start``: the reply's given beginning, which the turn continues; ``tools``: the
    function specs (OpenAI's) the chat template offers; ``variables``: the template's own
    (a thinking switch); ``report_logprobs``: yield a :class:`TokenLogprobs` with that many
    alternatives per token; ``logits_processors``: mlx-lm logits processors every sampled
    token goes through after the settings' penalties (a logit bias, a grammar). A plain
    completion has no chat template: it takes the settings, logprobs and processors only.
    """

    settings: GenerationSettings | None = None
    start: str = ""
    tools: list[dict[str, Any]] | None = None
    variables: Variables = None
    report_logprobs: int | None = None
    logits_processors: tuple[Callable[[mx.array, mx.array], mx.array], ...] = ()  # mlx-lm's

    def sampling(self, own: GenerationSettings) -> GenerationSettings:
        """The settings the turn samples with: this request's, else the session's ``own``."""
        return own if self.settings is None else self.settings


ASK_NOTHING = TurnOptions()  # a turn as the session is: its own settings, no tools


@dataclass(frozen=True)
class Prefill:
    """Prompt evaluation progress: ``done`` of ``total`` new tokens are in the cache."""

    done: int
    total: int


@dataclass(frozen=True)
class Chunk:
    """A piece of the streamed reply (untrusted model output); ``tokens``: the reply's
    tokens sampled so far (for a live count and rate)."""

    text: str
    tokens: int = 0


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log probability and the likeliest tokens' at its position
    (``top``: (token, log probability), most likely first). Yielded for each generated
    token, before its text's :class:`Chunk`, by a turn whose :class:`TurnOptions` set
    ``report_logprobs`` (to how many alternatives to give)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TurnDone:
    """The turn is over: the reply as kept in the transcript, what it cost, and the
    token ids that were generated (an end-of-sequence token included)."""

    reply: str
    stats: TurnStats
    stopped: bool
    tokens: tuple[int, ...] = ()


Event = Prefill | Chunk | TokenLogprobs | TurnDone
Turn = Generator[Event, None, None]  # a turn's events as they are read; close() ends it early


class SessionError(Exception):
    """A request the session cannot carry out; the message says why, in one sentence."""


class SessionBusy(SessionError):
    """Another turn of this session is still running."""
