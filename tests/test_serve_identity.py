"""`kvchat serve`: which session answers a request, what repeated prompts reuse, what they leave."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from serve_helpers import Server, chat

from kvchat import store
from kvchat.engine.conversation.template import render
from kvchat.serve import anonymous
from kvchat.serve.schema import cache_key_session

pytestmark = pytest.mark.timeout(300)


def serve_sessions() -> list[str]:
    return sorted(s.name for s in store.list_sessions() if anonymous.owns(s.name))


def long_message(lm, tokens: int) -> str:
    """A user message whose prompt (through the chat template) is at least ``tokens`` long."""
    words = (
        "the cache keeps every token of the conversation so a follow up costs only its new words "
    ).split()
    text = ""
    i = 0
    while len(render(lm, [{"role": "user", "content": text}], True)) < tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text.strip()


def test_one_users_two_conversations_stay_apart(demo_model, home):
    rivers = [{"role": "user", "content": "Name three rivers."}]
    caches = [{"role": "user", "content": "Tell me about caches."}]
    with Server(demo_model) as server:
        reply1, body1, _ = chat(server.client, rivers, max_tokens=8, user="alice@example.com")
        reply2, body2, _ = chat(server.client, caches, max_tokens=8, user="alice@example.com")
        assert body2["usage"]["prompt_tokens"] == len(render(demo_model, caches, True))
        first, second = body1["kvchat"]["session"], body2["kvchat"]["session"]
        assert first != second
        assert [m["content"] for m in store.read(first)["messages"]] == [
            "Name three rivers.",
            reply1,
        ]
        assert [m["content"] for m in store.read(second)["messages"]] == [
            "Tell me about caches.",
            reply2,
        ]
        # her next turn in the first conversation continues it, and only it
        follow = [
            *rivers,
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "And lakes?"},
        ]
        _, body3, _ = chat(server.client, follow, max_tokens=8, user="alice@example.com")
        assert body3["kvchat"]["session"] == first and body3["kvchat"]["match"] == "continued"
        assert len(store.read(second)["messages"]) == 2


def test_a_named_session_sent_another_history_branches_and_keeps_its_line(demo_model, home):
    named = {"X-Session-Id": "work"}
    with Server(demo_model) as server:
        reply1, _, _ = chat(
            server.client,
            [{"role": "user", "content": "Plan the week."}],
            max_tokens=6,
            extra_headers=named,
        )
        stranger = [
            {"role": "user", "content": "Name a fish."},
            {"role": "assistant", "content": "Cod."},
            {"role": "user", "content": "Another?"},
        ]
        reply2, body2, _ = chat(server.client, stranger, max_tokens=6, extra_headers=named)
        assert body2["kvchat"]["session"] == "work"
        saved = store.read("work")
        assert [m["content"] for m in saved["messages"]] == [
            "Name a fish.",
            "Cod.",
            "Another?",
            reply2,
        ]
        lines = {tuple(n["content"] for n in branch) for branch in _paths(saved)}
        assert ("Plan the week.", reply1) in lines  # the old line is kept as a branch
        assert ("Name a fish.", "Cod.", "Another?", reply2) in lines


def _paths(saved: dict) -> list[list[dict]]:
    """Every root-to-leaf path of a saved session's branch tree."""
    nodes = saved["branches"]["nodes"]
    parents = {n["parent"] for n in nodes}
    out = []
    for i in range(len(nodes)):
        if i in parents:
            continue
        path, at = [], i
        while at != -1:
            path.append(nodes[at])
            at = nodes[at]["parent"]
        out.append(path[::-1])
    return out


def test_the_same_long_first_message_is_reused_whole_and_reruns_leave_one_session(demo_model, home):
    message = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": long_message(demo_model, 300)},
    ]
    prompt = render(demo_model, message, True)
    assert len(prompt) >= 300
    with Server(demo_model) as server:
        _, first, _ = chat(server.client, message, max_tokens=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for _ in range(8):
            _, again, _ = chat(server.client, message, max_tokens=4)
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 290 and cached >= len(prompt) - 2, cached
            assert again["kvchat"]["match"] == "branched"
            assert again["kvchat"]["session"] == first["kvchat"]["session"]
        assert serve_sessions() == [first["kvchat"]["session"]]


def test_a_new_conversation_forks_the_whole_shared_prompt_and_leaves_the_old_alone(
    demo_model, home
):
    opening = [{"role": "user", "content": long_message(demo_model, 300)}]
    with Server(demo_model) as server:
        reply1, first, _ = chat(server.client, opening, max_tokens=4)
        longer = [
            *opening,
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "Go on."},
        ]
        chat(server.client, longer, max_tokens=4)
        before = store.read(first["kvchat"]["session"])["messages"]
        _, fork, _ = chat(server.client, opening, max_tokens=4)  # another client, same start
        assert fork["kvchat"]["match"] == "forked"
        assert fork["kvchat"]["session"] != first["kvchat"]["session"]
        assert fork["usage"]["prompt_tokens_details"]["cached_tokens"] >= 290
        assert store.read(first["kvchat"]["session"])["messages"] == before


def test_the_servers_own_sessions_stay_within_their_budget(demo_model, home):
    with Server(demo_model, keep_anonymous=3) as server:
        chat(
            server.client,
            [{"role": "user", "content": "Keep me."}],
            max_tokens=2,
            extra_headers={"X-Session-Id": "mine"},
        )
        names, sessions = [], []
        for i in range(5):
            _, body, _ = chat(
                server.client, [{"role": "user", "content": f"Prompt {i}."}], max_tokens=2
            )
            names.append(body["kvchat"]["session"])
            sessions.append(server.pool.entry(names[-1]).session)
        assert serve_sessions() == sorted(names[-3:])
        assert store.exists("mine")  # a session a client named is never the server's to delete
        # the ones deleted were closed, their caches let go at once (a session's reference
        # cycles kept them until Python's next full collection: the soak's memory grew)
        assert [s.cache_tokens for s in sessions[:2]] == [0, 0]
        assert all(s.cache_tokens > 0 for s in sessions[2:])


def test_an_oversized_body_gets_a_readable_413_while_the_client_is_still_sending(demo_model, home):
    big = json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": "x" * (10 << 20)}]}
    ).encode()
    with Server(demo_model) as server:
        request = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=big,
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 413
        assert "8,388,608 bytes" in json.loads(caught.value.read())["error"]["message"]
        with pytest.raises(openai.APIStatusError) as caught_openai:
            server.client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "x" * (10 << 20)}]
            )
        assert caught_openai.value.status_code == 413
        assert caught_openai.value.body["code"] == "body_too_large"


def test_the_kvchat_object_rides_on_the_last_chunk(demo_model, home):
    with Server(demo_model) as server:
        for include_usage in (True, False):
            chunks = list(
                server.client.chat.completions.create(
                    model="demo",
                    messages=[{"role": "user", "content": "Hi there."}],
                    max_tokens=4,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": include_usage},
                )
            )
            carrying = [i for i, c in enumerate(chunks) if "kvchat" in (c.model_extra or {})]
            assert carrying == [len(chunks) - 1]
            last = chunks[-1]
            assert (last.usage is not None) == include_usage
            if include_usage:
                assert last.choices == []
                assert (
                    last.model_extra["kvchat"]["generated_tokens"] == last.usage.completion_tokens
                )


def test_fields_clients_send_on_their_own_are_accepted(demo_model, home):
    """The openai SDK with the fields clients (langchain, agents) send unasked: the reply
    comes (200); a participant's ``name`` is taken; ``prompt_cache_key`` names the
    conversation's session as X-Session-Id does (a key that is no session name, by its
    hash), and the next turn with the same key continues it."""
    with Server(demo_model) as server:
        extra = {
            "store": True,
            "metadata": {"team": "docs"},
            "service_tier": "auto",
            "safety_identifier": "user-1234",
            "verbosity": "low",
            "reasoning_effort": "low",
            "prediction": {"type": "content", "content": "Rivers"},
            "modalities": ["text"],
        }
        first = [{"role": "user", "content": "Name three rivers.", "name": "alice"}]
        reply, body, _ = chat(
            server.client, first, max_tokens=6, prompt_cache_key="conv-7", **extra
        )
        assert body["kvchat"]["session"] == "conv-7"
        assert [m["content"] for m in store.read("conv-7")["messages"]] == [
            "Name three rivers.",
            reply,
        ]
        follow = [
            *first,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And lakes?"},
        ]
        _, again, _ = chat(server.client, follow, max_tokens=6, prompt_cache_key="conv-7")
        assert again["kvchat"]["session"] == "conv-7"
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        _, keyed, _ = chat(
            server.client, first, max_tokens=6, prompt_cache_key="user@example.com/7"
        )
        assert keyed["kvchat"]["session"].startswith("key-")
        assert keyed["kvchat"]["session"] == cache_key_session("user@example.com/7")
