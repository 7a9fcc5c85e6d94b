"""`kvchat serve`: ``reasoning_effort`` sets the chat template's thinking switch where it
has one, ``messages[].name`` is rendered where the template reads it; elsewhere both are
ignored (a header says so for the effort). The prompts are read back from the sessions'
ledgers and compared with what transformers renders with the same variables."""

from __future__ import annotations

from os.path import commonprefix

import pytest
from helpers import with_template
from serve_helpers import Server, chat, chat_streamed

from kvchat.engine.conversation.template import renders_names, thinking_variables

pytestmark = pytest.mark.timeout(300)

# Qwen3's switch (an empty think block after the generation prompt when thinking is off),
# gpt-oss's effort (in a system header first) and a participant's name after the role
THINKING_TEMPLATE = (
    "{%- if reasoning_effort is defined -%}"
    "{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] -}}"
    "{%- if message.name is defined and message.name -%}{{- ' ' + message.name -}}{%- endif -%}"
    "{{- '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "Name three rivers."}]
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def thinking_model(demo_model, tmp_path_factory):
    """A copy of the demo folder whose chat template has a thinking switch, an effort
    variable and participants' names, loaded like any model folder."""
    return with_template(
        demo_model, tmp_path_factory.mktemp("models") / "demo-thinking", THINKING_TEMPLATE
    )


def prompt_of(server: Server, name: str, tokens: int) -> str:
    """The text of the first ``tokens`` of session ``name``'s ledger (its prompt)."""
    ledger = server.pool.entry(name).session.ledger
    return str(server.engine.lm.tokenizer.decode(ledger[:tokens]))


def expected(lm, messages: list[dict], **variables) -> str:
    """What transformers renders of ``messages`` with the generation prompt and ``variables``."""
    return str(
        lm.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **variables
        )
    )


def test_the_variables_follow_the_template_source(demo_model, thinking_model):
    assert thinking_variables(thinking_model, "none") == {
        "enable_thinking": False,
        "reasoning_effort": "low",
    }
    assert thinking_variables(thinking_model, "minimal")["enable_thinking"] is False
    assert thinking_variables(thinking_model, "high") == {
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    assert thinking_variables(demo_model, "none") == {}
    assert renders_names(thinking_model) and not renders_names(demo_model)


@pytest.mark.parametrize(
    ("effort", "think_off", "said"), [("none", True, "low"), ("high", False, "high")]
)
def test_reasoning_effort_drives_the_thinking_switch(thinking_model, home, effort, think_off, said):
    with Server(thinking_model) as server:
        name = f"effort-{effort}"
        _, body, headers = chat(
            server.client,
            QUESTION,
            max_tokens=4,
            reasoning_effort=effort,
            extra_headers={"X-Session-Id": name},
        )
        assert "x-kvchat-ignored" not in headers
        prompt = prompt_of(server, name, body["usage"]["prompt_tokens"])
        want = expected(
            thinking_model, QUESTION, enable_thinking=not think_off, reasoning_effort=said
        )
        assert prompt == want
        assert prompt.startswith(f"<|im_start|>system\nReasoning: {said}<|im_end|>\n")
        assert prompt.endswith(NO_THINK) is think_off
        assert ("<think>" in prompt) is think_off


def tokens(lm, text: str) -> list[int]:
    return list(lm.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("streamed", [False, True])
def test_the_same_effort_again_reuses_the_cache(thinking_model, home, streamed):
    """Prefix matching renders the request as its turn does: the next request of the
    conversation, with the same effort, reads from the cache all it shares with the first
    exchange, and a new conversation forks the cache of one with the same system part."""
    lm = thinking_model
    asked = [SYSTEM, *QUESTION]
    with Server(lm) as server:
        reply, body1, _ = chat(server.client, asked, max_tokens=6, reasoning_effort="none")
        first = body1["kvchat"]["session"]
        ledger1 = list(server.pool.entry(first).session.ledger)
        messages = [
            *asked,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the longest?"},
        ]
        if streamed:
            _, stats, usage = chat_streamed(
                server.client, messages, max_tokens=4, reasoning_effort="none"
            )
            cached, prompt_tokens = usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens
        else:
            _, body2, _ = chat(server.client, messages, max_tokens=4, reasoning_effort="none")
            stats, usage = body2["kvchat"], body2["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            prompt_tokens = usage["prompt_tokens"]
        assert stats["session"] == first and stats["match"] == "continued"
        want = expected(lm, messages, enable_thinking=False, reasoning_effort="low")
        assert prompt_of(server, first, prompt_tokens) == want and want.endswith(NO_THINK)
        # the template renders the earlier reply without its empty think block: the cache
        # holds the first prompt up to it
        shared = len(commonprefix([ledger1, tokens(lm, want)]))
        opened = expected(lm, asked, enable_thinking=True, reasoning_effort="low")
        assert cached == shared >= len(tokens(lm, opened)) > 0

        other = [SYSTEM, {"role": "user", "content": "Name three lakes."}]
        _, body3, _ = chat(server.client, other, max_tokens=4, reasoning_effort="none")
        assert body3["kvchat"]["match"] == "forked"
        # the effort's system header and the system prompt, read from the first's cache
        head = expected(lm, [SYSTEM], reasoning_effort="low").split("<|im_start|>assistant")[0]
        assert head.endswith("You are terse.<|im_end|>\n")
        cached3 = body3["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached3 >= len(tokens(lm, head))


def test_n_replies_share_the_prompt_their_turns_render(thinking_model, home):
    """With ``n`` > 1 the prompt evaluated once (then forked) is the one each reply's turn
    renders, effort and all: each reply evaluates only the prompt's last token."""
    with Server(thinking_model) as server:
        _, body, _ = chat(
            server.client, QUESTION, max_tokens=4, n=2, reasoning_effort="none", seed=1
        )
        prompt = body["usage"]["prompt_tokens"]
        assert body["kvchat"]["evaluated_tokens"] == prompt - 1 + 2
        text = prompt_of(server, body["kvchat"]["session"], prompt)
        assert text == expected(
            thinking_model, QUESTION, enable_thinking=False, reasoning_effort="low"
        )


def test_a_reply_cut_at_a_stop_keeps_the_cache_of_its_prompt(thinking_model, home):
    """The transcript revised to the reply the client got is rendered with the request's
    variables, as its prompt was: the cache keeps that prompt (not only what it shares
    with a rendering without the effort's header), and the next turn reads it."""
    asked = [SYSTEM, *QUESTION]
    with Server(thinking_model) as server:
        probe, _, _ = chat(server.client, asked, max_tokens=8, reasoning_effort="high")
        assert len(probe) >= 4, probe
        stop = probe[len(probe) // 2 :][:2]
        cut, body, _ = chat(
            server.client, asked, max_tokens=8, reasoning_effort="high", stop=[stop]
        )
        assert body["choices"][0]["finish_reason"] == "stop" and len(cut) < len(probe)
        name, prompt_tokens = body["kvchat"]["session"], body["usage"]["prompt_tokens"]
        assert len(server.pool.entry(name).session.ledger) >= prompt_tokens - 1
        follow = [
            *asked,
            {"role": "assistant", "content": cut},
            {"role": "user", "content": "And the longest?"},
        ]
        _, again, _ = chat(server.client, follow, max_tokens=4, reasoning_effort="high")
        assert again["kvchat"]["session"] == name
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 1


def test_a_named_message_renders_its_name(thinking_model, home):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers.", "name": "alice"},
    ]
    with Server(thinking_model) as server:
        reply, body1, _ = chat(server.client, messages, max_tokens=6)
        first = body1["kvchat"]["session"]
        prompt = prompt_of(server, first, body1["usage"]["prompt_tokens"])
        assert prompt == expected(thinking_model, messages)
        assert "<|im_start|>user alice\nName three rivers." in prompt
        assert server.pool.entry(first).session.messages[1]["name"] == "alice"
        # the named history again, with a named assistant: the same session, from the cache
        asked = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "The longest?", "name": "bob"},
        ]
        _, body2, _ = chat(server.client, asked, max_tokens=4)
        assert body2["kvchat"]["match"] == "continued"
        assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] > len(prompt) // 8
        prompt2 = prompt_of(server, first, body2["usage"]["prompt_tokens"])
        assert prompt2 == expected(thinking_model, asked)
        assert "<|im_start|>user bob\nThe longest?" in prompt2


def test_a_template_without_them_ignores_both(demo_model, home):
    named = [{"role": "user", "content": "Name three rivers.", "name": "alice"}]
    with Server(demo_model) as server:
        _, body, headers = chat(server.client, named, max_tokens=4, reasoning_effort="low")
        assert headers["x-kvchat-ignored"] == "reasoning_effort"
        name = body["kvchat"]["session"]
        assert prompt_of(server, name, body["usage"]["prompt_tokens"]) == expected(
            demo_model, QUESTION
        )
        assert "name" not in server.pool.entry(name).session.messages[0]
        _, _, plain = chat(server.client, QUESTION, max_tokens=4)
        assert "x-kvchat-ignored" not in plain
        streamed = server.client.chat.completions.with_raw_response.create(
            model="demo", messages=QUESTION, max_tokens=4, stream=True, reasoning_effort="none"
        )
        assert streamed.headers["x-kvchat-ignored"] == "reasoning_effort"
        assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
