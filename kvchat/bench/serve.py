"""``python -m kvchat.bench.serve``: ``kvchat serve`` measured as a client sees it.

Two runs, each against real servers in their own processes on loopback:

- ``ttft``: side by side on the same model folder, ``kvchat serve`` and
  ``mlx_lm.server`` answer a long first turn, then a short follow-up (its time
  to first token is the row), then both are restarted and the next turn of
  the same conversation is timed again (kvchat resumes the cache from disk,
  mlx_lm.server evaluates the history again).
- ``load``: C clients × T turns at once against one ``kvchat serve``; every
  turn must come back, and every saved session must equal its client's
  conversation with a cache that loads whole.
- ``concurrency``: 1, 2, 4 and 8 conversations at once against each server, the
  two taking turns; with ``--in-process``, sessions in this process, 8 at once
  against one alone (:mod:`kvchat.bench.concurrency`).

The client is the standard library (the ``openai`` package is a dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .common import DEFAULT_MODEL, make_text, temp_home

START_TIMEOUT_S = 300


class Running:
    """A server subprocess on a free loopback port, stopped on exit."""

    def __init__(self, argv: list[str], port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=self._log, env=os.environ.copy()
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


def kvchat_serve(model: str, log: Path) -> Running:
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        "from kvchat.cli import main; main()",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
    ]
    return Running(argv, port, log)


def mlx_lm_server(folder: Path, log: Path) -> Running:
    port = free_port()
    # The optimised BLAS first, as kvchat's entry point loads it (kvchat.blas); the server
    # is mlx-lm's own, unchanged.
    entry = "from kvchat import blas; blas.preload(); from mlx_lm.server import main; main()"
    argv = [sys.executable, "-c", entry, "--model", str(folder), "--port", str(port), "--temp", "0"]
    return Running(argv, port, log)


def stream_turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: the reply, the seconds to its first text, the total,
    and the tokens the server says it generated (None if it does not say)."""
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
                if piece and first is None:
                    first = time.perf_counter() - started
                text += piece
    return {
        "reply": text,
        "ttft_s": first,
        "total_s": time.perf_counter() - started,
        "completion_tokens": usage.get("completion_tokens"),
        "kvchat": extra,
    }


def ttft(model: str, history_tokens: int, out: Path) -> dict:
    """The side-by-side row: turn-2 TTFT and the first turn after a restart, both servers."""
    from kvchat.engine.models.model import load_model

    lm = load_model(model)
    article = make_text(lm.tokenizer, history_tokens, seed=1)
    folder = lm.path
    del lm  # the servers hold the weights; this process needs only the text
    turns = [f"Please read this.\n\n{article}", "What is it about?", "And in one word?"]
    servers = {
        "kvchat serve": lambda: kvchat_serve(model, out / "kvchat.log"),
        "mlx_lm.server": lambda: mlx_lm_server(folder, out / "mlx_lm.log"),
    }
    rows = {}
    for label, start in servers.items():
        messages, timings = [], []
        server = start()
        try:
            for i, text in enumerate(turns):
                if i == 2:  # restart: the third turn is the first after it
                    server.stop()
                    server = start()
                messages.append({"role": "user", "content": text})
                result = stream_turn(server.url, messages, max_tokens=8)
                messages.append({"role": "assistant", "content": result["reply"]})
                timings.append(result)
        finally:
            server.stop()
        rows[label] = {
            "turn1_ttft_s": timings[0]["ttft_s"],
            "turn2_ttft_s": timings[1]["ttft_s"],
            "after_restart_ttft_s": timings[2]["ttft_s"],
            "turn2_cached_tokens": timings[1]["kvchat"].get("reused_tokens"),
            "after_restart_resumed": timings[2]["kvchat"].get("resumed_from_disk"),
        }
    return {"model": model, "history_tokens": history_tokens, "servers": rows}


def load(model: str, clients: int, turns: int, out: Path) -> dict:
    """C clients × T turns at once; every turn answered, every saved session whole."""
    from kvchat import store
    from kvchat.engine.models.model import load_model

    server = kvchat_serve(model, out / "kvchat-load.log")

    def converse(k: int) -> tuple[str | None, list[dict], int]:
        messages = [{"role": "system", "content": f"You are client {k}."}]
        name, answered = None, 0
        for t in range(turns):
            messages.append({"role": "user", "content": f"Client {k}, turn {t}: go on."})
            result = stream_turn(server.url, messages, max_tokens=6)
            messages.append({"role": "assistant", "content": result["reply"]})
            same = name is None or result["kvchat"].get("session") == name
            answered += bool(result["kvchat"]) and same
            name = result["kvchat"].get("session", name)
        return name, messages, answered

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(converse, range(clients)))
    finally:
        server.stop()
    seconds = time.perf_counter() - started
    lm = load_model(model)
    whole = 0
    for name, messages, _ in done:
        if name is None:
            raise RuntimeError("kvchat serve named no session for a client's turns")
        saved = store.read(name)
        loaded = store.load(name, lm)
        same = [(m["role"], m["content"]) for m in saved["messages"]] == [
            (m["role"], m["content"]) for m in messages
        ]
        whole += (
            same
            and loaded.resumed_from_disk
            and loaded.notice is None
            and len(loaded.session.ledger) == loaded.session.cache_tokens
        )
    return {
        "clients": clients,
        "turns": turns,
        "answered": sum(d[2] for d in done),
        "expected": clients * turns,
        "sessions_whole": whole,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.serve")
    parser.add_argument("what", choices=["ttft", "load", "concurrency"])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--history", type=int, default=2000, help="turn 1's tokens (ttft)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64, help="per reply (concurrency)")
    parser.add_argument(
        "--first-tokens", type=int, default=340, help="each chat's first message (concurrency)"
    )
    parser.add_argument(
        "--loads", default="1,2,4,8", help="clients at once, comma-separated (concurrency)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="the servers take turns this often (concurrency)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="concurrency through sessions in this process: the largest load against one alone",
    )
    args = parser.parse_args(argv)
    with temp_home() as home:
        if args.what == "ttft":
            result = ttft(args.model, args.history, home)
        elif args.what == "concurrency":
            from .concurrency import concurrency, in_process

            loads = tuple(sorted({int(n) for n in args.loads.split(",")}))
            if args.in_process:
                result = in_process(
                    args.model,
                    sessions=max(loads),
                    first_tokens=args.first_tokens,
                    max_tokens=args.max_tokens,
                    rounds=args.rounds,
                )
            else:
                result = concurrency(
                    args.model,
                    home,
                    first_tokens=args.first_tokens,
                    max_tokens=args.max_tokens,
                    loads=loads,
                    rounds=args.rounds,
                )
        else:
            result = load(args.model, args.clients, args.turns, home)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
