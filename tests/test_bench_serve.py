"""The serve bench's agent session against a real ``kvchat serve`` (a subprocess on the
demo model): every request answered, the cache reused as the history grows, shrunk to
the prefix an edit leaves, and back from disk after the restart. The soak: every
request answered, the server's memory sampled."""

from __future__ import annotations

import json
import os

from kvchat.bench.agent import TOOLS, agent_plan, replay, starter, steps
from kvchat.bench.soak import rss_bytes, soak


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


def test_rss_is_the_process_resident_memory():
    before = rss_bytes(os.getpid())
    block = bytearray(64 << 20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident now
    assert rss_bytes(os.getpid()) - before >= 60 << 20
    del block


def test_a_small_soak_answers_every_request_and_samples_memory(demo_model, tmp_path):
    result = soak("demo", tmp_path, requests=60, clients=8, sample_every=20)
    assert result["errors"] == {} and result["requests"] == 60
    assert [n for n, _ in result["rss_mb_samples"]] == [20, 40, 60]
    assert result["rss_mb_after_warmup"] == result["rss_mb_samples"][0][1] > 50
    ratio = result["rss_mb_at_end"] / result["rss_mb_after_warmup"]
    assert abs(result["rss_end_vs_warmup"] - ratio) < 0.01
    seconds = result["seconds"]  # rounded to 0.1
    assert (
        60 / (seconds + 0.05) - 0.01 <= result["requests_per_s"] <= 60 / max(seconds - 0.05, 0.01)
    )
