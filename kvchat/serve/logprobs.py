"""Log probabilities in OpenAI's shapes, from the engine's :class:`TokenLogprobs` events.

Chat completions give one entry per token, ``{"token", "logprob", "bytes",
"top_logprobs": [...]}``; plain completions the older parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``,
``text_offset``). A sampled token's text is what it added to the streamed reply (so the tokens
join to the reply; a token that ends inside a character adds nothing, the one
that completes it the whole character); an alternative's is what the tokenizer
decodes it to alone. ``bytes`` are the text's UTF-8.
"""

from __future__ import annotations

from typing import Any

from kvchat.engine.conversation.events import TokenLogprobs


def chat_entry(tokenizer: Any, event: TokenLogprobs) -> dict:
    """One token's entry of a chat completion's ``logprobs.content``, its text empty
    until :func:`text_of` gives it."""

    def one(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "token": "",
        "logprob": event.logprob,
        "bytes": [],
        "top_logprobs": [one(t, lp) for t, lp in event.top],
    }


def text_of(entry: dict, text: str) -> None:
    """Add ``text`` (streamed after the entry's token) to the entry's token text."""
    entry["token"] += text
    entry["bytes"] = list(entry["token"].encode())


def completion_shape(entries: list[dict], offset: int = 0) -> dict:
    """Chat-shaped ``entries`` as a plain completion's ``logprobs`` object; ``offset``
    is where the first token's text starts in the reply."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(entry["token"])
        offset += len(entry["token"])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
