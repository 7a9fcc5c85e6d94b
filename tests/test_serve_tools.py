"""`kvchat serve`: tools through the chat template, tool calls parsed, forced and answered."""

from __future__ import annotations

import json

import pytest
from helpers import with_template
from serve_helpers import Server, chat

from kvchat import store
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.template import render

pytestmark = pytest.mark.timeout(300)

# A Hermes/Qwen-style template: tools offered in the system turn, calls as JSON between
# <tool_call> tags (mlx-lm reads it as its json_tools format), results as tool_response.
TOOLS_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n' -}}{%- endif -%}"
    "{{- 'Tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson + '\\n' -}}{%- endfor -%}"
    '{{- \'Call one as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'] -}}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- set tool_call = tool_call.function -%}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' -}}'
    "{{- tool_call.arguments | tojson + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tool_model(demo_model, tmp_path_factory):
    """The demo model with a chat template that offers tools."""
    return with_template(
        demo_model, tmp_path_factory.mktemp("models") / "demo-tools", TOOLS_TEMPLATE
    )


def follow_plain(messages: list[dict]) -> list[dict]:
    """A request's messages as the session keeps them (a call's arguments an object)."""
    out = []
    for m in messages:
        m = {
            k: v
            for k, v in m.items()
            if v is not None and k in ("role", "content", "tool_calls", "tool_call_id")
        }
        m.setdefault("content", "")
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def valid_weather(arguments: dict) -> bool:
    return (
        set(arguments) == {"city", "unit"}
        and isinstance(arguments["city"], str)
        and len(arguments["city"]) <= 12
        and arguments["unit"] in ("C", "F")
    )


def test_the_template_offers_tools_and_mlx_lm_reads_its_call_format(tool_model):
    assert tool_model.tokenizer.has_tool_calling
    assert tool_model.tokenizer.tool_call_start == "<tool_call>"
    with_tools = tool_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tools=[WEATHER],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '"name": "get_weather"' in with_tools


def test_a_forced_call_validates_then_its_result_is_answered_from_the_cache(tool_model, home):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    with Server(tool_model) as server:
        _, body, _ = chat(
            server.client,
            ask,
            max_tokens=150,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        )
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        arguments = json.loads(call["function"]["arguments"])
        assert valid_weather(arguments), arguments
        session = body["kvchat"]["session"]
        saved = store.read(session)["messages"][-1]
        assert saved["tool_calls"][0]["function"]["arguments"] == arguments

        # the client runs the tool and sends its result: the model answers it, and the
        # whole history (the call included) comes from the cache
        follow = [
            *ask,
            choice["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C."},
        ]
        reply, body2, _ = chat(server.client, follow, max_tokens=8, tools=[WEATHER, TIME])
        assert body2["kvchat"]["session"] == session
        assert body2["kvchat"]["match"] == "continued"
        # all of the first prompt and the call's head; the arguments' text may come back
        # from the template in other tokens than the constrained sampler chose
        cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
        head = render(
            tool_model,
            [
                *ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            **saved["tool_calls"][0],
                            "function": {"name": "get_weather", "arguments": {}},
                        }
                    ],
                },
            ],
            False,
            [WEATHER, TIME],
        )
        first_prompt = body["usage"]["prompt_tokens"]
        assert (
            cached >= first_prompt + 10
            and cached
            >= common_prefix(head, render(tool_model, follow_plain(follow), True, [WEATHER, TIME]))
            - 1
        ), cached
        assert [m["role"] for m in store.read(session)["messages"]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert store.read(session)["messages"][-1]["content"] == reply


def test_a_forced_call_cut_by_the_length_limit_leaves_no_markup_in_the_content(tool_model, home):
    """The limit falls inside the call: finish_reason "length", no call, and the content
    is not the template's unfinished <tool_call> text."""
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    with Server(tool_model) as server:
        _, body, _ = chat(
            server.client,
            ask,
            max_tokens=6,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"].get("tool_calls")
    assert not choice["message"]["content"]  # it held '<tool_call' (the tag cut short)


def test_required_picks_one_of_the_tools_and_streams_the_call_as_a_delta(tool_model, home):
    with Server(tool_model) as server:
        stream = server.client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What time is it?"}],
            max_tokens=150,
            temperature=0,
            stream=True,
            tools=[WEATHER, TIME],
            tool_choice="required",
        )
        calls, content, reasons = [], "", []
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                reasons += [choice.finish_reason] if choice.finish_reason else []
        assert reasons == ["tool_calls"] and content == ""
        [call] = calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_time":
            assert arguments in ({"zone": "UTC"}, {"zone": "CET"})
        else:
            assert call.function.name == "get_weather" and valid_weather(arguments)


def test_auto_and_none_answer_in_text_when_no_call_is_made(tool_model, home):
    ask = [{"role": "user", "content": "Say hello."}]
    with Server(tool_model) as server:
        for choice in ("auto", "none"):
            reply, body, _ = chat(
                server.client, ask, max_tokens=8, tools=[WEATHER], tool_choice=choice
            )
            message = body["choices"][0]["message"]
            assert message["tool_calls"] is None and message["content"] == reply
            assert "<tool_call>" not in reply or choice == "none"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
    ],
)
def test_bad_tool_requests_are_refused(tool_model, home, extra, param):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()
    with Server(tool_model) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == param, reply


def test_tools_for_a_model_without_tool_calls_are_refused(demo_model, home):
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    ).encode()
    with Server(demo_model) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == "tools"
        assert "has no tool calls" in reply["error"]["message"]
