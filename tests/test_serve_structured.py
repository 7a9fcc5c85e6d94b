"""`kvchat serve`: response_format held by constrained decoding (llguidance), cache reuse kept."""

from __future__ import annotations

import json

import pytest
from serve_helpers import Server, chat

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rainy": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
    },
    "required": ["city", "rainy", "level"],
    "additionalProperties": False,
}


def valid(value, schema: dict) -> bool:
    """A small JSON-schema check: the keywords these tests use, nothing more."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(valid(v, props[k]) for k, v in value.items() if k in props)
    raise AssertionError(f"the check does not know {schema}")


def test_valid_checks_what_it_says():
    good = {"city": "Oslo", "rainy": True, "level": "low"}
    assert valid(good, WEATHER)
    assert not valid({**good, "level": "none"}, WEATHER)
    assert not valid({**good, "extra": 1}, WEATHER)
    assert not valid({"city": "Oslo", "rainy": True}, WEATHER)
    assert not valid({**good, "city": "x" * 11}, WEATHER)


def test_a_json_schema_reply_parses_and_validates_and_reuses_the_history(demo_model, home):
    first = [{"role": "user", "content": "What is the weather in Oslo?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    with Server(demo_model) as server:
        reply1, body1, _ = chat(server.client, first, max_tokens=8)
        follow = [
            *first,
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "As JSON, please."},
        ]
        reply2, body2, _ = chat(server.client, follow, max_tokens=80, response_format=fmt)
        assert valid(json.loads(reply2), WEATHER), reply2
        assert body2["choices"][0]["finish_reason"] == "stop"
        assert body2["kvchat"]["match"] == "continued"
        assert (
            body2["usage"]["prompt_tokens_details"]["cached_tokens"]
            >= body1["usage"]["prompt_tokens"]
        )
        # streamed, the same
        stream = server.client.chat.completions.create(
            model="demo",
            messages=follow,
            max_tokens=80,
            temperature=0,
            stream=True,
            response_format=fmt,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert valid(json.loads(text), WEATHER), text


def test_json_object_starts_an_object_and_keeps_to_json(demo_model, home):
    """Any JSON object: the tiny demo model may ramble inside a string until the token
    limit, so the reply is checked as the start of an object (completed by closing it)."""
    with Server(demo_model) as server:
        reply, body, _ = chat(
            server.client,
            [{"role": "user", "content": "Anything."}],
            max_tokens=40,
            response_format={"type": "json_object"},
        )
        assert reply.startswith("{"), reply
        if body["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(reply), dict)
        else:
            assert any(_parses(reply + end) for end in ('"}', '":0}', "}", ":0}", "0}")), reply


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_is_refused_before_anything_runs(demo_model, home, fmt, param):
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
    ).encode()
    with Server(demo_model) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == param, reply
        assert server.pool.names() == []


def test_closed_bounds_what_a_schema_leaves_open():
    from kvchat.serve.constrain import INTEGER_BOUND, STRING_MAX, closed

    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "kind": {"type": "string", "enum": ["a", "b"]},
            "open": {"type": "object", "additionalProperties": True, "properties": {}},
        },
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["age"] == {
        "type": "integer",
        "minimum": -INTEGER_BOUND,
        "maximum": INTEGER_BOUND,
    }
    assert out["properties"]["name"]["maxLength"] == STRING_MAX
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "maxLength" not in out["properties"]["kind"]
    assert out["properties"]["open"]["additionalProperties"] is True
    assert closed({"type": "object"}) == {"type": "object"}  # json_object: any object
    assert "additionalProperties" not in schema  # a new schema; the request's is untouched


def test_a_schema_that_says_nothing_of_extra_keys_still_ends(demo_model, home):
    """A schema as langchain's @tool and `llm --schema` send it (no additionalProperties,
    an unbounded integer), sampled with 20 seeds: every reply ends (finish "stop") and
    is an object of the listed keys, its integer within the documented bound."""
    from kvchat.serve.constrain import INTEGER_BOUND

    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    ask = [{"role": "user", "content": "A person, as JSON."}]
    with Server(demo_model) as server:
        for seed in range(20):
            reply, body, _ = chat(
                server.client, ask, max_tokens=60, temperature=1.0, seed=seed, response_format=fmt
            )
            assert body["choices"][0]["finish_reason"] == "stop", (seed, reply)
            value = json.loads(reply)
            assert set(value) == {"name", "age"} and len(value["name"]) <= 8
            assert isinstance(value["age"], int) and abs(value["age"]) <= INTEGER_BOUND
