"""The parts of a request that describe a conversation: its messages (text content
parts, tool calls and their results) and the tools a client offers, checked strictly
(see :class:`Strict`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ApiError


class Strict(BaseModel):
    """A request part checked strictly: no field it lacks, no string for a number, no
    infinite or NaN float; a field it lacks sent as ``null`` counts as not sent."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unset_nulls(cls, data):
        """A field this model lacks, sent as ``null``, is not sent."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class ContentPart(Strict):
    """A part of a message's content; only ``text`` parts are taken (see :meth:`check`)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None

    def check(self, where: str) -> str:
        """The part's text, or an :class:`ApiError` saying why it cannot be taken."""
        if self.type == "text" and self.text is not None:
            return self.text
        if self.type == "text":
            raise ApiError(
                400, f"'{where}.text': a text part needs its text.", param=f"{where}.text"
            )
        what = self.type.removesuffix("_url").replace("_", " ")
        raise ApiError(
            400,
            f"This model takes text only: {what} content parts are not "
            f"supported ('{where}' is of type {self.type!r}).",
            param=where,
            code="unsupported_content",
        )


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def plain(self) -> dict:
        """The call as chat templates take it (its arguments an object, not a string)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


class Message(Strict):
    # ``function``: a legacy function's result (OpenAI's older name for a tool's)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # a legacy call: the reply's one tool call
    # a participant's name (rendered where the template reads it), or the function a
    # legacy result is from
    name: str | None = Field(None, max_length=256)

    @property
    def answers_a_call(self) -> bool:
        """Whether this is a tool's (or a legacy function's) result."""
        return self.role in ("tool", "function")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)

    def plain(self, names: bool = False) -> dict:
        """The message as a Session keeps it (``developer`` is the newer name for ``system``;
        a legacy ``function_call`` and ``function`` result are a tool call and its result,
        their id the function's name); with ``names``, a participant's name too."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if names and self.name is not None and self.role != "function":
            out["name"] = self.name
        calls = self.tool_calls or (
            [ToolCall(id=self.function_call.name, function=self.function_call)]
            if self.function_call
            else []
        )
        if calls:
            out["tool_calls"] = [call.plain() for call in calls]
        call_id = self.name if self.role == "function" else self.tool_call_id
        if call_id is not None:
            out["tool_call_id"] = call_id
        return out


class FunctionSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedChoice(Strict):
    type: Literal["function"]
    function: NamedFunction
