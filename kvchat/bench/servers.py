"""Real servers on loopback for the serve benchmarks: ``kvchat serve`` and
``mlx_lm.server`` started in their own processes on the same model folder, and a
standard-library client that streams one turn and times it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .common import KVCHAT

START_TIMEOUT_S = 300
SERVERS = ("kvchat serve", "mlx_lm.server")


class Running:
    """A server subprocess on a free loopback port, stopped on exit."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=self._log, env=os.environ | (env or {})
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except urllib.error.HTTPError:  # an answer all the same: it is listening
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[:4]} did not start; see {log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvchat_serve(model: str, log: Path, home: Path | None = None) -> Running:
    """``kvchat serve --model model``; its sessions in ``home`` if given (``KVCHAT_HOME``),
    else where this process keeps them."""
    port = free_port()
    argv = [
        *KVCHAT,
        "serve",
        "--model",
        model,
        "--port",
        str(port),
    ]
    return Running(argv, port, log, {"KVCHAT_HOME": str(home)} if home else None)


def mlx_lm_server(folder: Path, log: Path) -> Running:
    port = free_port()
    # The optimised BLAS first, as kvchat's entry point loads it (kvchat.blas); the server
    # is mlx-lm's own, unchanged.
    entry = "from kvchat import blas; blas.preload(); from mlx_lm.server import main; main()"
    argv = [sys.executable, "-c", entry, "--model", str(folder), "--port", str(port), "--temp", "0"]
    return Running(argv, port, log)


@contextmanager
def side_by_side(model: str, folder: Path, out: Path, tag: str) -> Iterator[dict[str, Running]]:
    """Both :data:`SERVERS` on the same model (``kvchat serve`` by name, ``mlx_lm.server``
    on its ``folder``), started, warmed up with a short turn, and stopped on exit; their
    logs in ``out``, named with ``tag``."""
    servers: dict[str, Running] = {}
    try:
        servers["kvchat serve"] = kvchat_serve(model, out / f"kvchat-{tag}.log")
        servers["mlx_lm.server"] = mlx_lm_server(folder, out / f"mlx_lm-{tag}.log")
        for server in servers.values():
            stream_turn(server.url, [{"role": "user", "content": "Warm up."}], 4)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def in_turn(round_: int) -> tuple[str, ...]:
    """The :data:`SERVERS` in the order they take round ``round_``: each goes first in
    every other round, so a shared machine's drift falls on both alike."""
    return SERVERS if round_ % 2 == 0 else SERVERS[::-1]


def stream_turn(
    url: str, messages: list[dict], max_tokens: int, on_text: Callable[[], None] | None = None
) -> dict:
    """One streamed chat completion: the reply, the seconds to its first text, the total,
    the tokens the server says it generated, the prompt's and those of it its cache held
    (each None if it does not say), and when it
    started and each piece of text came (``time.perf_counter``); ``on_text()`` is called
    when the first text comes."""
    body = json.dumps(
        {
            "model": "default_model",
            "messages": messages,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first, text = None, ""
    arrivals: list[float] = []
    extra: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=1800) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            extra = chunk.get("kvchat", extra)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    arrivals.append(time.perf_counter())
                    if first is None:
                        first = arrivals[-1] - started
                        if on_text is not None:
                            on_text()
                text += piece
    return {
        "reply": text,
        "ttft_s": first,
        "total_s": time.perf_counter() - started,
        "started": started,
        "arrivals": arrivals,
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "kvchat": extra,
    }
