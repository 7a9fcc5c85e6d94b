"""Messages a conversation's worker threads post back to the UI thread (the messages the
tab posts to the app are beside it, in ``chat.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.message import Message

from kvchat.engine.conversation.events import TurnDone
from kvchat.engine.conversation.stats import CacheFigures


class TurnEvent(Message):
    """Something the turn worker reports to its conversation."""


class Waiting(TurnEvent):
    def __init__(self, ahead: int) -> None:
        super().__init__()
        self.ahead = ahead


class Started(TurnEvent):
    """The turn goes to the model; ``figures`` are its session's just before."""

    def __init__(self, figures: CacheFigures | None = None) -> None:
        super().__init__()
        self.figures = figures


class PrefillProgress(TurnEvent):
    def __init__(self, done: int, total: int, label: str, unit: str = "tokens") -> None:
        super().__init__()
        self.done, self.total, self.label, self.unit = done, total, label, unit


class ReplyChunk(TurnEvent):
    def __init__(self, text: str, tokens: int) -> None:
        super().__init__()
        self.text, self.tokens = text, tokens  # the reply's tokens so far


class TurnFinished(TurnEvent):
    def __init__(self, done: TurnDone | None, error: str | None, cancelled: bool = False) -> None:
        super().__init__()
        self.done, self.error, self.cancelled = done, error, cancelled


class JobFinished(TurnEvent):
    def __init__(
        self,
        label: str,
        result: Any,
        error: str | None,
        then: Callable | None,
        refusal: str | None = None,
    ) -> None:
        super().__init__()
        self.label, self.result, self.error, self.then = label, result, error, then
        self.refusal = refusal  # the session refused the job, in one sentence
