"""The chat template: a model's messages as text, and that text as token ids.

One place for both, so the session (its prompts, the re-rendered reply whose
thoughts a template drops, where its turns end) and the server's prefix matching
render alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvchat.engine.caches import checkpoints

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel


def render(
    lm: LoadedModel,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` through ``lm``'s chat template (see :func:`template_text`)."""
    return encode(lm, template_text(lm, messages, generation_prompt, tools))


def template_text(
    lm: LoadedModel,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    *,
    open_last: bool = False,
) -> str:
    """The text ``lm``'s chat template makes of ``messages`` (role and content, and a tool
    call's or a tool result's fields), offering ``tools`` (OpenAI's function specs) if given.
    ``open_last`` leaves the last message open, its text the start of what comes next
    (transformers' ``continue_final_message``: a reply that begins as given)."""
    if not messages:
        return ""
    if open_last:
        extra: dict[str, Any] = {"continue_final_message": True}
        generation_prompt = False
    else:
        extra = {}
    plain = [
        {
            "role": m["role"],
            "content": m["content"],
            **{k: m[k] for k in _TOOL_FIELDS if m.get(k) is not None},
        }
        for m in messages
    ]
    if tools:
        extra["tools"] = tools
    return str(
        lm.tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
    )


_TOOL_FIELDS = ("tool_calls", "tool_call_id")


def encode(lm: LoadedModel, text: str) -> list[int]:
    return list(lm.tokenizer.encode(text, add_special_tokens=False)) if text else []


def encode_plain(lm: LoadedModel, text: str) -> list[int]:
    """Token ids of a plain prompt (no chat template), with the special tokens the
    tokenizer adds by itself (a beginning-of-sequence token), as mlx-lm's server does."""
    return list(lm.tokenizer.encode(text)) if text else []


def turn_ends(
    render: Callable[[list[dict[str, Any]], bool], list[int]],
    messages: list[dict[str, Any]],
    tokens: list[int],
    after: int = 0,
) -> frozenset[int]:
    """Where in ``tokens`` (``render(messages, False)``) the prompts and replies that end
    past token ``after`` end: where a prefill evaluating them keeps checkpoints.

    Only the newest :data:`~kvchat.engine.caches.checkpoints.MAX_CHECKPOINTS`: a prefill
    keeping more would drop the older ones as it kept newer ones. So the transcript
    is rendered up to each reply from the newest back, until that many are found
    or the renderings end before ``after`` (they grow with the transcript): a
    bounded number of renderings, not two per reply (which made a rebuild of a
    long conversation quadratic in its length) — unless a template rewrites every
    earlier turn, so that no rendering up to a reply is a prefix of the whole.
    """
    ends: set[int] = set()
    for i in reversed(range(len(messages))):
        if len(ends) >= checkpoints.MAX_CHECKPOINTS:
            break
        if messages[i]["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        for part in (prompt, render(messages[: i + 1], False)):
            # a template may rewrite earlier turns: only a prefix of ``tokens`` counts
            if len(part) > after and tokens[: len(part)] == part:
                ends.add(len(part))
        if len(prompt) <= after:
            break
    return frozenset(sorted(ends)[-checkpoints.MAX_CHECKPOINTS :])
