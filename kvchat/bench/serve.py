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
- ``paste``: a long paste sent beside a streaming reply, against each server: the
  reply's longest wait while the paste goes in (:mod:`kvchat.bench.paste`).
- ``agent``: a coding agent's session (a long system prompt with tools, a history
  grown by tool calls and results, two edits in the middle, a restart halfway)
  against each server: every request's time to first token (:mod:`kvchat.bench.agent`).
- ``soak``: many short requests over many clients against one ``kvchat serve``, its
  memory sampled after the first 200 and at the end (:mod:`kvchat.bench.soak`).

The client is the standard library (the ``openai`` package is a dev extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import DEFAULT_MODEL, make_text, temp_home
from .servers import kvchat_serve, mlx_lm_server, stream_turn


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
    parser.add_argument("what", choices=["ttft", "load", "concurrency", "paste", "agent", "soak"])
    parser.add_argument("--model", help=f"soak: demo, the others: {DEFAULT_MODEL}")
    parser.add_argument(
        "--history", type=int, default=2000, help="turn 1's tokens (ttft), the paste's (paste)"
    )
    parser.add_argument("--clients", type=int, help="at once (load: 8, soak: 32)")
    parser.add_argument("--requests", type=int, help="in all (agent: 20, soak: 2000)")
    parser.add_argument(
        "--system-tokens", type=int, default=6000, help="the system prompt's (agent)"
    )
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64, help="per reply (concurrency)")
    parser.add_argument(
        "--reply-tokens", type=int, default=400, help="the streaming reply's, at most (paste)"
    )
    parser.add_argument(
        "--first-tokens", type=int, default=340, help="each chat's first message (concurrency)"
    )
    parser.add_argument(
        "--loads", default="1,2,4,8", help="clients at once, comma-separated (concurrency)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the servers take turns this often (concurrency, paste, agent)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="concurrency through sessions in this process: the largest load against one alone",
    )
    args = parser.parse_args(argv)
    args.model = args.model or ("demo" if args.what == "soak" else DEFAULT_MODEL)
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
        elif args.what == "paste":
            from .paste import paste

            result = paste(args.model, home, args.history, args.reply_tokens, args.rounds)
        elif args.what == "agent":
            from .agent import agent

            result = agent(args.model, home, args.requests or 20, args.system_tokens, args.rounds)
        elif args.what == "soak":
            from .soak import soak

            result = soak(args.model, home, args.requests or 2000, args.clients or 32)
        else:
            result = load(args.model, args.clients or 8, args.turns, home)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
