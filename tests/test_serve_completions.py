"""`kvchat serve`: plain completions and log probabilities, through the official openai client."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from serve_helpers import Server, chat

from kvchat.engine.conversation.events import Chunk
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.engine.conversation.template import encode_plain, render

pytestmark = pytest.mark.timeout(300)

PROMPT = "The cache keeps every token of the conversation, so"


def sequence_logprob(lm, tokens: list[int], start: int) -> float:
    """log P(tokens[start:] | tokens[:start]) from one fresh forward pass (no cache)."""
    logits = lm.model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = [logprobs[i - 1, tokens[i]] for i in range(start, len(tokens))]
    return float(mx.sum(mx.stack(picked)).item())


def reply_tokens(lm, session: Session, prompt_len: int, generated: int) -> list[int]:
    """The reply's token ids: what the session's ledger holds after the prompt, and the
    greedy last token where the ledger stops one short (the CPU fast path feeds it later)."""
    tokens = list(session.ledger[: prompt_len + generated])
    if len(tokens) < prompt_len + generated:
        logits = lm.model(mx.array(tokens)[None])[0, -1]
        tokens.append(int(mx.argmax(logits).item()))
    return tokens


def test_a_completion_continues_the_prompt_as_written_and_reuses_it(demo_model, home):
    alone = Session(demo_model, settings=GenerationSettings(max_tokens=16))
    expected = "".join(e.text for e in alone.complete(PROMPT) if isinstance(e, Chunk))
    with Server(demo_model) as server:
        first = server.client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=16, temperature=0
        )
        assert first.object == "text_completion"
        assert first.choices[0].text == expected and expected
        assert first.usage.prompt_tokens == len(encode_plain(demo_model, PROMPT))
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # a prompt that extends the first reuses its cache (its reply's tokens too)
        longer = PROMPT + first.choices[0].text + " And then"
        second = server.client.completions.create(
            model="demo", prompt=longer, max_tokens=8, temperature=0
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= len(
            encode_plain(demo_model, PROMPT)
        )
        assert second.model_extra["kvchat"]["match"] == "forked"
        # streamed: the same text in pieces, the figures on the last chunk
        chunks = list(
            server.client.completions.create(
                model="demo",
                prompt=PROMPT,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
        assert (
            chunks[-1].model_extra["kvchat"]["reused_tokens"]
            >= len(encode_plain(demo_model, PROMPT)) - 1
        )


def test_chat_logprobs_sum_to_the_replys_log_probability(endless, home):
    messages = [{"role": "user", "content": "Tell me about caches."}]
    prompt = render(endless, messages, True)
    with Server(endless) as server:
        reply, body, _ = chat(server.client, messages, max_tokens=8, logprobs=True, top_logprobs=3)
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"] == 8
        assert "".join(e["token"] for e in content) == reply
        for entry in content:
            top = entry["top_logprobs"]
            assert len(top) == 3 and [t["logprob"] for t in top] == sorted(
                (t["logprob"] for t in top), reverse=True
            )
            assert entry["logprob"] == pytest.approx(top[0]["logprob"])  # greedy
            assert entry["bytes"] == list(entry["token"].encode())
        session = server.pool.entry(body["kvchat"]["session"]).session
        tokens = reply_tokens(endless, session, len(prompt), 8)
        assert tokens[: len(prompt)] == prompt
        expected = sequence_logprob(endless, tokens, len(prompt))
        assert math.fsum(e["logprob"] for e in content) == pytest.approx(expected, abs=1e-3)

        # streamed, the same entries arrive with the pieces; the history is still reused
        follow = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Go on."},
        ]
        stream = server.client.chat.completions.create(
            model="demo",
            messages=follow,
            max_tokens=6,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
        text, entries, last = "", [], None
        for chunk in stream:
            last = chunk
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs is not None:
                    entries += choice.logprobs.content
        assert len(entries) == last.usage.completion_tokens == 6
        assert "".join(e.token for e in entries) == text
        assert all(len(e.top_logprobs) == 2 for e in entries)
        assert last.model_extra["kvchat"]["match"] == "continued"
        assert last.usage.prompt_tokens_details.cached_tokens >= len(prompt)


def test_completion_logprobs_in_the_legacy_shape(endless, home):
    with Server(endless) as server:
        reply = server.client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
        )
        lp = reply.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 6
        assert "".join(lp.tokens) == reply.choices[0].text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        tokens = encode_plain(endless, PROMPT)
        session = server.pool.entry(reply.model_extra["kvchat"]["session"]).session
        full = reply_tokens(endless, session, len(tokens), 6)
        assert sum(lp.token_logprobs) == pytest.approx(
            sequence_logprob(endless, full, len(tokens)), abs=1e-3
        )


def test_logprobs_fields_are_checked(demo_model, home):
    with Server(demo_model) as server:
        status, _, body = server.raw(
            "/v1/chat/completions",
            (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}'),
        )
        assert status == 400 and body["error"]["param"] == "top_logprobs"
        status, _, body = server.raw("/v1/completions", b'{"prompt": ["a", "b"]}')
        assert status == 400 and body["error"]["param"] == "prompt"
        status, _, body = server.raw("/v1/completions", b'{"prompt": "a", "echo": true}')
        assert status == 400 and body["error"]["param"] == "echo"
        assert server.pool.names() == []
