"""What ``POST /v1/messages`` (Anthropic's Messages API) accepts, and the chat request it
becomes.

A messages request is checked strictly (as :mod:`kvchat.serve.schema` checks OpenAI's)
and translated to the :class:`~kvchat.serve.schema.ChatRequest` the chat completions
route would build for the same conversation: the system prompt a system message,
``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result`` blocks
``tool`` messages. So both routes run on the same sessions, prefix matching and batch,
and a conversation sent through either finds the other's cache.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, create_model, field_validator

from kvchat.engine.conversation.template import render
from kvchat.settings import API, model_fields

from .errors import ApiError
from .messages import ContentPart, Strict
from .schema import ChatRequest

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel


class _Block(Strict):
    """A content block; ``cache_control`` is accepted and ignored (kvchat caches every
    prefix on its own)."""

    cache_control: dict | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict] | None = None  # accepted and ignored


class ToolUseBlock(_Block):
    """A tool call the model made (an assistant message's)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict
    caller: dict | None = None  # who made the call (Anthropic's code execution): ignored


class ThinkingBlock(_Block):
    """An earlier reply's thinking, sent back by clients of models that think: left out of
    the prompt (as Anthropic leaves earlier turns' thinking out)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["thinking", "redacted_thinking"]


class ToolResultBlock(_Block):
    """What a tool returned (a user message's); ``is_error`` is accepted and ignored."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


def _kind(block: Any) -> str:
    """A block's type where kvchat takes it, else ``other``: an image or a document is a
    :class:`~kvchat.serve.messages.ContentPart`, refused by name as the chat route refuses it."""
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if kind in ("text", "tool_use", "tool_result") else "other"


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ContentPart, Tag("other")],
    Discriminator(_kind),
]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def openai(self) -> list[dict]:
        """The message in OpenAI's chat shape: one message, or (a user's tool results) a
        ``tool`` message per result, then the user's text if any."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in self.content
                if isinstance(b, ToolUseBlock)
            ]
            return [
                {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            ]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        said = [{"role": "user", "content": text}] if text or not results else []
        return [*results, *said]


class AnthropicTool(Strict):
    """A client tool; Anthropic's server tools (``web_search_…``, ``bash_…``) are not
    taken: kvchat cannot run them."""

    type: str | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None  # accepted and ignored

    @field_validator("type")
    @classmethod
    def _client_tool(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(
                f"{kind!r} is one of Anthropic's server tools, which kvchat cannot run"
            )
        return kind

    def openai(self) -> dict:
        spec = {"name": self.name, "parameters": self.input_schema}
        return {
            "type": "function",
            "function": {**spec, **({"description": self.description} if self.description else {})},
        }


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def openai(self) -> str | dict:
        """The choice as OpenAI's ``tool_choice`` (``any`` is ``required``)."""
        if self.type == "tool":
            if self.name is None:
                raise ApiError(
                    400, "'tool_choice.name' is needed with type tool.", param="tool_choice.name"
                )
            return {"type": "function", "function": {"name": self.name}}
        return "required" if self.type == "any" else self.type


class Thinking(Strict):
    """Extended thinking, which clients ask for on their own: accepted and ignored (the
    templates kvchat serves have no thinking budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(Strict):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(Strict):
    """``output_config``: a JSON schema the reply is held to (as OpenAI's
    ``response_format``); ``effort`` is accepted and ignored."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None

    def response_format(self) -> dict | None:
        """The format as OpenAI's ``response_format``, if one is asked for."""
        if self.format is None:
            return None
        return {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": self.format.json_schema},
        }


class CountRequest(Strict):
    """``POST /v1/messages/count_tokens``: a conversation and its tools, not answered."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=100_000)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat_request(self, **generation: Any) -> ChatRequest:
        """The chat completions request of this conversation, with ``generation``'s fields."""
        system = self.system if isinstance(self.system, str) else None
        if isinstance(self.system, list):
            system = "\n".join(block.text for block in self.system)
        openai: dict[str, Any] = {
            "messages": [
                *([{"role": "system", "content": system}] if system else []),
                *(m for message in self.messages for m in message.openai()),
            ],
            **generation,
        }
        if self.tools:
            openai["tools"] = [tool.openai() for tool in self.tools]
        if self.tool_choice is not None:
            openai["tool_choice"] = self.tool_choice.openai()
            openai["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return ChatRequest.model_validate(openai)


# temperature, top_p and top_k, with the ranges kvchat/settings.py declares for them
if TYPE_CHECKING:  # a model made at run time: a checker sees its fields as Any

    class _Sampling(CountRequest):
        def __getattr__(self, name: str) -> Any: ...

else:
    _Sampling = create_model(
        "_Sampling",
        __base__=CountRequest,
        **model_fields(
            tuple(s for s in API if s.api in ("temperature", "top_p", "top_k")), api=True
        ),
    )


class MessagesRequest(_Sampling):
    """``POST /v1/messages``: the fields kvchat honours, and those it accepts and ignores."""

    max_tokens: int = Field(ge=1, lt=1 << 53)  # required, as Anthropic's API has it
    stream: bool = False
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=4)
    output_config: OutputConfig | None = None
    # sent by clients on their own; they do not change the reply: accepted and ignored
    metadata: dict[str, str | None] | None = Field(None, max_length=16)
    cache_control: dict | None = None  # kvchat caches every prefix on its own
    service_tier: str | None = Field(None, max_length=64)
    inference_geo: str | None = Field(None, max_length=64)
    speed: Literal["standard", "fast"] | None = None

    def chat(self) -> ChatRequest:
        """The chat completions request that answers this one."""
        output = self.output_config.response_format() if self.output_config else None
        return self.chat_request(
            response_format=output,
            max_tokens=self.max_tokens,
            stream=self.stream,
            stop=self.stop_sequences or [],
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


def input_tokens(lm: LoadedModel, req: ChatRequest) -> int:
    """How many tokens ``req``'s prompt is: its messages through the chat template, with
    its tools, the assistant's turn opened (as a turn renders it)."""
    return len(render(lm, [*req.history(), *req.new_messages()], True, req.tool_specs()))
