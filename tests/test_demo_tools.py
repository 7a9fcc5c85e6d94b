"""What the trained demo learns tool calls from (demo_tools.py, demo_train.py): chats whose
calls carry the question's own values, rendered by the demo's template, the loss on the
replies only and heaviest on the values. The trained weights' behaviour:
tests/test_serve_demo_tools.py and ``python -m kvchat.bench.tool_calls``."""

from __future__ import annotations

import json

from kvchat.bench.tool_calls import called
from kvchat.engine.models import demo
from kvchat.engine.models.demo_tools import ordinary_pairs, tool_chats
from kvchat.engine.models.demo_train import VALUE_WEIGHT, tool_examples


def test_each_call_carries_the_questions_values_and_only_offered_tools():
    chats = tool_chats(64, ordinary_pairs())
    assert chats == tool_chats(64, ordinary_pairs())  # seeded: the same every time
    assert tool_chats(64, ordinary_pairs(), seed=1) != chats
    calls = 0
    for messages, tools in chats:
        question = messages[0]["content"]
        offered = {tool["function"]["name"] for tool in tools}
        for message in messages:
            for call in message.get("tool_calls", []):
                calls += 1
                assert call["function"]["name"] in offered
                for value in call["function"]["arguments"].values():
                    assert str(value) in question, (question, call)
        if "tool_calls" not in messages[1]:
            assert messages[1]["content"] in {answer for _, answer in ordinary_pairs()}
    assert 32 <= calls < 64  # three chats in eight are answered in text
    assert sum(not tools for _, tools in chats) == 16  # two in eight offer none


def test_the_loss_weighs_replies_and_most_the_calls_values():
    tokenizer = demo.train_tokenizer()
    [(ids, weights)] = tool_examples(tokenizer, 1, seed=0)
    [(messages, _)] = tool_chats(1, ordinary_pairs(), seed=0)
    call = messages[1]["tool_calls"][0]["function"]
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith(f"{demo.IM_START}system\n# Tools")  # the template's tools list

    def said(kind: float) -> str:
        chosen = [int(i) for i, w in zip(ids, weights, strict=True) if w == kind]
        return tokenizer.decode(chosen, skip_special_tokens=False)

    learnt = said(1.0)
    assert learnt.startswith('<tool_call>\n{"name": ') and call["name"] in learnt
    assert f"</tool_call>{demo.IM_END}The {call['name']}" in learnt  # each reply ends its turn
    assert learnt.endswith(f"The {call['name']} tool says: {messages[2]['content']}{demo.IM_END}")
    assert messages[0]["content"] not in learnt and "# Tools" not in learnt
    values = said(VALUE_WEIGHT)
    for value in call["arguments"].values():
        assert json.dumps(value).strip('"') in values


def test_a_reply_is_read_as_the_call_it_writes():
    assert called('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>') == {
        "name": "add",
        "arguments": {"a": 1},
    }
    assert called("The add tool says: 2") is None
    assert called('<tool_call>\n{"name": "add", "argu') is None
