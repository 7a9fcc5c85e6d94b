"""`kvchat serve` through langchain-openai's ``ChatOpenAI``, unmodified, on the built-in
demo: a named human message, ``reasoning_effort``, a bound tool forced (its round
trip), structured output in both of its methods, and streaming. The demo calling a
bound tool on its own: tests/test_serve_demo_tools.py."""

from __future__ import annotations

import functools
import json
import operator
from typing import Annotated, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from serve_helpers import Server
from test_serve_template_fields import thinking_model

from kvchat import store

pytestmark = pytest.mark.timeout(300)

__all__ = ["thinking_model"]  # a fixture shared with the serve tests


def client(server: Server, **kw) -> ChatOpenAI:
    """langchain's OpenAI chat model pointed at ``server``: greedy, no retries."""
    return ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="none",
        model="demo",
        temperature=0,
        max_retries=0,
        timeout=120,
        **{"max_tokens": 24, **kw},
    )


# The tiny demo fills a free string until the length limit: the city is bounded.
@tool
def get_weather(city: Annotated[str, Field(max_length=12)], unit: Literal["C", "F"]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 {unit}."


class City(BaseModel):
    """A city and how many rivers it has."""

    name: str = Field(max_length=12)
    rivers: int = Field(ge=0, le=9)


@pytest.mark.parametrize(
    ("model", "kept"), [("demo_model", {}), ("thinking_model", {"name": "alice"})]
)
def test_a_named_human_message_is_answered_and_kept(request, home, model, kept):
    """The plain demo's template reads no names: the message is kept without its name;
    a template that renders names keeps it (test_serve_template_fields.py's), in the
    session file as read back (its schema dropped the name on read before)."""
    with Server(request.getfixturevalue(model)) as server:
        chat = client(server, default_headers={"X-Session-Id": "alice-chat"})
        reply = chat.invoke([HumanMessage("Name three rivers.", name="alice")])
        assert isinstance(reply.content, str) and reply.content.strip()
        messages = store.read("alice-chat")["messages"]
        assert messages[0] == {"role": "user", "content": "Name three rivers.", **kept}
        assert messages[1]["role"] == "assistant" and messages[1]["content"] == reply.content


def test_reasoning_effort_is_answered_and_said_to_be_ignored(demo_model, home):
    with Server(demo_model) as server:
        chat = client(server, reasoning_effort="low", include_response_headers=True)
        reply = chat.invoke("Name three rivers.")
        assert isinstance(reply.content, str) and reply.content.strip()
        assert reply.response_metadata["headers"]["x-kvchat-ignored"] == "reasoning_effort"


def test_a_bound_tool_forced_is_called_and_its_result_answered(demo_model, home):
    with Server(demo_model) as server:
        chat = client(server, max_tokens=150).bind_tools([get_weather], tool_choice="get_weather")
        ask = [HumanMessage("Weather in Oslo?")]
        called = chat.invoke(ask)
        [call] = called.tool_calls
        assert call["name"] == "get_weather"
        args = call["args"]
        assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F"), args
        assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
        result = get_weather.invoke(call["args"])

        # the call as langchain sends it back finds the session and its cache
        answerer = client(server, max_tokens=12, include_response_headers=True)
        answer = answerer.bind_tools([get_weather]).invoke(
            [*ask, called, ToolMessage(result, tool_call_id=call["id"])]
        )
        assert isinstance(answer, AIMessage) and not answer.tool_calls
        assert isinstance(answer.content, str) and answer.content.strip()
        headers = answer.response_metadata["headers"]
        assert headers["x-kvchat-match"] == "continued", headers
        assert int(headers["x-kvchat-cached-tokens"]) > called.usage_metadata["input_tokens"]

        # streamed (after: a rerun takes its answer in place, the session's path the new
        # call's), the call's chunks merge into the same call
        joined = functools.reduce(operator.add, chat.stream(ask))
        assert [(c["name"], c["args"]) for c in joined.tool_calls] == [(call["name"], args)]


@pytest.mark.parametrize("schema", [City, City.model_json_schema()], ids=["pydantic", "dict"])
def test_structured_output_as_a_json_schema(demo_model, home, schema):
    """A Pydantic class goes through the openai SDK's ``parse`` (a strict schema); a JSON
    schema as is, without ``additionalProperties``: kvchat closes its object."""
    with Server(demo_model) as server:
        city = client(server, max_tokens=150).with_structured_output(schema, method="json_schema")
        found = city.invoke("A city with rivers, as JSON.")
    if not isinstance(schema, dict):
        assert isinstance(found, City)
        found = found.model_dump()
    assert set(found) == {"name", "rivers"}, found
    assert isinstance(found["name"], str) and len(found["name"]) <= 12
    assert isinstance(found["rivers"], int) and 0 <= found["rivers"] <= 9


def test_structured_output_by_a_function_call(demo_model, home):
    with Server(demo_model) as server:
        chat = client(server, max_tokens=150, include_response_headers=True)
        city = chat.with_structured_output(City, method="function_calling", include_raw=True)
        found = city.invoke("A city with rivers.")
        assert found["parsing_error"] is None
        assert isinstance(found["parsed"], City)
        [call] = found["raw"].tool_calls
        assert call["name"] == "City" and City(**call["args"]) == found["parsed"]
        session = found["raw"].response_metadata["headers"]["x-kvchat-session"]
        saved = store.read(session)["messages"][-1]["tool_calls"][0]["function"]
        assert saved == {"name": "City", "arguments": json.loads(json.dumps(call["args"]))}


def test_streamed_chunks_join_to_the_invoked_reply(demo_model, home):
    ask = [HumanMessage("Name three rivers.")]
    with Server(demo_model) as server:
        chat = client(server)
        whole = chat.invoke(ask)
        chunks = [c.content for c in chat.stream(ask)]
    assert len(chunks) > 2 and all(isinstance(c, str) for c in chunks)
    assert "".join(chunks) == whole.content and whole.content.strip()
