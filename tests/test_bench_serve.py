"""The serve bench's agent session against a real ``kvchat serve`` (a subprocess on the
demo model): every request answered, the cache reused as the history grows, shrunk to
the prefix an edit leaves, and back from disk after the restart."""

from __future__ import annotations

import json

from kvchat.bench.agent import TOOLS, agent_plan, replay, starter, steps


def test_the_agent_plan_grows_by_tool_calls_and_edits_in_the_middle(demo_model):
    plan = agent_plan(demo_model.tokenizer, requests=12, system_tokens=300)
    assert plan == agent_plan(demo_model.tokenizer, requests=12, system_tokens=300)
    assert steps(12) == (5, 6, 9) and steps(20) == (6, 10, 15)
    kinds = [r.kind for r in plan]
    assert (
        kinds
        == ["first"]
        + ["grown"] * 4
        + ["edited", "restart"]
        + ["grown"] * 2
        + ["edited"]
        + ["grown"] * 2
    )
    system = plan[0].messages[0]["content"]
    assert all(f'"name": "{name}"' in system for name, _, _ in TOOLS)
    for before, after in zip(plan, plan[1:]):
        sent, now = before.messages, after.messages
        assert len(now) == len(sent) + 2  # one call and its result
        call, result = now[-2], now[-1]
        assert call["role"] == "assistant" and call["tool_calls"][0]["type"] == "function"
        json.loads(call["tool_calls"][0]["function"]["arguments"])
        assert result == {
            "role": "tool",
            "tool_call_id": call["tool_calls"][0]["id"],
            "content": result["content"],
        }
        changed = [k for k, (a, b) in enumerate(zip(sent, now)) if a != b]
        if after.kind == "edited":
            # one tool result changed, in the middle, one the request before last sent
            (k,) = changed
            assert now[k]["role"] == "tool" and now[k]["content"].startswith("(read again)")
            assert 2 < k < len(sent) - 2 and abs(k - len(now) / 2) <= 2
        else:
            assert changed == []


def test_the_agent_session_against_kvchat_serve(demo_model, home, tmp_path):
    plan = agent_plan(demo_model.tokenizer, requests=12, system_tokens=300)
    rows = replay(starter("kvchat serve", "demo", demo_model.path, tmp_path, "t"), plan)
    assert [r["kind"] for r in rows] == [r.kind for r in plan]
    assert all(r["answered"] and r["ttft_s"] > 0 for r in rows)
    for i, row in enumerate(rows[1:], 1):
        previous = rows[i - 1]
        if row["kind"] == "edited":
            # the prefix shifted: less reused than the request before, and less than
            # that request's whole prompt, which is otherwise all reused
            assert row["cached_tokens"] < previous["cached_tokens"]
            assert row["cached_tokens"] < previous["prompt_tokens"]
        else:
            # grown, or the first after the restart (the saved session, from disk):
            # the request before's whole prompt is reused
            assert row["cached_tokens"] >= previous["prompt_tokens"] > 0
            assert row["prompt_tokens"] > previous["prompt_tokens"]
