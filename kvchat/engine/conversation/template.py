"""The chat template: a model's messages as text, and that text as token ids.

One place for both, so the session (its prompts, the re-rendered reply whose
thoughts a template drops, where its turns end) and the server's prefix matching
render alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvchat.engine.caches import checkpoints

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

# a request's variables for the chat template beside the messages (its thinking switch)
Variables = Mapping[str, Any] | None


class Render(Protocol):
    """A session's chat template: token ids of ``messages`` (with the generation prompt or
    not), offering a request's ``tools``, with its template ``variables``."""

    def __call__(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        *,
        tools: list[dict[str, Any]] | None = None,
        variables: Variables = None,
    ) -> list[int]: ...


def render(
    lm: LoadedModel,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    variables: Variables = None,
) -> list[int]:
    """Token ids of ``messages`` through ``lm``'s chat template (see :func:`template_text`)."""
    return encode(lm, template_text(lm, messages, generation_prompt, tools, variables=variables))


def template_text(
    lm: LoadedModel,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    *,
    open_last: bool = False,
    variables: Variables = None,
) -> str:
    """The text ``lm``'s chat template makes of ``messages`` (role and content, a participant's
    name, a tool call's or a tool result's fields), offering ``tools`` (OpenAI's function
    specs) if given, with ``variables`` (:func:`thinking_variables`) set in the template.
    ``open_last`` leaves the last message open, its text the start of what comes next
    (transformers' ``continue_final_message``: a reply that begins as given)."""
    if not messages:
        return ""
    extra: dict[str, Any] = dict(variables or {})
    if open_last:
        extra["continue_final_message"] = True
        generation_prompt = False
    plain = [
        {
            "role": m["role"],
            "content": m["content"],
            **{k: m[k] for k in _FIELDS if m.get(k) is not None},
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


_FIELDS = ("name", "tool_calls", "tool_call_id")


def template_source(lm: LoadedModel) -> str:
    """The Jinja source of ``lm``'s chat template (every one, for a tokenizer with several)."""
    source = getattr(lm.tokenizer, "chat_template", None)
    if isinstance(source, dict):
        return "\n".join(str(s) for s in source.values())
    return source if isinstance(source, str) else ""


def thinking_variables(lm: LoadedModel, effort: str) -> dict[str, Any]:
    """The template variables that say ``effort`` (OpenAI's ``reasoning_effort``: none,
    minimal, low, medium, high) to ``lm``'s chat template, found by the names its source
    reads: ``enable_thinking`` (Qwen3's switch) off for none and minimal, on otherwise;
    ``reasoning_effort`` (gpt-oss's) the effort, low for none and minimal (the least such
    templates know). Empty where the template has neither: the effort changes nothing."""
    source = template_source(lm)
    out: dict[str, Any] = {}
    thinking = effort not in ("none", "minimal")
    if "enable_thinking" in source:
        out["enable_thinking"] = thinking
    if "reasoning_effort" in source:
        out["reasoning_effort"] = effort if thinking else "low"
    return out


_NAME = re.compile(r"\bmessage\s*(\.\s*name\b|\[\s*['\"]name['\"]\s*\])")


def renders_names(lm: LoadedModel) -> bool:
    """Whether ``lm``'s chat template reads a message's ``name`` (``message.name`` or
    ``message['name']``): a participant's name is kept in the messages only then."""
    return _NAME.search(template_source(lm)) is not None


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
