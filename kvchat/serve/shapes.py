"""The reply's JSON in each endpoint's shape: chat completions and plain completions.

A shape is made per request (a plain completion's streamed log probabilities
count text offsets across chunks). ``whole`` is a non-streamed reply's choice;
``opening`` (if any), ``piece`` and ``closing`` are a streamed reply's; each
carries its reply's index (``n`` > 1: several replies).
:class:`OpenAIReply` wraps a shape in OpenAI's envelope: a :class:`Reply`, as the
app writes every API's replies (:mod:`kvchat.serve.anthropic_reply` is Anthropic's).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from .errors import ApiError
from .jobs import Finished, Piece, Started
from .logprobs import completion_shape

Report = Piece | Finished | ApiError  # what a job reports once it has started


class Reply(Protocol):
    """A reply in one API's format: the whole body, or the stream's server-sent events."""

    def whole(self, done: Finished) -> dict: ...

    def stream(self, started: Started, reports: AsyncIterator[Report]) -> AsyncIterator[str]:
        """The events of the job ``started`` and its ``reports`` (which end after a
        Finished or an ApiError)."""
        ...


class ChatShape:
    """``/v1/chat/completions``: a message, or deltas; a ``legacy`` request's (it offered
    ``functions``) call is ``function_call``, its finish reason ``function_call``."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, logprobs: bool, legacy: bool = False):
        self.logprobs, self.legacy = logprobs, legacy

    def _said(self, done: Finished) -> tuple[dict, str]:
        """The reply's calls as its message (or delta) carries them, and its finish reason."""
        if not done.tool_calls:
            return {}, done.finish_reason
        if self.legacy:
            return {"function_call": done.tool_calls[0]["function"]}, "function_call"
        return {"tool_calls": done.tool_calls}, done.finish_reason

    def opening(self, index: int) -> dict | None:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
        }

    def piece(self, piece: Piece) -> dict:
        choice = {"index": piece.index, "delta": {"content": piece.text}, "finish_reason": None}
        if self.logprobs:
            choice["logprobs"] = {"content": list(piece.logprobs)}
        return choice

    def calls(self, done: Finished) -> dict | None:
        """The reply's tool calls as one delta (each whole, with its index), if any."""
        if not done.tool_calls:
            return None
        delta, _ = self._said(done)
        if "tool_calls" in delta:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(done.tool_calls)]}
        return {"index": done.index, "delta": delta, "finish_reason": None}

    def closing(self, done: Finished) -> dict:
        return {"index": done.index, "delta": {}, "finish_reason": self._said(done)[1]}

    def whole(self, done: Finished) -> dict:
        said, reason = self._said(done)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": done.text or None if done.tool_calls else done.text,
            **said,
        }
        return {
            "index": done.index,
            "finish_reason": reason,
            "message": message,
            "logprobs": {"content": done.logprobs} if self.logprobs else None,
        }


class CompletionShape:
    """``/v1/completions``: text, or text pieces."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, logprobs: bool):
        self.logprobs, self._offset = logprobs, 0

    def opening(self, index: int) -> dict | None:
        return None

    def piece(self, piece: Piece) -> dict:
        logprobs = completion_shape(list(piece.logprobs), self._offset) if self.logprobs else None
        self._offset += sum(len(e["token"]) for e in piece.logprobs)
        return {"index": 0, "text": piece.text, "finish_reason": None, "logprobs": logprobs}

    def calls(self, done: Finished) -> dict | None:
        return None

    def closing(self, done: Finished) -> dict:
        return {"index": 0, "text": "", "finish_reason": done.finish_reason, "logprobs": None}

    def whole(self, done: Finished) -> dict:
        return {
            "index": 0,
            "text": done.text,
            "finish_reason": done.finish_reason,
            "logprobs": (
                completion_shape(done.logprobs)
                if self.logprobs and done.logprobs is not None
                else None
            ),
        }


class OpenAIReply:
    """``n`` replies in OpenAI's envelope around ``shape``: an object, or ``data:`` chunks
    (each choice with its reply's index) that end with ``[DONE]`` (the usage chunk before
    it when ``include_usage``)."""

    def __init__(
        self, shape: ChatShape | CompletionShape, model: str, include_usage: bool, n: int = 1
    ):
        self.shape, self.model, self.include_usage, self.n = shape, model, include_usage, n
        self.id = f"{shape.id_prefix}-{uuid.uuid4().hex}"

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}

    def whole(self, done: Finished) -> dict:
        return {
            **self._envelope(self.shape.object),
            "choices": [self.shape.whole(reply) for reply in done.replies],
            "usage": done.usage,
            "kvchat": done.kvchat,
        }

    async def stream(self, started: Started, reports: AsyncIterator[Report]) -> AsyncIterator[str]:
        base, shape = self._envelope(self.shape.chunk_object), self.shape

        def event(choices: list, **extra) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        for index in range(self.n):
            if (opening := shape.opening(index)) is not None:
                yield event([opening])
        async for item in reports:
            if isinstance(item, Piece):
                yield event([shape.piece(item)])
            elif isinstance(item, ApiError):
                yield f"data: {json.dumps(item.body())}\n\n"
            else:
                for reply in item.replies:
                    if (calls := shape.calls(reply)) is not None:
                        yield event([calls])
                *before, last = [shape.closing(reply) for reply in item.replies]
                for closing in before:
                    yield event([closing])
                # kvchat's object rides on the last chunk: the usage chunk when there is one
                if self.include_usage:
                    yield event([last])
                    yield event([], usage=item.usage, kvchat=item.kvchat)
                else:
                    yield event([last], kvchat=item.kvchat)
        yield "data: [DONE]\n\n"
