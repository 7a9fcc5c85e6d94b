"""``python -m kvchat.bench.tool_calls``: how often the trained ``demo`` calls tools right.

Chats with tools drawn as the demo's training draws them
(:func:`kvchat.engine.models.demo_tools.tool_chats`) but from another seed, so each is a
combination of tool, question and values the demo did not read, are asked through the
demo's chat template and answered greedily, with nothing holding the reply to a grammar
(``kvchat serve`` holds an opened call to its tools' grammar; this measures the weights
alone). For each reply that should be a call: did it open one, name the asked tool, and
give exactly the question's arguments; for each that should not: did it answer in text.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from mlx_lm.generate import generate

from kvchat.engine.models.demo_tools import ordinary_pairs, tool_chats
from kvchat.engine.models.model import LoadedModel, load_model

SEED = 1  # the training's chats are seed 0's
CALL = "<tool_call>"


@dataclass
class ToolCalls:
    """Counts over the asked chats."""

    asked_calls: int = 0
    opened: int = 0
    right_tool: int = 0
    exact_arguments: int = 0
    asked_text: int = 0
    answered_in_text: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def called(reply: str) -> dict[str, Any] | None:
    """The call a reply writes, or None where it writes none that parses."""
    if not reply.lstrip().startswith(CALL):
        return None
    try:
        call = json.loads(reply.split(CALL, 1)[1].split("</tool_call>", 1)[0])
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) else None


def evaluate(lm: LoadedModel, count: int, max_tokens: int = 60) -> ToolCalls:
    """Ask ``count`` chats' first questions and count what the replies do."""
    counts = ToolCalls()
    for messages, tools in tool_chats(count, ordinary_pairs(), SEED):
        prompt = lm.tokenizer.apply_chat_template(
            messages[:1], tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        reply = generate(lm.model, lm.tokenizer, prompt, max_tokens=max_tokens)
        wanted = messages[1].get("tool_calls")
        if not wanted:
            counts.asked_text += 1
            counts.answered_in_text += CALL not in reply
            continue
        counts.asked_calls += 1
        counts.opened += reply.lstrip().startswith(CALL)
        call = called(reply) or {}
        counts.right_tool += call.get("name") == wanted[0]["function"]["name"]
        counts.exact_arguments += call == wanted[0]["function"]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.bench.tool_calls")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    counts = evaluate(load_model(args.model), args.chats)
    if args.json:
        print(json.dumps(counts.as_dict()))
        return 0
    calls, text = max(1, counts.asked_calls), max(1, counts.asked_text)
    print(f"{counts.asked_calls} asked for a tool's work, with it offered:")
    print(f"  opened a call {counts.opened} ({counts.opened / calls:.0%})")
    print(f"  the asked tool {counts.right_tool} ({counts.right_tool / calls:.0%})")
    print(f"  its arguments exact {counts.exact_arguments} ({counts.exact_arguments / calls:.0%})")
    print(f"{counts.asked_text} asked what no offered tool does, or offered none:")
    print(f"  answered in text {counts.answered_in_text} ({counts.answered_in_text / text:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
