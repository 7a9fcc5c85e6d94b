"""Reasoning models' thoughts: the ``<think>…</think>`` blocks of a reply.

:func:`split_thoughts` separates a reply (finished or still streaming) into its
thoughts and its answer, so a view can fold the thoughts away.

Chat templates of reasoning models (Qwen3, DeepSeek-R1) drop the thoughts of
earlier replies when they render the conversation, so the turn after a reply
with thoughts renders that reply differently from what the cache holds: the
prefix match (docs/architecture.md, "The engine contract") keeps the cache only up to the
reply's start and evaluates the reply again. :func:`reevaluated_reply` counts
those tokens, for the turn's stats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from os.path import commonprefix
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Thoughts:
    """A reply split: ``thought`` (the blocks' text, blank-line separated), ``answer``
    (everything else), ``thinking`` (the last block is not closed yet)."""

    thought: str
    answer: str
    thinking: bool = False


def split_thoughts(text: str) -> Thoughts:
    """Split ``text`` into its thoughts and its answer.

    Handles several blocks, text before a block, an unterminated block (a reply
    still streaming, or one stopped while thinking) and a reply that starts inside
    a block because the template's generation prompt opened it (DeepSeek-R1's
    ``<think>\\n``): a ``</think>`` before any ``<think>`` closes a block begun at
    the start.
    """
    thoughts: list[str] = []
    answer: list[str] = []
    rest = text
    close, opening = rest.find(CLOSE), rest.find(OPEN)
    if close != -1 and (opening == -1 or close < opening):
        thoughts.append(rest[:close])
        rest = rest[close + len(CLOSE) :]
    thinking = False
    while rest:
        start = rest.find(OPEN)
        if start == -1:
            answer.append(rest)
            break
        answer.append(rest[:start])
        rest = rest[start + len(OPEN) :]
        end = rest.find(CLOSE)
        if end == -1:
            thoughts.append(rest)
            thinking = True
            break
        thoughts.append(rest[:end])
        rest = rest[end + len(CLOSE) :]
    thought = "\n\n".join(t.strip() for t in thoughts if t.strip())
    return Thoughts(thought, "".join(answer).lstrip(), thinking)


def reevaluated_reply(
    template: Callable[[list[dict[str, Any]], bool], str],
    encode: Callable[[str], list[int]],
    messages: list[dict[str, Any]],
    text: str,
    prompt: list[int],
    reused: int,
) -> int:
    """Tokens of the last reply before the turn's new message that the turn evaluates
    again because the chat template renders it without its thoughts.

    ``messages`` are the turn's, ``text`` the template's text of them (with the
    generation prompt), ``prompt`` its token ids and ``reused`` how many of them the
    cache kept; ``template(messages, generation_prompt)`` renders the messages before
    the reply and ``encode`` gives token ids. 0 when that reply has no think block (an empty
    one counts: templates drop it too), the template keeps it, or the cache did not
    reach the reply anyway (an edit before it).
    """
    # here, not at the top: the module comes without mlx-lm (the TUI draws thoughts at once)
    from kvchat.engine.conversation.maintenance import common_prefix

    at = next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None
    )
    if at is None:
        return 0
    content = messages[at]["content"]
    if OPEN not in content and CLOSE not in content:
        return 0
    before = template(messages[:at], True) if at else ""
    reply_at = len(commonprefix([before, text]))  # DeepSeek-R1's opening <think> is not in both
    if reused < common_prefix(encode(before), prompt):
        return 0  # the cache did not hold what came before the reply
    answer = split_thoughts(content).answer.strip()
    head = text.find(answer, reply_at)
    if head == -1 or CLOSE in text[reply_at:head]:
        return 0  # the template keeps the thoughts (then the cache kept them too)
    return max(0, len(encode(text[: head + len(answer)])) - reused)


def reevaluated_note(tokens: int) -> str | None:
    """The words that say a turn re-evaluated part of the last reply (sidebar, CLI)."""
    if not tokens:
        return None
    return (
        f"the template drops earlier thoughts, so {tokens:,} tokens of the last reply "
        "were evaluated again"
    )
