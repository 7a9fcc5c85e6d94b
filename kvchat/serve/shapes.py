"""The reply's JSON in each endpoint's shape: chat completions and plain completions.

A shape is made per request (a plain completion's streamed log probabilities
count text offsets across chunks). ``whole`` is a non-streamed reply's choice;
``opening`` (if any), ``piece`` and ``closing`` are a streamed reply's.
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
from .jobs import Finished, Piece
from .logprobs import completion_shape

Report = Piece | Finished | ApiError  # what a job reports once it has started


class Reply(Protocol):
    """A reply in one API's format: the whole body, or the stream's server-sent events."""

    def whole(self, done: Finished) -> dict: ...

    def stream(self, reports: AsyncIterator[Report]) -> AsyncIterator[str]:
        """The events of ``reports`` (which end after a Finished or an ApiError)."""
        ...


class ChatShape:
    """``/v1/chat/completions``: a message, or deltas."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, logprobs: bool):
        self.logprobs = logprobs

    def opening(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}

    def piece(self, piece: Piece) -> dict:
        choice = {"index": 0, "delta": {"content": piece.text}, "finish_reason": None}
        if self.logprobs:
            choice["logprobs"] = {"content": list(piece.logprobs)}
        return choice

    def calls(self, done: Finished) -> dict | None:
        """The reply's tool calls as one delta (each whole, with its index), if any."""
        if not done.tool_calls:
            return None
        calls = [{"index": i, **call} for i, call in enumerate(done.tool_calls)]
        return {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}

    def closing(self, done: Finished) -> dict:
        return {"index": 0, "delta": {}, "finish_reason": done.finish_reason}

    def whole(self, done: Finished) -> dict:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": done.text or None if done.tool_calls else done.text,
        }
        if done.tool_calls:
            message["tool_calls"] = done.tool_calls
        return {
            "index": 0,
            "finish_reason": done.finish_reason,
            "message": message,
            "logprobs": {"content": done.logprobs} if self.logprobs else None,
        }


class CompletionShape:
    """``/v1/completions``: text, or text pieces."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, logprobs: bool):
        self.logprobs, self._offset = logprobs, 0

    def opening(self) -> dict | None:
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
    """A reply in OpenAI's envelope around ``shape``: an object, or ``data:`` chunks that end
    with ``[DONE]`` (the usage chunk before it when ``include_usage``)."""

    def __init__(self, shape: ChatShape | CompletionShape, model: str, include_usage: bool):
        self.shape, self.model, self.include_usage = shape, model, include_usage
        self.id = f"{shape.id_prefix}-{uuid.uuid4().hex}"

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}

    def whole(self, done: Finished) -> dict:
        return {
            **self._envelope(self.shape.object),
            "choices": [self.shape.whole(done)],
            "usage": done.usage,
            "kvchat": done.kvchat,
        }

    async def stream(self, reports: AsyncIterator[Report]) -> AsyncIterator[str]:
        base, shape = self._envelope(self.shape.chunk_object), self.shape

        def event(choices: list, **extra) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        if (opening := shape.opening()) is not None:
            yield event([opening])
        async for item in reports:
            if isinstance(item, Piece):
                yield event([shape.piece(item)])
            elif isinstance(item, ApiError):
                yield f"data: {json.dumps(item.body())}\n\n"
            else:
                if (calls := shape.calls(item)) is not None:
                    yield event([calls])
                # kvchat's object rides on the last chunk: the usage chunk when there is one
                if self.include_usage:
                    yield event([shape.closing(item)])
                    yield event([], usage=item.usage, kvchat=item.kvchat)
                else:
                    yield event([shape.closing(item)], kvchat=item.kvchat)
        yield "data: [DONE]\n\n"
