"""`kvchat serve`: ``n`` > 1, several replies from one prefill (forked caches decoding
together), through the openai SDK."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest
from serve_helpers import Server, chat

from kvchat import store
from kvchat.engine.conversation.template import render
from kvchat.serve.schema import MAX_REPLIES

pytestmark = pytest.mark.timeout(300)

ASK = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers."},
]


def texts(body: dict) -> list[str]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["message"]["content"] for c in body["choices"]]


def test_greedy_replies_from_one_prefill_equal_the_single_reply(demo_model, home):
    with Server(demo_model) as server:
        _, body, headers = chat(server.client, ASK, max_tokens=10, n=3)
        server.wait_idle()
        saved = store.read(body["kvchat"]["session"])
        one, single, _ = chat(server.client, ASK, max_tokens=10)
        assert texts(body) == [one] * 3
        assert [c["finish_reason"] for c in body["choices"]] == [
            single["choices"][0]["finish_reason"]
        ] * 3
        prompt = len(render(demo_model, ASK, True))
        usage = body["usage"]
        # the prompt counted once, every reply's tokens
        assert usage["prompt_tokens"] == prompt
        assert usage["completion_tokens"] == 3 * single["usage"]["completion_tokens"]
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        stats = body["kvchat"]
        assert stats["replies"] == 3 and stats["session"] == single["kvchat"]["session"]
        # the replies decoded together, one forward pass a step for the three
        assert stats["batch_size"] == 3 and stats["not_batched"] is None
        # a new session: the prompt evaluated once but its last token, which each reply
        # evaluates for its logits
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert headers["x-kvchat-cached-tokens"] == "0"
        assert stats["evaluated_tokens"] == prompt - 1 + 3
        # the session's own turn (reply 0) found the prompt in its cache but that token;
        # it keeps reply 0
        turn = saved["turns"][-1]
        assert (turn["reused_tokens"], turn["evaluated_tokens"]) == (prompt - 1, 1)
        assert saved["messages"][-1]["content"] == one
        assert len(server.pool.entries()) == 1  # the forks went with the request

        # asked again: the cache holds the prompt, and only its last token is evaluated
        _, again, _ = chat(server.client, ASK, max_tokens=10, n=2)
        assert texts(again) == [one] * 2
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        assert again["kvchat"]["evaluated_tokens"] == 2


def test_seeded_replies_differ_and_reply_i_is_the_reply_of_seed_plus_i(demo_model, home):
    sampled = {"temperature": 1.0, "max_tokens": 12}
    with Server(demo_model) as server:
        _, body, _ = chat(server.client, ASK, n=3, seed=7, **sampled)
        replies = texts(body)
        assert len(set(replies)) == 3, replies
        for i, reply in enumerate(replies):
            alone, _, _ = chat(server.client, ASK, seed=7 + i, **sampled)
            assert alone == reply, i


def test_streamed_replies_carry_their_index(demo_model, home):
    with Server(demo_model) as server:
        one, single, _ = chat(server.client, ASK, max_tokens=10)
        stream = server.client.chat.completions.create(
            model="demo",
            messages=ASK,
            temperature=0,
            max_tokens=10,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        text: dict[int, str] = defaultdict(str)
        reasons: dict[int, list[str]] = defaultdict(list)
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index].append(choice.finish_reason)
        assert dict(text) == {0: one, 1: one}
        reason = single["choices"][0]["finish_reason"]
        assert dict(reasons) == {0: [reason], 1: [reason]}
        assert usage is not None
        assert usage.completion_tokens == 2 * single["usage"]["completion_tokens"]


def test_too_many_replies_and_several_plain_completions_are_refused(demo_model, home):
    with Server(demo_model) as server:
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server.client, ASK, n=MAX_REPLIES + 1)
        assert refused.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as refused:
            server.client.completions.create(model="demo", prompt="Once", n=2)
        assert refused.value.body["param"] == "n"


@pytest.mark.parametrize("kind", ["concatenate", "quantized:8", "rotating:1024", "chunked:1024"])
def test_every_cache_kind_forks_its_prompt(demo_model, home, kind):
    with Server(demo_model, kind=kind) as server:
        _, body, _ = chat(server.client, ASK, max_tokens=8, n=2)
        first, second = texts(body)
        assert first == second and first
        prompt = body["usage"]["prompt_tokens"]
        assert body["kvchat"]["evaluated_tokens"] == prompt - 1 + 2
        assert body["kvchat"]["cache_kind"] == kind
        server.wait_idle()
        turn = store.read(body["kvchat"]["session"])["turns"][-1]
        assert (turn["reused_tokens"], turn["evaluated_tokens"]) == (prompt - 1, 1)
