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

# ChatML without tools (the demo's template before it offered them)
PLAIN_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
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
def random_model(kvchat_dirs):
    """``demo:random``: the demo's shape and template with random weights (never taught)."""
    from kvchat.engine.models.model import load_model

    return load_model("demo:random")


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


def test_the_demo_offers_tools_as_qwen_does_and_mlx_lm_reads_its_call_format(demo_model):
    """The built-in demo's template is Qwen2.5's ChatML with tools: offered in the system
    turn between <tools> tags, calls as JSON between <tool_call> tags, results between
    <tool_response> tags in one user turn."""
    tokenizer = demo_model.tokenizer
    assert tokenizer.has_tool_calling
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "09:30"},
        {"role": "tool", "tool_call_id": "c2", "content": "10:30"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[TIME], tokenize=False, add_generation_prompt=True
    )
    head, tools, tail = text.partition("<tools>\n" + json.dumps(TIME) + "\n</tools>")
    assert tools and head.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert tail.endswith(
        "<|im_end|>\n<|im_start|>user\nWhat time is it?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n09:30\n</tool_response>"
        "\n<tool_response>\n10:30\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # without tools the system prompt is a turn of its own, as before
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert (
        plain
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat time is it?<|im_end|>\n"
    )


def test_a_forced_call_validates_then_its_result_is_answered_from_the_cache(demo_model, home):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    with Server(demo_model) as server:
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
            demo_model,
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
            >= common_prefix(head, render(demo_model, follow_plain(follow), True, [WEATHER, TIME]))
            - 1
        ), cached
        assert [m["role"] for m in store.read(session)["messages"]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert store.read(session)["messages"][-1]["content"] == reply


def test_a_forced_call_cut_by_the_length_limit_leaves_no_markup_in_the_content(demo_model, home):
    """The limit falls inside the call: finish_reason "length", no call, and the content
    is not the template's unfinished <tool_call> text."""
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    with Server(demo_model) as server:
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


def test_required_picks_one_of_the_tools_and_streams_the_call_as_a_delta(demo_model, home):
    with Server(demo_model) as server:
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


def test_auto_and_none_answer_in_text_when_no_call_is_made(demo_model, home):
    ask = [{"role": "user", "content": "Say hello."}]
    with Server(demo_model) as server:
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
def test_bad_tool_requests_are_refused(demo_model, home, extra, param):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()
    with Server(demo_model) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == param, reply


def test_tools_for_a_model_without_tool_calls_are_refused(demo_model, home, tmp_path):
    plain = with_template(demo_model, tmp_path / "plain", PLAIN_CHATML)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    ).encode()
    with Server(plain) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == "tools"
        assert "has no tool calls" in reply["error"]["message"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_forced_call_of_the_untrained_random_demo_is_valid(random_model, home, choice):
    """``demo:random`` was never taught to call a tool; forced, the grammar still makes
    every sampled reply one valid call."""
    ask = [{"role": "user", "content": "What time is it?"}]
    with Server(random_model) as server:
        for seed in range(5):
            _, body, _ = chat(
                server.client,
                ask,
                max_tokens=150,
                temperature=1.0,
                seed=seed,
                tools=[WEATHER, TIME],
                tool_choice=choice,
            )
            reply = body["choices"][0]
            assert reply["finish_reason"] == "tool_calls", reply
            [call] = reply["message"]["tool_calls"]
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_time":
                assert arguments in ({"zone": "UTC"}, {"zone": "CET"})
            else:
                assert choice == "required" and call["function"]["name"] == "get_weather"
                assert valid_weather(arguments), arguments


def test_a_call_the_model_opens_is_held_to_the_tools_from_its_marker_on(demo_model):
    """With ``auto``, the reply is free until it writes ``<tool_call>``; from there only a
    valid call of an offered tool can follow (whatever the weights would rather say)."""
    import mlx.core as mx

    from kvchat.serve.constrain import constraint
    from kvchat.serve.messages import Tool
    from kvchat.serve.tools import opened_grammar

    opened = opened_grammar(demo_model, [Tool.model_validate(TIME)])
    assert opened is not None
    held = constraint(demo_model, opened)
    tokenizer = demo_model.tokenizer
    flat = mx.zeros((1, len(tokenizer.get_vocab())))
    tokens = tokenizer.encode("Let me see.\n<tool_call>", add_special_tokens=False)
    reply: list[int] = []
    for token in [*tokens, None]:  # each call sees the previous sample last
        out = held(mx.array([0, *reply]), flat)
        if token is None:
            break
        assert mx.all(out == 0).item(), "masked before the marker"
        reply.append(token)
    for _ in range(100):
        best = int(mx.argmax(out, axis=-1).item())  # the first token the grammar allows
        if best in tokenizer.eos_token_ids:
            break
        reply.append(best)
        out = held(mx.array([0, *reply]), flat)
    call = tokenizer.decode(reply[len(tokens) :])
    assert call in (
        '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        '\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    ), call
