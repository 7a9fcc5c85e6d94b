"""What ``POST /v1/chat/completions`` accepts, checked with pydantic before anything runs.

Strict types (``"0.5"`` is not a temperature, ``true`` is not a token count);
fields kvchat does not use are ignored, as OpenAI's own server ignores what it
does not know, but the ones it does use are checked. Every problem becomes
:class:`ApiError`, which the app turns into OpenAI's error shape.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from kvchat import store
from kvchat.settings import API, model_fields
from kvchat.store.schema import _location


class ApiError(Exception):
    """A request refused with ``status``; ``message`` is one sentence for the client."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def plain(self) -> dict:
        """The message as a Session keeps it (``developer`` is the newer name for ``system``)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool = False


# the sampling fields (temperature, top_p, top_k, min_p, the penalties, seed, max_tokens),
# with the ranges kvchat/settings.py declares for them
_Sampling = create_model("_Sampling", __base__=_Strict, **model_fields(API, api=True))


class ChatRequest(_Sampling):
    """The fields of a chat completion request that kvchat honours."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=100_000)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=1, lt=1 << 31)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops

    def history(self) -> list[dict]:
        """Every message but the last, as plain role/content dicts."""
        return [m.plain() for m in self.messages[:-1]]

    def last_user_text(self) -> str:
        last = self.messages[-1]
        if last.role != "user":
            raise ApiError(400, "The last message must be the user's: kvchat answers it.",
                           param="messages")
        return last.text()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self) -> dict[str, object]:
        """The generation settings this request gives, by setting name (None: not given)."""
        given = {s.name: getattr(self, s.api) for s in API}
        return {**given, "max_tokens": self.token_limit()}


def parse_request(raw: bytes) -> ChatRequest:
    """Validate a request body; any problem is an :class:`ApiError` naming the field."""
    try:
        return ChatRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        raise ApiError(400, f"The body is not valid JSON: {first['msg']}.")
    loc = _field_path(first["loc"])
    where = _location(loc) or "body"
    if where == "messages" and first["type"] == "too_short":
        raise ApiError(400, "'messages' is empty: send at least one message.", param="messages")
    # a union (``stop``: a string or a list) fails once per member: say them together
    said = " or ".join(dict.fromkeys(e["msg"] for e in errors if _field_path(e["loc"]) == loc))
    raise ApiError(400, f"'{where}': {said}.", param=where)


def _field_path(loc: tuple) -> tuple:
    """``loc`` without pydantic's union member tags (``'str'``, ``'list[str]'``)."""
    return tuple(p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TAGS))


_TAGS = {"str", "int", "float", "bool", "none"}


def session_name(header: str | None, user: str | None) -> str | None:
    """The session a request names (``X-Session-Id`` first, then ``user``), checked."""
    name = header if header is not None else user
    if name is None:
        return None
    try:
        return store.check_name(name)
    except store.StoreError as exc:
        param = "X-Session-Id" if header is not None else "user"
        raise ApiError(400, str(exc), param=param, code="invalid_session_name") from None
