"""`kvchat serve`: OpenAI's legacy ``functions`` / ``function_call``, through the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import Server, chat
from test_serve_tools import TIME, WEATHER, valid_weather

pytestmark = pytest.mark.timeout(300)


FUNCTIONS = [WEATHER["function"], TIME["function"]]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def test_a_forced_function_call_comes_back_in_the_legacy_shape_and_its_result_is_answered(
    demo_model, home
):
    with Server(demo_model) as server:
        _, body, _ = chat(
            server.client,
            ASK,
            max_tokens=150,
            functions=FUNCTIONS,
            function_call={"name": "get_weather"},
        )
        [choice] = body["choices"]
        assert choice["finish_reason"] == "function_call"
        message = choice["message"]
        assert message["tool_calls"] is None and message["content"] is None
        call = message["function_call"]
        assert call["name"] == "get_weather"
        arguments = json.loads(call["arguments"])
        assert valid_weather(arguments), arguments

        # the client answers in the legacy way too: the call, then a "function" message
        follow = [
            *ASK,
            {"role": "assistant", "content": None, "function_call": call},
            {"role": "function", "name": "get_weather", "content": '{"temp": 21}'},
        ]
        _, body2, _ = chat(
            server.client, follow, max_tokens=8, functions=FUNCTIONS, function_call="none"
        )
        assert body2["choices"][0]["finish_reason"] in ("stop", "length")
        # the session kept the call as the client sends it back: continued, its cache reused
        assert body2["kvchat"]["match"] == "continued"
        assert body2["kvchat"]["session"] == body["kvchat"]["session"]
        cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > body["usage"]["prompt_tokens"]


def test_a_streamed_forced_function_call_is_one_function_call_delta(demo_model, home):
    with Server(demo_model) as server:
        stream = server.client.chat.completions.create(
            model="demo",
            messages=ASK,
            temperature=0,
            max_tokens=150,
            functions=FUNCTIONS,
            function_call={"name": "get_time"},
            stream=True,
        )
        calls, reasons, content = [], [], ""
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                assert c.delta.tool_calls is None
                if c.delta.function_call is not None:
                    calls.append(c.delta.function_call)
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert reasons == ["function_call"] and content == ""
        [call] = calls
        assert call.name == "get_time"
        assert json.loads(call.arguments)["zone"] in ("UTC", "CET")


def test_function_call_none_reads_no_call_and_both_spellings_at_once_are_refused(demo_model, home):
    with Server(demo_model) as server:
        _, body, _ = chat(
            server.client, ASK, max_tokens=6, functions=FUNCTIONS, function_call="none"
        )
        [choice] = body["choices"]
        assert choice["finish_reason"] in ("stop", "length")
        assert choice["message"]["function_call"] is None
        assert isinstance(choice["message"]["content"], str)

        with pytest.raises(openai.BadRequestError) as refused:
            chat(server.client, ASK, functions=FUNCTIONS, tools=[WEATHER])
        error = refused.value.body
        assert error["param"] == "functions"
        assert "'tools'" in error["message"] and "'functions'" in error["message"]

        with pytest.raises(openai.BadRequestError) as refused:
            chat(server.client, ASK, function_call="auto", tool_choice="auto", tools=[WEATHER])
        assert refused.value.body["param"] == "function_call"
        assert "'tool_choice'" in refused.value.body["message"]
