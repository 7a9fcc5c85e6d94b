"""Tool calls: found in the reply with mlx-lm's parser for the model, forced by a grammar.

mlx-lm's tokenizer wrapper knows a model's tool-call format from its chat
template (``tool_call_start``, ``tool_call_end``, ``tool_parser``). The reply's
text between those markers is parsed into OpenAI's ``tool_calls``; the text
outside them is the reply's content. A forced ``tool_choice`` (``required`` or
a named function) holds the reply to one call whose ``arguments`` validate
against the function's JSON schema, by llguidance (:mod:`kvchat.serve.constrain`);
that needs a format whose calls are JSON between the markers (mlx-lm's
``json_tools`` kind, Qwen's and Hermes' templates).
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from .constrain import Opened, closed, lark_grammar
from .errors import ApiError

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

    from .messages import Tool


def marker(lm: LoadedModel) -> str | None:
    """The text that opens a tool call in this model's replies (None: it has no tools)."""
    tokenizer = lm.tokenizer
    return tokenizer.tool_call_start if tokenizer.has_tool_calling else None


def check_offered(lm: LoadedModel) -> None:
    """Refuse ``tools`` for a model whose chat template cannot offer them."""
    if marker(lm) is None:
        raise ApiError(
            400,
            f"'tools': the chat template of {lm.model_id} has no tool calls, "
            "so kvchat cannot offer it tools.",
            param="tools",
        )


def split(lm: LoadedModel, reply: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """The reply's content (the text outside tool calls) and its calls in OpenAI's shape
    (``arguments`` a JSON string). A call that does not parse stays in the content."""
    start, end = lm.tokenizer.tool_call_start, lm.tokenizer.tool_call_end
    content, calls, rest = [], [], reply
    while (at := rest.find(start)) >= 0:
        content.append(rest[:at])
        close = rest.find(end, at + len(start))
        body = rest[at + len(start) : close if close >= 0 else len(rest)]
        parsed = _parse(lm, body, tools)
        if parsed is None:
            content.append(rest[at:] if close < 0 else rest[at : close + len(end)])
        else:
            calls.append(parsed)
        rest = "" if close < 0 else rest[close + len(end) :]
    content.append(rest)
    return "".join(content).strip(), calls


def _parse(lm: LoadedModel, body: str, tools: list[dict]) -> dict | None:
    try:
        found: Any = lm.tokenizer.tool_parser(body, tools)
    except Exception:  # the model's text is untrusted: a call that does not parse is text
        return None
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        return None
    arguments = found.get("arguments", {})
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {
            "name": found["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def plain(calls: list[dict]) -> list[dict]:
    """Calls as the transcript keeps them for the chat template (arguments an object)."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = call["function"]["arguments"]
        out.append({**call, "function": {**call["function"], "arguments": arguments}})
    return out


# Templates write a call's arguments with Jinja's ``tojson`` (``json.dumps``' spacing, keys
# sorted): a forced call is generated the same way, so the transcript renders to the
# tokens the model produced and the next turn reuses them all.
_AS_TEMPLATES_WRITE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _sorted(schema):
    """``schema`` with every ``properties`` in key order (the order its JSON is written in)."""
    if isinstance(schema, list):
        return [_sorted(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _sorted(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = dict(sorted(out["properties"].items()))
    return out


def _call_schema(tools: list[Tool]) -> dict:
    """The JSON of one call of one of ``tools``, its arguments valid against the
    function's parameters schema, written as templates write it."""
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": closed(_sorted(t.function.parameters or {"type": "object"})),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return {**schema, "x-guidance": _AS_TEMPLATES_WRITE}


def _holds_calls(lm: LoadedModel) -> bool:
    """Whether this model's calls are JSON between ``<tool_call>`` tags (a grammar can
    hold them)."""
    tokenizer = lm.tokenizer
    return (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")


def forced_grammar(lm: LoadedModel, tools: list[Tool]) -> str:
    """The grammar of one call of one of ``tools``, its arguments valid against the
    function's parameters schema, in this model's format."""
    check_offered(lm)
    if not _holds_calls(lm):
        raise ApiError(
            400,
            f"'tool_choice': {lm.model_id}'s tool-call format "
            f"({lm.tokenizer.tool_call_start}) cannot be forced; use 'auto'.",
            param="tool_choice",
        )
    return lark_grammar(
        f"start: {json.dumps('<tool_call>' + chr(10))} call "
        f"{json.dumps(chr(10) + '</tool_call>')}\ncall: %json {json.dumps(_call_schema(tools))}",
        "tool_choice",
    )


def opened_grammar(lm: LoadedModel, tools: list[Tool]) -> Opened | None:
    """What holds a call the model opens on its own (``tool_choice`` ``auto``) to one
    valid call of one of ``tools``, from its ``<tool_call>`` marker on; None where the
    model's format is not one a grammar holds (its calls are then read as written)."""
    if not _holds_calls(lm):
        return None
    rest = lark_grammar(
        f"start: {json.dumps(chr(10))} call {json.dumps(chr(10) + '</tool_call>')}\n"
        f"call: %json {json.dumps(_call_schema(tools))}",
        "tools",
    )
    return Opened("<tool_call>", rest)
