"""What ``POST /v1/chat/completions`` accepts, checked with pydantic before anything runs.

Strict types (``"0.5"`` is not a temperature, ``true`` is not a token count).
A field that would change the reply and that kvchat does not honour is refused with a
400 that names it; the fields clients send on their own that do not change the reply
(``store``, ``metadata``, ``service_tier``, …) are accepted and ignored; a field sent
as ``null`` is taken as not sent (clients echo back ``"tool_calls": null`` and the like). Every problem becomes
:class:`~kvchat.serve.errors.ApiError`, which the app turns into OpenAI's error shape.
The messages and tools a request carries are checked by :mod:`kvchat.serve.messages`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from kvchat import store
from kvchat.engine.conversation.template import thinking_variables
from kvchat.settings import API, model_fields
from kvchat.store.schema import error_location

from .errors import ApiError
from .messages import (
    ContentPart,
    FunctionSpec,
    Message,
    NamedChoice,
    NamedFunction,
    Strict,
    Tool,
)

MAX_REPLIES = 16  # a chat request's ``n``: each reply holds a copy of the prompt's cache


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields:
    """The sampling fields of a request as a type checker sees them (a misspelled one is
    an error); the model is made at run time from kvchat/settings.py's table, with its
    ranges, and tests/test_serve_schema_types.py checks the two agree."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    repetition_context_size: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None


# the sampling fields (temperature, top_p, top_k, min_p, the penalties, seed, max_tokens),
# with the ranges kvchat/settings.py declares for them
if TYPE_CHECKING:  # a model made at run time: what a checker can see
    from kvchat.engine.models.model import LoadedModel

    class _Sampling(Strict, SamplingFields): ...

else:
    _Sampling = create_model("_Sampling", __base__=Strict, **model_fields(API, api=True))


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    json_schema: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    """``response_format``: plain text, any JSON object, or JSON valid against a schema
    (held to it by constrained decoding, :mod:`kvchat.serve.constrain`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def required_schema(self) -> dict | None:
        """The JSON schema the reply must validate against; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type != "json_schema":
            return None
        if self.json_schema is None:
            raise ApiError(
                400,
                "'response_format.json_schema' is needed with type json_schema.",
                param="response_format.json_schema",
            )
        return self.json_schema.json_schema


class _Generation(_Sampling):
    """The fields every generating request shares (chat and plain completions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=1)  # a chat request may ask for more
    user: str | None = None  # the end user's id: any string; it names no session
    # sent by clients on their own; they do not change the reply: accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=256)
    cache_prompt: bool | None = None  # llama.cpp's; kvchat always reuses the cached prefix
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 9):
                raise ValueError(f"keys are token ids written as numbers (got {token[:20]!r})")
            if not -100 <= bias <= 100:
                raise ValueError("biases are between -100 and 100")
        return value

    def biases(self, vocab: int) -> dict[int, float]:
        """``logit_bias`` by token id; an id past the model's vocabulary is refused."""
        biases = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        for token in biases:
            if token >= vocab:
                raise ApiError(
                    400,
                    f"'logit_bias' names token {token}, past this model's vocabulary of {vocab}.",
                    param="logit_bias",
                )
        return biases

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        """How many alternatives to report with each token's log probability; None: no
        log probabilities."""
        return None

    def sampling(self) -> dict[str, object]:
        """The generation settings this request gives, by setting name (None: not given)."""
        given = {s.name: getattr(self, s.api) for s in API}
        return {**given, "max_tokens": self.token_limit()}

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    """The fields of a chat completion request that kvchat honours."""

    messages: list[Message] = Field(min_length=1, max_length=100_000)
    n: int = Field(1, ge=1, le=MAX_REPLIES)  # replies to one prompt (kvchat/serve/choices.py)
    max_completion_tokens: int | None = Field(None, ge=1, lt=1 << 31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True  # false: a reply's first call is its only one
    # OpenAI's legacy names for tools and tool_choice (see _legacy_functions)
    functions: list[FunctionSpec] | None = Field(None, max_length=128)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # names the conversation's cache, as X-Session-Id does (see cache_key_session)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    # the template's thinking switch, where it has one (see template_variables)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # accepted and ignored (none changes the reply of the models kvchat templates for)
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict | None = None
    modalities: list[Literal["text"]] | None = None

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatRequest:
        """``functions`` and ``function_call`` as the ``tools`` and ``tool_choice`` they
        stand for (one call a reply, as legacy replies carry one); the reply says its call
        in the legacy shape (:attr:`legacy`)."""
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            given = self.model_fields_set
            new = " and ".join(f"'{f}'" for f in ("tools", "tool_choice") if f in given)
            old = [f for f in ("functions", "function_call") if f in given]
            raise ApiError(
                400,
                f"Both {new} and the legacy {' and '.join(map(repr, old))} are set: send one "
                "or the other ('functions' is the older name for 'tools', 'function_call' "
                "for 'tool_choice').",
                param=old[0],
            )
        if self.functions:
            self.tools = [Tool(type="function", function=f) for f in self.functions]
        if isinstance(self.function_call, NamedFunction):
            self.tool_choice = NamedChoice(type="function", function=self.function_call)
        else:
            self.tool_choice = self.function_call
        self.parallel_tool_calls = False
        return self

    @property
    def legacy(self) -> bool:
        """Whether the request offers its tools as legacy ``functions`` (the reply's call
        is then ``message.function_call``, finish reason ``function_call``)."""
        return self.functions is not None or self.function_call is not None

    def _split(self) -> tuple[int, int]:
        """Where the new messages start and end: the last one if it is the user's, else the
        run of tool results that ends the conversation; a trailing assistant message (the
        reply's given start, :meth:`start`) comes after them."""
        end = len(self.messages)
        last = self.messages[-1]
        if last.role == "assistant":
            if last.tool_calls or last.function_call:
                raise ApiError(
                    400,
                    "The last message is the assistant's tool call: send the tools' "
                    "results after it.",
                    param="messages",
                )
            end -= 1
        if end and self.messages[end - 1].role == "user":
            return end - 1, end
        at = end
        while at > 0 and self.messages[at - 1].answers_a_call:
            at -= 1
        if at == end:
            raise ApiError(
                400,
                "The last message must be the user's or a tool's result (or the start of "
                "the assistant's reply to them, which kvchat continues): kvchat answers it.",
                param="messages",
            )
        return at, end

    def history(self, names: bool = False) -> list[dict]:
        """The messages before the new ones, as the session keeps them (with ``names``:
        their participants' names, for a template that renders them)."""
        return [m.plain(names) for m in self.messages[: self._split()[0]]]

    def new_messages(self, names: bool = False) -> list[dict]:
        """What this request adds: the user's message, or the tools' results."""
        at, end = self._split()
        return [m.plain(names) for m in self.messages[at:end]]

    def template_variables(self, lm: LoadedModel) -> dict[str, Any]:
        """The variables this request sets in ``lm``'s chat template: its
        ``reasoning_effort`` as the template's thinking switch (none where it has none)."""
        return thinking_variables(lm, self.reasoning_effort) if self.reasoning_effort else {}

    def start(self) -> str:
        """The reply's given start (a trailing assistant message's text, which the reply
        continues); empty when the conversation ends with the user or a tool."""
        return self.messages[-1].text() if self._split()[1] < len(self.messages) else ""

    def tool_specs(self) -> list[dict] | None:
        """The tools offered to the model (OpenAI's function specs), checked against
        ``tool_choice``."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ApiError(
                    400, "'tool_choice' names a tool, but 'tools' offers none.", param="tool_choice"
                )
            return None
        names = [t.function.name for t in self.tools]
        if (
            isinstance(self.tool_choice, NamedChoice)
            and self.tool_choice.function.name not in names
        ):
            raise ApiError(
                400,
                f"'tool_choice' names {self.tool_choice.function.name!r}, "
                "which 'tools' does not offer.",
                param="tool_choice",
            )
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> list[Tool]:
        """The tools one of which the reply must call (``required`` or a named one)."""
        if self.tool_choice == "required":
            return list(self.tools or [])
        if isinstance(self.tool_choice, NamedChoice):
            return [
                t for t in self.tools or [] if t.function.name == self.tool_choice.function.name
            ]
        return []

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    """The fields of a plain (legacy) completion request that kvchat honours."""

    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)

    def text(self) -> str:
        """The one prompt (a list must hold exactly one: kvchat answers one at a time)."""
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1 or not prompts[0]:
            raise ApiError(400, "'prompt' must be one non-empty string.", param="prompt")
        return prompts[0]

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(raw: bytes, model: type[RequestT]) -> RequestT:
    """Validate a request body as ``model``; any problem is an :class:`ApiError` naming
    the field."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
    else:
        for i, message in enumerate(getattr(request, "messages", ())):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, ContentPart):  # (the others: Anthropic's typed blocks)
                    part.check(f"messages[{i}].content[{j}]")
        return request
    first = errors[0]
    if first["type"] == "json_invalid":
        raise ApiError(400, f"The body is not valid JSON: {first['msg']}.")
    loc = _field_path(first["loc"])
    where = error_location(loc) or "body"
    if first["type"] == "extra_forbidden":
        raise ApiError(
            400,
            f"'{where}' is not supported by kvchat serve: send the request "
            "without it (docs/serve-api.md lists what is).",
            param=where,
            code="unsupported_field",
        )
    if where == "messages" and first["type"] == "too_short":
        raise ApiError(400, "'messages' is empty: send at least one message.", param="messages")
    # a union (``stop``: a string or a list) fails once per member: say them together
    said = " or ".join(dict.fromkeys(e["msg"] for e in errors if _field_path(e["loc"]) == loc))
    raise ApiError(400, f"'{where}': {said}.", param=where)


def _field_path(loc: tuple) -> tuple:
    """``loc`` without pydantic's union member tags (``'str'``, ``'list[str]'``)."""
    return tuple(p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TAGS))


_TAGS = {"str", "int", "float", "bool", "none"}


def cache_key_session(key: str) -> str:
    """The session a ``prompt_cache_key`` names: the key itself where it is a valid session
    name, else ``key-`` and a hash of it (any string is a key; a name is not)."""
    try:
        return store.check_name(key)
    except store.StoreError:
        return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def session_name(header: str | None) -> str | None:
    """The session a request names with ``X-Session-Id``, checked. (OpenAI's ``user`` is
    the end user's id: one user has many conversations, so it names none.)"""
    if header is None:
        return None
    try:
        return store.check_name(header)
    except store.StoreError as exc:
        raise ApiError(400, str(exc), param="X-Session-Id", code="invalid_session_name") from None
