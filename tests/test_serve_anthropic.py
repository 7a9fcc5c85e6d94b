"""`kvchat serve`'s Anthropic Messages API through the official anthropic client: the same
sessions, prompts and caches as the chat completions route, Anthropic's events and errors."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import pytest
from serve_helpers import Server, chat
from test_serve import SYSTEM, held_after
from test_serve_tools import WEATHER, valid_weather

from kvchat import store
from kvchat.engine.conversation.template import render
from kvchat.serve.anthropic import MessagesRequest

pytestmark = pytest.mark.timeout(300)

ASK = [{"role": "user", "content": "Name three rivers."}]
# the anthropic client no longer has sampling arguments; its extra_body still sends them
GREEDY = {"model": "demo", "system": SYSTEM["content"], "extra_body": {"temperature": 0}}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


def client(server: Server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def events(server: Server, body: dict) -> list[tuple[str, dict]]:
    """A streamed request's server-sent events, each as (its name, its data)."""
    request = urllib.request.Request(
        server.url + "/v1/messages",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    out = []
    for event in raw.strip().split("\n\n"):
        name, data = event.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_messages_request_is_the_chat_request_of_the_same_conversation():
    asked = MessagesRequest.model_validate_json(
        json.dumps(
            {
                "model": "claude-x",
                "max_tokens": 7,
                "system": [
                    {"type": "text", "text": "Be brief."},
                    {"type": "text", "text": "Sure."},
                ],
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "Hm.", "signature": "x"},
                            {"type": "text", "text": "Looking."},
                            {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Oslo"}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [{"type": "text", "text": "Sunny"}],
                                "cache_control": {"type": "ephemeral"},
                            },
                            {"type": "text", "text": "And tomorrow?"},
                        ],
                    },
                ],
                "tools": [{"name": "w", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                "stop_sequences": ["\n\n"],
                "top_k": 5,
                "metadata": {"user_id": "someone"},
            }
        )
    )
    req = asked.chat()
    call = {"id": "t1", "type": "function", "function": {"name": "w", "arguments": {"c": "Oslo"}}}
    assert req.history() == [
        {"role": "system", "content": "Be brief.\nSure."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "t1"},
    ]
    assert req.new_messages() == [{"role": "user", "content": "And tomorrow?"}]
    assert req.tool_specs() == [
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    ]
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert [t.function.name for t in req.forced_tools()] == ["w"]
    assert req.stop == ["\n\n"] and req.token_limit() == 7
    assert req.top_k == 5 and req.temperature is None and req.sampling()["top_k"] == 5


def test_a_reply_counts_its_prompt_as_the_chat_route_does_and_shares_its_session(demo_model, home):
    with Server(demo_model) as server:
        raw = client(server).messages.with_raw_response.create(
            **GREEDY, max_tokens=12, messages=ASK
        )
        message = raw.parse()
        prompt = render(demo_model, [SYSTEM, *ASK], True)
        [block] = message.content
        assert message.type == "message" and message.role == "assistant" and message.model
        assert block.type == "text" and block.text
        assert message.usage.input_tokens == len(prompt)
        assert message.usage.cache_read_input_tokens == 0
        assert message.usage.cache_creation_input_tokens == 0
        assert 0 < message.usage.output_tokens <= 12
        assert message.stop_reason == (
            "max_tokens" if message.usage.output_tokens == 12 else "end_turn"
        )
        assert message.stop_sequence is None
        assert raw.headers["x-kvchat-evaluated-tokens"] == str(len(prompt))
        counted = client(server).messages.count_tokens(
            model="demo", system=SYSTEM["content"], messages=ASK
        )
        assert counted.input_tokens == len(prompt)

        # streamed, the same greedy request says the same
        with client(server).messages.stream(**GREEDY, max_tokens=12, messages=ASK) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == block.text == text_of(final)
        assert final.stop_reason == message.stop_reason
        assert final.usage.output_tokens == message.usage.output_tokens
        # the same prompt again: all of it from the cache the first reply left
        assert final.usage.cache_read_input_tokens == len(prompt)
        assert final.usage.input_tokens == 0

        # OpenAI's route: the same prompt, the same reply, from the same session's cache
        reply, body, headers = chat(server.client, [SYSTEM, *ASK], max_tokens=12)
        assert reply == block.text
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert headers["x-kvchat-session"] == raw.headers["x-kvchat-session"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)


def test_a_streamed_two_turn_chat_reads_turn_one_from_the_cache(demo_model, home):
    with Server(demo_model) as server:
        with client(server).messages.stream(**GREEDY, max_tokens=12, messages=ASK) as stream:
            start1 = next(iter(stream))
            text1 = "".join(stream.text_stream)
            first = stream.get_final_message()
            name = stream.response.headers["x-kvchat-session"]
        prompt1 = render(demo_model, [SYSTEM, *ASK], True)
        assert first.usage.input_tokens == len(prompt1)
        assert first.usage.cache_read_input_tokens == 0
        # message_start says the prompt before any of the reply, as Anthropic's does
        assert start1.type == "message_start"
        assert start1.message.usage.input_tokens == len(prompt1)
        assert start1.message.usage.cache_read_input_tokens == 0

        second = [
            *ASK,
            {"role": "assistant", "content": [{"type": "text", "text": text1}]},
            {"role": "user", "content": "And three mountains?"},
        ]
        with client(server).messages.stream(**GREEDY, max_tokens=12, messages=second) as stream:
            start2 = next(iter(stream))
            text2 = "".join(stream.text_stream)
            usage2 = stream.get_final_message().usage
            assert stream.response.headers["x-kvchat-session"] == name
            assert stream.response.headers["x-kvchat-match"] == "continued"
        prompt2 = render(demo_model, [SYSTEM, *ASK, {"role": "assistant", "content": text1},
                                      second[-1]], True)  # fmt: skip
        held = held_after(len(prompt1), first.usage.output_tokens)
        assert held > 0 and usage2.cache_read_input_tokens == held
        assert usage2.input_tokens == len(prompt2) - held
        assert usage2.cache_creation_input_tokens == 0
        assert start2.type == "message_start"
        assert start2.message.usage.cache_read_input_tokens == held
        assert start2.message.usage.input_tokens == len(prompt2) - held
        session = server.pool.entry(name).session
        assert [m["content"] for m in session.messages] == [
            SYSTEM["content"],
            ASK[0]["content"],
            text1,
            "And three mountains?",
            text2,
        ]


def test_a_stop_sequence_ends_the_reply_and_is_named_in_every_event(demo_model, home):
    with Server(demo_model) as server:
        full = text_of(client(server).messages.create(**GREEDY, max_tokens=12, messages=ASK))
        assert len(full) >= 4
        stop = full[2:4]  # a piece of what it will say again, greedy
        asked = {"max_tokens": 12, "messages": ASK, "stop_sequences": [stop, "never"]}
        cut = client(server).messages.create(**GREEDY, **asked)
        assert text_of(cut) == full[: full.index(stop)]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop

        streamed = events(server, {**asked, "system": SYSTEM["content"], "temperature": 0})
        names = [name for name, _ in streamed]
        assert all(data["type"] == name for name, data in streamed)
        deltas = names.count("content_block_delta")
        assert deltas >= 1 and names == [
            "message_start",
            "ping",
            "content_block_start",
            *["content_block_delta"] * deltas,
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        texts = [data["delta"]["text"] for name, data in streamed if name == "content_block_delta"]
        assert "".join(texts) == text_of(cut)
        delta = streamed[-2][1]
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
        prompt = cut.usage.input_tokens + cut.usage.cache_read_input_tokens
        assert prompt == len(render(demo_model, [SYSTEM, *ASK], True))
        assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == prompt
        assert delta["usage"]["output_tokens"] == cut.usage.output_tokens
        # message_start said the prompt as the reply's end says it (the same prompt again:
        # all of it cached, with its logits)
        opened = streamed[0][1]["message"]["usage"]
        assert opened == {**delta["usage"], "output_tokens": 0}
        assert opened["cache_read_input_tokens"] == prompt


def test_output_config_holds_the_reply_to_a_json_schema(demo_model, home):
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 10}, "km": {"type": "integer"}},
        "required": ["river", "km"],
    }
    with Server(demo_model) as server:
        message = client(server).messages.create(
            **GREEDY,
            max_tokens=60,
            messages=ASK,
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
    assert message.stop_reason == "end_turn", message
    reply = json.loads(text_of(message))
    assert set(reply) == {"river", "km"} and isinstance(reply["km"], int)
    assert isinstance(reply["river"], str) and len(reply["river"]) <= 10


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": ASK}, "'max_tokens'"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 5, "messages": ASK, "top_p": 0}, "'top_p'"),
        ({"max_tokens": 5, "messages": ASK, "n": 2}, "'n' is not supported"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "'image'",
        ),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        (
            {
                "max_tokens": 5,
                "messages": ASK,
                "tools": [{"type": "bash_20250124", "name": "bash"}],
            },
            "server tools",
        ),
    ],
)
def test_bad_requests_get_anthropics_error_shape(demo_model, home, body, said):
    with Server(demo_model) as server:
        status, _, reply = server.raw("/v1/messages", json.dumps(body).encode())
        assert status == 400 and set(reply) == {"type", "error"} and reply["type"] == "error"
        assert reply["error"]["type"] == "invalid_request_error"
        assert said in reply["error"]["message"], reply


def test_the_client_hears_a_refusal_and_unknown_paths_are_anthropics_too(demo_model, home):
    with Server(demo_model) as server:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client(server).messages.create(
                model="demo", max_tokens=5, messages=[{"role": "tool", "content": "x"}]
            )
        assert refused.value.status_code == 400
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].role" in refused.value.body["error"]["message"]
        status, _, missing = server.raw("/v1/messages/nothing", b"{}")
        assert status == 404 and missing["type"] == "error"
        assert missing["error"]["type"] == "not_found_error"
        status, _, elsewhere = server.raw("/v1/nothing", b"{}")  # OpenAI's shape elsewhere
        assert status == 404 and elsewhere["error"]["code"] == "404"


def test_a_body_over_the_limit_is_anthropics_request_too_large(demo_model, home):
    big = {"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 4000}]}
    with Server(demo_model, max_body_bytes=1000) as server:
        status, _, reply = server.raw("/v1/messages", json.dumps(big).encode())
    assert status == 413 and reply["type"] == "error"
    assert reply["error"]["type"] == "request_too_large"
    assert "1,000 bytes" in reply["error"]["message"]


def test_x_api_key_is_the_key_where_one_is_required(demo_model, home):
    with Server(demo_model, api_key="sekrit") as server:
        answered = client(server, "sekrit").messages.create(**GREEDY, max_tokens=2, messages=ASK)
        assert answered.usage.output_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client(server, "wrong").messages.create(**GREEDY, max_tokens=2, messages=ASK)
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"
        assert server.raw("/v1/models", headers={"x-api-key": "sekrit"}, method="GET")[0] == 200
        assert server.raw("/v1/models", headers={"x-api-key": "wrong"}, method="GET")[0] == 401
        counted = {"messages": ASK}
        status, _, reply = server.raw(
            "/v1/messages/count_tokens",
            json.dumps(counted).encode(),
            headers={"Authorization": "Bearer sekrit"},
        )
        assert status == 200 and reply == {"input_tokens": len(render(demo_model, ASK, True))}


def test_a_forced_tool_call_streams_as_tool_use_and_its_result_is_answered(demo_model, home):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    with Server(demo_model) as server:
        with client(server).messages.stream(
            model="demo",
            max_tokens=150,
            extra_body={"temperature": 0},
            messages=ask,
            tools=[WEATHER_TOOL],
            tool_choice=forced,
        ) as stream:
            streamed = list(stream)
            call = stream.get_final_message()
            name = stream.response.headers["x-kvchat-session"]
        [block] = call.content
        assert call.stop_reason == "tool_use" and call.stop_sequence is None
        assert block.type == "tool_use" and block.name == "get_weather"
        assert valid_weather(block.input), block.input
        deltas = [event.delta for event in streamed if event.type == "content_block_delta"]
        assert [d.type for d in deltas] == ["input_json_delta"]
        assert json.loads(deltas[0].partial_json) == block.input
        saved = store.read(name)["messages"][-1]
        assert saved["tool_calls"][0]["id"] == block.id
        assert saved["tool_calls"][0]["function"]["arguments"] == block.input
        assert (
            call.usage.input_tokens
            == client(server)
            .messages.count_tokens(model="demo", messages=ask, tools=[WEATHER_TOOL])
            .input_tokens
        )

        follow = [
            *ask,
            {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C."}
                ],
            },
        ]
        with client(server).messages.stream(
            model="demo", max_tokens=8, messages=follow, tools=[WEATHER_TOOL]
        ) as stream:
            answer = stream.get_final_message()
            assert stream.response.headers["x-kvchat-session"] == name
            assert stream.response.headers["x-kvchat-match"] == "continued"
        assert answer.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in answer.content] in (["text"], [])
        # the first prompt and the call's head come from the cache (its arguments' text may
        # come back from the template in other tokens than the constrained sampler chose)
        assert answer.usage.cache_read_input_tokens >= call.usage.input_tokens + 10
        messages = store.read(name)["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2] == {"role": "tool", "content": "Sunny, 21 C.", "tool_call_id": block.id}
        assert messages[-1]["content"] == text_of(answer)
