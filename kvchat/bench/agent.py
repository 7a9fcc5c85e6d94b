"""A coding agent's session replayed against ``kvchat serve`` and ``mlx_lm.server``.

:func:`agent_plan` writes the session, the same for both servers whatever the
model answers: a long system prompt with tool definitions, a task, then
``requests`` requests whose history grows by one scripted assistant tool call
and its result after each (as an agent appends them; the model's own short
reply is not kept). Two requests edit a tool result in the middle of the
history first (a file read again after a change: the prompt's prefix shifts
there), and the server is restarted before the request halfway (``kvchat
serve`` on the same sessions folder, so its saved sessions are there again;
``mlx_lm.server``'s prompt cache is in memory only).

:func:`agent`: the session against each server, one at a time on the same model
folder, ``rounds`` times in turns (each server's best round by its total time
to first token). Each start is followed by a short warm-up request, so a
restart's figure is the session's cache, not the weights' loading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .common import make_text, median, rounded_ratio
from .servers import SERVERS, Running, in_turn, kvchat_serve, mlx_lm_server, stream_turn

TASK = "The test tests/test_parser.py::test_nested_lists fails. Find why and fix it."
RESULT_TOKENS = 120  # each tool result's text
MAX_TOKENS = 16  # each reply's: the figure is the time to its first token
ROW = ("ttft_s", "cached_tokens")  # each server's columns in the side-by-side rows

TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": "string"}),
    ("write_file", "Replace a file's whole text.", {"path": "string", "text": "string"}),
    ("apply_patch", "Apply a unified diff to the repository.", {"diff": "string"}),
    ("grep", "Search the repository for a regular expression.", {"pattern": "string"}),
    ("list_dir", "List a folder of the repository.", {"path": "string"}),
    ("run_tests", "Run pytest on the given paths.", {"paths": "array"}),
]


@dataclass
class Request:
    """One request of the session: its ``kind`` (``first``, ``grown``, ``edited`` or
    ``restart``, the first after the server's restart) and the messages it sends."""

    kind: str
    messages: list[dict]


def steps(requests: int) -> tuple[int, int, int]:
    """The indices of the first edited request, the restart's and the second edited one.

    An edit changes the middle tool result, one the request before last already sent,
    so the previous request's cache held it: the prefix the server can reuse shrinks.
    """
    if requests < 12:
        raise ValueError("the agent session needs at least 12 requests")
    return max(5, requests * 3 // 10), requests // 2, requests * 3 // 4


def system_prompt(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens: the agent's rules and its tools' definitions (JSON), then
    project notes to make up the length (deterministic)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        key: {"type": kind, "description": f"The {key}."}
                        for key, kind in params.items()
                    },
                    "required": list(params),
                },
            },
        }
        for name, description, params in TOOLS
    ]
    head = (
        "You are a coding agent working in a Python repository. Call one tool at a time; "
        "read before you write; run the tests after each change.\n\n# Tools\n\n"
        + json.dumps(tools, indent=2)
        + "\n\n# Project notes\n\n"
    )
    used = len(tokenizer.encode(head, add_special_tokens=False))
    return head + make_text(tokenizer, max(tokens - used, 1), seed=7)


def tool_call(i: int) -> dict:
    """The agent's scripted ``i``-th tool call, an assistant message."""
    name, _, params = TOOLS[i % len(TOOLS)]
    arguments = {
        key: [f"tests/test_{i}.py"] if kind == "array" else f"src/part_{i}.py"
        for key, kind in params.items()
    }
    return {
        "role": "assistant",
        "content": f"Step {i}: calling {name}.",
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def agent_plan(tokenizer, requests: int = 20, system_tokens: int = 6000) -> list[Request]:
    """The session's requests, each with the whole history it sends (see the module)."""
    first_edit, restart, second_edit = steps(requests)
    history = [
        {"role": "system", "content": system_prompt(tokenizer, system_tokens)},
        {"role": "user", "content": TASK},
    ]
    plan = []
    for i in range(requests):
        kind = "first" if i == 0 else "grown"
        if i in (first_edit, second_edit):
            results = [k for k, m in enumerate(history) if m["role"] == "tool"]
            middle = results[(len(results) - 1) // 2]
            text = make_text(tokenizer, RESULT_TOKENS, seed=5000 + i)
            history[middle] = {**history[middle], "content": f"(read again)\n{text}"}
            kind = "edited"
        elif i == restart:
            kind = "restart"
        plan.append(Request(kind, [dict(m) for m in history]))
        text = make_text(tokenizer, RESULT_TOKENS, seed=1000 + i)
        history += [tool_call(i), {"role": "tool", "tool_call_id": f"call_{i}", "content": text}]
    return plan


def replay(start: Callable[[], Running], plan: list[Request], max_tokens: int = MAX_TOKENS):
    """The session against the server ``start()`` starts (and starts again before the
    ``restart`` request): one row per request."""
    server = start()
    rows = []
    try:
        for request in plan:
            if request.kind == "restart":
                server.stop()
                server = start()
            result = stream_turn(server.url, request.messages, max_tokens)
            rows.append(
                {
                    "kind": request.kind,
                    # a reply with no text: the whole request, its first token included
                    "ttft_s": round(result["ttft_s"] or result["total_s"], 3),
                    "total_s": round(result["total_s"], 3),
                    "prompt_tokens": result["prompt_tokens"],
                    "cached_tokens": result["cached_tokens"],
                    "answered": bool(result["reply"]) or result["completion_tokens"] is not None,
                }
            )
    finally:
        server.stop()
    return rows


def warmed(server: Running) -> Running:
    """``server`` after a short request (mlx_lm.server loads the weights on the first)."""
    stream_turn(server.url, [{"role": "user", "content": "Warm up."}], 4)
    return server


def starter(label: str, model: str, folder: Path, out: Path, tag: str) -> Callable[[], Running]:
    """Starts the server ``label`` (warmed), its log (and kvchat's sessions) in ``out``;
    each start of the same starter on the same sessions folder."""
    slug = re.sub(r"\W+", "-", label)
    log, home = out / f"agent-{slug}-{tag}.log", out / f"agent-home-{slug}-{tag}"
    if label == "kvchat serve":
        return lambda: warmed(kvchat_serve(model, log, home))
    return lambda: warmed(mlx_lm_server(folder, log))


def summary(rows: list[dict]) -> dict:
    """A server's totals, and the first request after the restart against a cached one."""
    cached = [r["ttft_s"] for r in rows if r["kind"] == "grown"]
    after = next(r["ttft_s"] for r in rows if r["kind"] == "restart")
    return {
        "ttft_total_s": round(sum(r["ttft_s"] for r in rows), 2),
        "request_total_s": round(sum(r["total_s"] for r in rows), 2),
        "cached_ttft_median_s": round(median(cached), 3),
        "after_restart_ttft_s": after,
        "after_restart_vs_cached": rounded_ratio(after, median(cached)),
        "answered": sum(r["answered"] for r in rows),
    }


def agent(
    model: str, out: Path, requests: int = 20, system_tokens: int = 6000, rounds: int = 1
) -> dict:
    """Both servers' rows side by side (each its best round), totals and ratios."""
    from kvchat.engine.models.model import load_model

    lm = load_model(model)
    plan = agent_plan(lm.tokenizer, requests, system_tokens)
    folder = lm.path
    del lm  # the servers hold the weights
    best: dict[str, list[dict]] = {}
    for r in range(rounds):
        for label in in_turn(r):
            rows = replay(starter(label, model, folder, out, f"{r}"), plan)
            old = best.get(label)
            if old is None or sum(x["ttft_s"] for x in rows) < sum(x["ttft_s"] for x in old):
                best[label] = rows
    ours, theirs = (summary(best[label]) for label in SERVERS)
    return {
        "model": model,
        "requests": requests,
        "system_tokens": system_tokens,
        "prompt_tokens_last": best["kvchat serve"][-1]["prompt_tokens"],
        "rounds": rounds,
        "totals": {"kvchat serve": ours, "mlx_lm.server": theirs},
        "ratios": {
            "ttft_total_kvchat_vs_mlx_lm": rounded_ratio(
                ours["ttft_total_s"], theirs["ttft_total_s"]
            ),
            "request_total_kvchat_vs_mlx_lm": rounded_ratio(
                ours["request_total_s"], theirs["request_total_s"]
            ),
        },
        "requests_side_by_side": [
            {
                "request": i,
                "kind": a["kind"],
                **{f"{k}_kvchat": a[k] for k in ROW},
                **{f"{k}_mlx_lm": b[k] for k in ROW},
            }
            for i, (a, b) in enumerate(zip(best["kvchat serve"], best["mlx_lm.server"]))
        ],
    }
