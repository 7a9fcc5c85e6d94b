"""`kvchat serve`: a conversation that ends with the assistant's message is continued (a
prefill): the reply starts where that message ends, from the cache as any prefix is."""

from __future__ import annotations

import openai
import pytest
from serve_helpers import Server, chat, chat_streamed

from kvchat import store
from kvchat.engine.conversation.events import GenerationSettings, TurnDone, TurnOptions
from kvchat.engine.conversation.session import Session
from kvchat.engine.conversation.template import render

pytestmark = pytest.mark.timeout(300)

SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = [SYSTEM, {"role": "user", "content": "Name three rivers."}]
START = "The longest river is the"


def continued(lm, history: list[dict], question: str) -> tuple[list[int], TurnDone]:
    """The prompt transformers renders for ``history``, the question and START left open,
    and an uncached session's greedy turn on that conversation."""
    opened = [*history, {"role": "user", "content": question}]
    prompt = lm.tokenizer.apply_chat_template(
        [*opened, {"role": "assistant", "content": START}],
        continue_final_message=True,
        add_generation_prompt=False,
        tokenize=False,
    )
    fresh = Session(lm, settings=GenerationSettings(max_tokens=12), messages=history)
    *_, done = fresh.send(question, TurnOptions(start=START))
    assert isinstance(done, TurnDone) and done.stats.reused_tokens == 0
    return list(lm.tokenizer.encode(prompt, add_special_tokens=False)), done


@pytest.mark.parametrize("streamed", [False, True])
def test_the_reply_continues_the_last_message_from_the_cache_as_uncached(
    demo_model, home, streamed
):
    with Server(demo_model) as server:
        headers = {"X-Session-Id": "prefilled"}
        reply1, body1, _ = chat(server.client, FIRST, max_tokens=12, extra_headers=headers)
        history = [*FIRST, {"role": "assistant", "content": reply1}]
        question = "Which is longest?"
        prompt, uncached = continued(demo_model, history, question)
        messages = [
            *history,
            {"role": "user", "content": question},
            {"role": "assistant", "content": START},
        ]
        if streamed:
            text, stats, usage = chat_streamed(
                server.client, messages, max_tokens=12, extra_headers=headers
            )
            prompt_tokens, cached = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
        else:
            text, body, _ = chat(server.client, messages, max_tokens=12, extra_headers=headers)
            stats, usage = body["kvchat"], body["usage"]
            prompt_tokens = usage["prompt_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
        # the prompt is the conversation with the assistant's message open, and the
        # turn before it came from the cache
        assert prompt_tokens == len(prompt)
        assert cached >= body1["usage"]["prompt_tokens"] and stats["match"] == "named"
        # the content is the continuation alone: what the uncached session gave, token
        # for token (the cache holds the prompt, then the reply's tokens)
        assert text == uncached.reply.removeprefix(START) and text
        ledger = server.pool.get("prefilled").ledger
        assert ledger[: len(prompt)] == prompt
        generated = ledger[len(prompt) :]
        assert len(generated) >= stats["generated_tokens"] - 1
        assert generated == list(uncached.tokens[: len(generated)])
        # the transcript keeps the reply whole, the given start first
        server.wait_idle()
        saved = store.read("prefilled")["messages"]
        assert saved[-1]["role"] == "assistant" and saved[-1]["content"] == START + text
        assert [m["content"] for m in saved[:-1]] == [m["content"] for m in messages[:-1]]


def test_what_cannot_be_continued_is_refused(demo_model, home):
    with Server(demo_model) as server:
        cases = [
            ([SYSTEM, {"role": "assistant", "content": "Hello"}], "the user's or a tool's"),
            (
                [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                ],
                "tool call",
            ),
        ]
        for messages, said in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                chat(server.client, messages)
            assert refused.value.body["param"] == "messages"
            assert said in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            chat(
                server.client,
                [*FIRST, {"role": "assistant", "content": "{"}],
                response_format={"type": "json_object"},
            )
        assert "cannot be continued" in refused.value.body["message"]
        # an empty assistant message starts the reply afresh: the reply without it
        fresh, _, _ = chat(server.client, FIRST, max_tokens=6)
        text, body, _ = chat(
            server.client, [*FIRST, {"role": "assistant", "content": ""}], max_tokens=6
        )
        assert text == fresh and body["usage"]["prompt_tokens"] == len(
            render(demo_model, FIRST, True)
        )
