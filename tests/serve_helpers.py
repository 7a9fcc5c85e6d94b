"""A real ``kvchat serve`` (uvicorn on 127.0.0.1, a free port) in a thread of the test process.

In-process so a test can look at the server's pool and scheduler (the ledger
against the cache, the queue); the client is the official ``openai`` package.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import uvicorn

from kvchat.engine.conversation.events import GenerationSettings
from kvchat.runtime.pool import SessionPool
from kvchat.serve import DEFAULT_MAX_BODY, Engine, create_app

START_TIMEOUT_S = 30


class Server:
    """Start with ``with Server(lm) as server:``; ``server.client`` is an ``openai.OpenAI``."""

    def __init__(
        self,
        lm,
        *,
        api_key: str | None = None,
        max_queue: int | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        pool: SessionPool | None = None,
        kind: str = "standard",
        keep_anonymous: int = 64,
    ):
        self.engine = Engine(
            lm,
            pool or SessionPool(),
            kind=kind,
            settings=GenerationSettings(max_tokens=16),
            max_queue=max_queue,
            keep_anonymous=keep_anonymous,
        )
        app = create_app(self.engine, api_key=api_key, max_body_bytes=max_body_bytes)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.api_key = api_key

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60
        )
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=20)
        self.engine.shutdown()
        assert not self.thread.is_alive(), "server did not stop"

    @property
    def pool(self) -> SessionPool:
        return self.engine.pool

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no request is running or queued."""
        deadline = time.monotonic() + timeout
        while self.engine.active:
            assert time.monotonic() < deadline, "server stayed busy"
            time.sleep(0.02)

    def raw(
        self,
        path: str,
        body: bytes | None = None,
        headers: dict | None = None,
        method: str | None = None,
    ):
        """One plain HTTP request: (status, headers (any case), decoded JSON body)."""
        request = urllib.request.Request(
            self.url + path,
            data=body,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.headers, json.loads(error.read())


def chat(client: openai.OpenAI, messages: list[dict], **kw):
    """A non-streamed completion: (reply text, the response's dict, its headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=messages, **{"temperature": 0, **kw}
    )
    reply = raw.parse()
    return reply.choices[0].message.content, reply.model_dump(), raw.headers


def chat_streamed(client: openai.OpenAI, messages: list[dict], **kw):
    """A streamed completion: (reply text, the last chunk's ``kvchat`` object, usage)."""
    stream = client.chat.completions.create(
        model="demo",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **{"temperature": 0, **kw},
    )
    text, stats, usage, reasons = "", None, None, []
    for chunk in stream:
        extra = chunk.model_extra or {}
        stats = extra.get("kvchat", stats)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(reasons) == 1, reasons
    return text, stats, usage
