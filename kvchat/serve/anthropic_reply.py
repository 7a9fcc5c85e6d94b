"""A reply in Anthropic's Messages format: a ``message`` object, or its stream of named
server-sent events (``message_start``, ``ping``, a ``content_block_start`` /
``content_block_delta`` / ``content_block_stop`` run per text or ``tool_use`` block,
``message_delta`` with the stop reason and usage, ``message_stop``), and Anthropic's
error shape.

Usage counts as Anthropic's does: ``input_tokens`` are the prompt's tokens evaluated
for this request, ``cache_read_input_tokens`` those its cache already held (their sum is
the prompt, OpenAI's ``prompt_tokens``); kvchat keeps every prefix without being asked,
so ``cache_creation_input_tokens`` is 0. A stream's ``message_start`` says the prompt's
tokens as its turn starts (those the cache holds, and the rest, to be evaluated); its
``message_delta`` says them again when the reply is done, with the tokens generated.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .errors import ApiError
from .jobs import Finished, Piece, Started
from .shapes import Report

# Anthropic's error types by the HTTP statuses kvchat answers with
_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(error: ApiError) -> dict:
    """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(
        error.status, "invalid_request_error" if error.status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def stop_reason(done: Finished) -> str:
    if done.tool_calls:
        return "tool_use"
    if done.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


def usage(done: Finished) -> dict[str, int]:
    reused = done.kvchat["reused_tokens"]
    return {
        "input_tokens": done.usage["prompt_tokens"] - reused,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused,
        "output_tokens": done.usage["completion_tokens"],
    }


def _tool_use(call: dict) -> dict[str, Any]:
    """An OpenAI-shaped tool call as a ``tool_use`` block (its input an object)."""
    arguments = json.loads(call["function"]["arguments"])
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class AnthropicReply:
    """A :class:`~kvchat.serve.shapes.Reply` in Anthropic's Messages format."""

    def __init__(self, model: str):
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"

    def _message(self, content: list[dict], **rest: Any) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **rest,
        }

    def whole(self, done: Finished) -> dict:
        text = [{"type": "text", "text": done.text}] if done.text else []
        return self._message(
            [*text, *map(_tool_use, done.tool_calls or [])],
            stop_reason=stop_reason(done),
            stop_sequence=done.stop_sequence,
            usage=usage(done),
            kvchat=done.kvchat,
        )

    async def stream(self, started: Started, reports: AsyncIterator[Report]) -> AsyncIterator[str]:
        cached = started.cached_tokens
        prompt = {
            "input_tokens": started.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": 0,
        }
        message = self._message([], stop_reason=None, stop_sequence=None, usage=prompt)
        yield _event("message_start", message=message)
        yield _event("ping")
        blocks = 0  # content blocks opened so far; a text block is open while texting
        texting = False
        async for item in reports:
            if isinstance(item, Piece) and item.text:
                if not texting:
                    text = {"type": "text", "text": ""}
                    yield _event("content_block_start", index=blocks, content_block=text)
                    texting, blocks = True, blocks + 1
                piece = {"type": "text_delta", "text": item.text}
                yield _event("content_block_delta", index=blocks - 1, delta=piece)
            elif isinstance(item, ApiError):
                yield _event("error", error=anthropic_error(item)["error"])
            elif isinstance(item, Finished):
                if texting:
                    yield _event("content_block_stop", index=blocks - 1)
                for call in item.tool_calls or []:
                    block = {**_tool_use(call), "input": {}}
                    yield _event("content_block_start", index=blocks, content_block=block)
                    delta = {
                        "type": "input_json_delta",
                        "partial_json": call["function"]["arguments"],
                    }
                    yield _event("content_block_delta", index=blocks, delta=delta)
                    yield _event("content_block_stop", index=blocks)
                    blocks += 1
                reason = {"stop_reason": stop_reason(item), "stop_sequence": item.stop_sequence}
                yield _event("message_delta", delta=reason, usage=usage(item), kvchat=item.kvchat)
                yield _event("message_stop")
