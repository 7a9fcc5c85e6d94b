"""`kvchat serve` under bad input, a full queue, many clients, and off loopback."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_helpers import Server, chat
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.cli.serve import is_loopback

pytestmark = pytest.mark.timeout(300)

GOOD = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_openai_error(status: int, body: dict, expected: int, param: str | None = None) -> str:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"].endswith(".")
    if param is not None:
        assert error["param"] == param
    return error["message"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (b"{not json", None, "not valid JSON"),
        (json.dumps({**GOOD, "messages": []}).encode(), "messages", "empty"),
        (json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature", "number"),
        (json.dumps({**GOOD, "max_tokens": True}).encode(), "max_tokens", "integer"),
        (json.dumps({**GOOD, "max_tokens": 0}).encode(), "max_tokens", "greater"),
        (json.dumps({**GOOD, "messages": "hi"}).encode(), "messages", "valid array"),
        (
            json.dumps({**GOOD, "messages": [{"role": "robot", "content": "x"}]}).encode(),
            "messages[0].role",
            "system",
        ),
        (json.dumps({**GOOD, "stop": 7}).encode(), "stop", "valid string or Input should be a"),
        (
            json.dumps(
                {
                    **GOOD,
                    "messages": [
                        {"role": "system", "content": "hi"},
                        {"role": "assistant", "content": "yo"},
                    ],
                }
            ).encode(),
            "messages",
            "last message must be the user's or a tool's result (or the start",
        ),
        (
            json.dumps({**GOOD, "audio": {"voice": "alloy"}}).encode(),
            "audio",
            "'audio' is not supported by kvchat serve",
        ),
        (
            json.dumps({**GOOD, "modalities": ["text", "audio"]}).encode(),
            "modalities[1]",
            "'modalities[1]': Input should be 'text'",
        ),
        (
            json.dumps(
                {
                    **GOOD,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "What is this?"},
                                {
                                    "type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,AAAA"},
                                },
                            ],
                        }
                    ],
                }
            ).encode(),
            "messages[0].content[1]",
            "This model takes text only: image content parts are not supported",
        ),
        (json.dumps([1, 2]).encode(), "body", "object"),
    ],
)
def test_bad_requests_get_400_in_openais_error_shape(demo_model, home, body, param, says):
    with Server(demo_model) as server:
        status, _, reply = server.raw("/v1/chat/completions", body)
        assert says in assert_openai_error(status, reply, 400, param)
        assert server.pool.names() == []  # nothing ran, nothing was created


def test_path_like_session_header_oversized_body_unknown_route(demo_model, home):
    with Server(demo_model, max_body_bytes=2000) as server:
        status, _, reply = server.raw(
            "/v1/chat/completions", json.dumps(GOOD).encode(), {"X-Session-Id": "../secrets"}
        )
        assert "Invalid session name" in assert_openai_error(status, reply, 400, "X-Session-Id")
        big = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
        status, _, reply = server.raw("/v1/chat/completions", json.dumps(big).encode())
        assert "2,000 bytes" in assert_openai_error(status, reply, 413)
        status, _, reply = server.raw("/v1/embeddings", json.dumps(GOOD).encode())
        assert_openai_error(status, reply, 404)
        status, _, reply = server.raw("/v1/chat/completions", method="GET")
        assert_openai_error(status, reply, 405)
        # the official client sees the same errors as exceptions carrying the body
        with pytest.raises(openai.BadRequestError) as caught:
            server.client.chat.completions.create(model="demo", messages=[])
        assert caught.value.body["param"] == "messages"
        assert not any(p.name for p in store.list_sessions())


KEPT = {"X-Session-Id": "kept"}


def test_a_conversation_over_the_context_is_refused(demo_model, home):
    long = "word " * (demo_model.context_length + 10)
    with Server(demo_model) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(server.client, [{"role": "user", "content": long}])
        assert caught.value.body["code"] == "context_length_exceeded"
        assert server.pool.names() == []
        chat(
            server.client, [{"role": "user", "content": "short"}], extra_headers=KEPT, max_tokens=3
        )
        before = store.read("kept")["messages"]
        history = [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"}]
        with pytest.raises(openai.BadRequestError):  # a named session's transcript stays
            chat(server.client, [*history, {"role": "user", "content": long}], extra_headers=KEPT)
        assert server.pool.entry("kept").session.messages == before
        chat(server.client, [{"role": "user", "content": "next"}], extra_headers=KEPT, max_tokens=3)
        assert [m["content"] for m in store.read("kept")["messages"]][:3] == [
            "short",
            before[1]["content"],
            "next",
        ]


def test_the_api_key_is_required_when_set(demo_model, home):
    with Server(demo_model, api_key="s3cret") as server:
        status, _, reply = server.raw("/v1/models")
        assert_openai_error(status, reply, 401)
        status, _, reply = server.raw("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_openai_error(status, reply, 401)
        assert [m.id for m in server.client.models.list()] == ["demo"]
        status, _, reply = server.raw("/health")
        assert status == 200 and reply["status"] == "ok"


def test_a_full_queue_answers_429_with_retry_after(demo_model, home):
    with Server(demo_model, max_queue=1) as server:
        scheduler = server.engine.scheduler
        results = []
        with scheduler.turn("test holds the model"):
            waiter = threading.Thread(
                target=lambda: results.append(
                    chat(server.client, [{"role": "user", "content": "queued"}], max_tokens=2)
                )
            )
            waiter.start()
            while server.engine.waiting < 1:
                waiter.join(0.02)
            status, headers, reply = server.raw("/v1/chat/completions", json.dumps(GOOD).encode())
            assert_openai_error(status, reply, 429)
            assert reply["error"]["type"] == "rate_limit_error"
            assert int(headers["Retry-After"]) >= 1
        waiter.join(30)
        assert results and results[0][1]["usage"]["completion_tokens"] >= 1


def test_many_clients_lose_no_turn_and_corrupt_no_session(demo_model, home):
    clients, turns = 6, 4

    def converse(server: Server, k: int) -> tuple[str, list[dict]]:
        messages = [{"role": "system", "content": f"You are client {k}."}]
        name, previous_prompt = None, 0
        for t in range(turns):
            messages.append({"role": "user", "content": f"client {k} turn {t}"})
            reply, body, _ = chat(server.client, messages, max_tokens=4)
            stats = body["kvchat"]
            if name is not None:  # the same conversation, its history all reused
                assert stats["session"] == name and stats["match"] == "continued"
                assert stats["reused_tokens"] >= previous_prompt
            name, previous_prompt = stats["session"], stats["prompt_tokens"]
            messages.append({"role": "assistant", "content": reply})
        return name, messages

    with Server(demo_model) as server, ThreadPoolExecutor(clients) as threads:
        done = list(threads.map(lambda k: converse(server, k), range(clients)))
    assert len({name for name, _ in done}) == clients
    for name, messages in done:
        saved = store.read(name)
        assert [(m["role"], m["content"]) for m in saved["messages"]] == [
            (m["role"], m["content"]) for m in messages
        ]
        loaded = store.load(name, demo_model)
        assert loaded.resumed_from_disk and loaded.notice is None
        assert len(loaded.session.ledger) == loaded.session.cache_tokens


def test_serve_refuses_a_public_host_without_an_api_key(home):
    out = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert out.exit_code == 2 and "--api-key" in out.output
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert not is_loopback("example.com")


def test_kvchat_serve_runs_as_a_command_and_stops_cleanly(demo_model, home, tmp_path):
    from kvchat.bench.servers import kvchat_serve, stream_turn

    server = kvchat_serve("demo", tmp_path / "serve.log")
    try:
        first = stream_turn(server.url, [{"role": "user", "content": "hello"}], max_tokens=4)
        assert first["kvchat"]["match"] == "new" and first["reply"]
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (status -15)
    assert server.proc.returncode in (0, -15) and "Traceback" not in log, log
    assert store.read(first["kvchat"]["session"])["messages"][-1]["content"] == first["reply"]


def test_an_over_long_session_id_is_not_echoed_whole(demo_model, home):
    """A 20 kB ``X-Session-Id`` gets its 400 with the id cut to 100 characters: an error
    body stays small whatever the client sent."""
    with Server(demo_model) as server:
        long_id = "x" * 20_000 + "/"
        status, _, reply = server.raw(
            "/v1/chat/completions", json.dumps(GOOD).encode(), {"X-Session-Id": long_id}
        )
        message = assert_openai_error(status, reply, 400, "X-Session-Id")
        assert f"'{'x' * 100}'…" in message and len(json.dumps(reply)) < 1000


def test_a_burst_of_32_clients_queues_with_the_default_flags(demo_model, home):
    """32 clients at once, none retrying: every one is answered (the default queue holds
    twice the decode concurrency; it held 16, and half of such a burst got 429)."""
    import concurrent.futures

    import openai

    with Server(demo_model) as server:
        client = openai.OpenAI(base_url=server.client.base_url, api_key="x", max_retries=0)
        assert server.engine.max_queue == 2 * server.engine.decode_concurrency

        def one(i: int) -> str:
            reply = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": f"Client {i} says hello."}],
                max_tokens=2,
                temperature=0,
            )
            return reply.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            reasons = list(pool.map(one, range(32)))
    assert len(reasons) == 32 and set(reasons) <= {"stop", "length"}
