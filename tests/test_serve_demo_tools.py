"""The trained ``demo`` calls tools on its own (``tool_choice`` ``auto``), through each
client unmodified: the openai SDK, langchain-openai's ``bind_tools`` and the anthropic
SDK streaming a coding agent's two turns. Asked for what an offered tool does, it
calls that tool with the question's city; sent the result, it answers in text in the
form it learnt ("The get_weather tool says: ..."; a 2-layer toy, it does not copy the
result's words), the conversation so far read from the cache. How often it calls
right on chats it never read: ``python -m kvchat.bench.tool_calls``."""

from __future__ import annotations

import functools
import json
import operator

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from serve_helpers import Server, chat
from test_serve_anthropic import client as anthropic_client
from test_serve_anthropic import text_of
from test_serve_langchain import client as langchain_client
from test_serve_tools import TIME

pytestmark = pytest.mark.timeout(300)

# a tool as the demo learned them: one string, said in the question
CITY_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_the_demo_calls_the_tool_asked_for_then_answers_its_result(demo_model, home):
    """Offered tools (``auto``), the trained demo calls the one the question asks for, its
    argument taken from the question; sent the result, it answers it in text, reading
    the conversation so far from the cache."""
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = [TIME, CITY_WEATHER]
    with Server(demo_model) as server:
        _, body, _ = chat(server.client, ask, max_tokens=60, tools=tools)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}

        result = {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C."}
        follow = [*ask, choice["message"], result]
        reply, body2, _ = chat(server.client, follow, tools=tools, max_tokens=40)
    assert body2["choices"][0]["finish_reason"] == "stop"
    assert body2["choices"][0]["message"]["tool_calls"] is None
    assert reply.startswith("The get_weather tool says: ")
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 2


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Fog in {city}, 14 C."


def test_a_bound_tool_is_called_when_asked_and_its_result_answered(demo_model, home):
    """``bind_tools`` leaves the choice to the model: asked for the weather, the demo
    calls the tool; sent its result (a ``ToolMessage``), it answers in text."""
    with Server(demo_model) as server:
        chat = langchain_client(server, max_tokens=60).bind_tools([get_weather])
        ask = [HumanMessage("What is the weather in Lisbon?")]
        called = chat.invoke(ask)
        assert not called.content
        [call] = called.tool_calls
        assert (call["name"], call["args"]) == ("get_weather", {"city": "Lisbon"})
        result = get_weather.invoke(call["args"])

        answerer = langchain_client(server, max_tokens=40, include_response_headers=True)
        answer = answerer.bind_tools([get_weather]).invoke(
            [*ask, called, ToolMessage(result, tool_call_id=call["id"])]
        )
        assert isinstance(answer, AIMessage) and not answer.tool_calls
        assert isinstance(answer.content, str)
        assert answer.content.startswith("The get_weather tool says: ")
        headers = answer.response_metadata["headers"]
        assert headers["x-kvchat-match"] == "continued", headers
        assert int(headers["x-kvchat-cached-tokens"]) > called.usage_metadata["input_tokens"]

        # streamed, the call's chunks merge into the same call
        joined = functools.reduce(operator.add, chat.stream(ask))
        assert [(c["name"], c["args"]) for c in joined.tool_calls] == [(call["name"], call["args"])]


def test_a_tool_chat_streams_a_call_then_answers_its_result_from_the_cache(demo_model, home):
    """A coding agent's way with the built-in demo: tools offered (``auto``), turn 1
    streams the call as a ``tool_use`` block; turn 2 sends its ``tool_result`` and
    streams the answer, turn 1 read from the cache (said in ``message_start`` already)."""
    tool = {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    ask = [{"role": "user", "content": "Is it raining in Quito?"}]
    asked = {"model": "demo", "extra_body": {"temperature": 0}, "tools": [tool]}
    with Server(demo_model) as server:
        with anthropic_client(server).messages.stream(
            **asked, max_tokens=60, messages=ask
        ) as stream:
            kinds = [event.type for event in stream]
            call = stream.get_final_message()
        [block] = call.content
        assert call.stop_reason == "tool_use" and block.type == "tool_use"
        assert (block.name, block.input) == ("get_weather", {"city": "Quito"})
        assert "input_json" in kinds and "text" not in kinds

        result = {"type": "tool_result", "tool_use_id": block.id, "content": "Fog, 14 C."}
        follow = [
            *ask,
            {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
            {"role": "user", "content": [result]},
        ]
        with anthropic_client(server).messages.stream(
            **asked, max_tokens=40, messages=follow
        ) as stream:
            opened = next(iter(stream))
            answer = stream.get_final_message()
            assert stream.response.headers["x-kvchat-match"] == "continued"
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"]
    assert text_of(answer).startswith("The get_weather tool says: ")
    held = answer.usage.cache_read_input_tokens
    assert held >= call.usage.input_tokens + call.usage.output_tokens - 2
    assert opened.type == "message_start" and opened.message.usage.cache_read_input_tokens == held
    assert opened.message.usage.input_tokens == answer.usage.input_tokens


def test_a_call_cut_by_the_length_limit_leaves_no_markup_in_the_content(demo_model, home):
    """The limit falls inside the call the demo opened: finish_reason "length", no call,
    and none of the unfinished <tool_call> text as content."""
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with Server(demo_model) as server:
        _, body, _ = chat(server.client, ask, max_tokens=8, tools=[CITY_WEATHER])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"] == ""
