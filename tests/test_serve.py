"""`kvchat serve` through the official openai client: caches reused, resumed, named, cut short."""

from __future__ import annotations

import json
import os

import openai
import pytest
from helpers import ask_from_shell
from serve_helpers import Server, chat, chat_streamed
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine import cpu
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.template import render
from kvchat.runtime.pool import SessionPool
from kvchat.store.lock import lock_file
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)

SYSTEM = {"role": "system", "content": "You are terse."}


def held_after(prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens a turn leaves in the cache: its prompt and reply, less the last sampled
    token on the CPU fast path (it is fed with the next turn)."""
    return prompt_tokens + completion_tokens - (1 if cpu.wanted() is None else 0)


def test_multi_turn_non_streamed_then_streamed_reuses_the_history(demo_model, home):
    with Server(demo_model) as server:
        first = [SYSTEM, {"role": "user", "content": "Name three rivers."}]
        reply1, body1, headers1 = chat(server.client, first, max_tokens=12)
        usage1 = body1["usage"]
        assert usage1["prompt_tokens"] == len(render(demo_model, first, True))
        assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
        assert body1["kvchat"]["match"] == "new"
        assert headers1["x-kvchat-session"] == body1["kvchat"]["session"]
        assert headers1["x-kvchat-cached-tokens"] == "0"
        assert body1["choices"][0]["finish_reason"] in ("stop", "length")

        second = [
            *first,
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "And three mountains?"},
        ]
        reply2, stats2, usage2 = chat_streamed(server.client, second, max_tokens=12)
        prompt2 = render(demo_model, second, True)
        history = render(demo_model, second[:-1], False)
        held = held_after(usage1["prompt_tokens"], usage1["completion_tokens"])
        # Every token turn 1 left in the cache is the history's, and all of it is reused.
        assert common_prefix(history, prompt2) >= held
        assert usage2.prompt_tokens == len(prompt2)
        assert usage2.prompt_tokens_details.cached_tokens == held
        assert stats2["reused_tokens"] == held
        assert stats2["evaluated_tokens"] == len(prompt2) - held
        assert stats2["match"] == "continued" and stats2["session"] == body1["kvchat"]["session"]
        assert reply2 and stats2["generated_tokens"] == usage2.completion_tokens

        session = server.pool.entry(stats2["session"]).session
        assert [m["content"] for m in session.messages] == [
            SYSTEM["content"],
            first[1]["content"],
            reply1,
            second[-1]["content"],
            reply2,
        ]
        assert len(session.ledger) == session.cache_tokens == stats2["ledger_tokens"]


def test_greedy_replies_equal_kvchat_replay(demo_model, home):
    """The same turns through `kvchat replay --json` and over HTTP (alternately streamed)."""
    turns = ["Tell me about caches.", "Why do they help?", "Say it shorter."]
    script = home.parent / "script.json"
    script.write_text(json.dumps({"system": SYSTEM["content"], "turns": turns}))
    out = CliRunner().invoke(
        app, ["replay", str(script), "--model", "demo", "--max-tokens", "10", "--json"]
    )
    assert out.exit_code == 0, out.output
    replayed = json.loads(out.stdout)["turns"]
    messages = [SYSTEM]
    with Server(demo_model) as server:
        for i, (text, expected) in enumerate(zip(turns, replayed)):
            messages.append({"role": "user", "content": text})
            if i % 2:
                reply, stats, _ = chat_streamed(server.client, messages, max_tokens=10)
            else:
                reply, body, _ = chat(server.client, messages, max_tokens=10)
                stats = body["kvchat"]
            assert reply == expected["reply"]
            assert stats["reused_tokens"] == expected["reused_tokens"]
            assert stats["prompt_tokens"] == expected["prompt_tokens"]
            messages.append({"role": "assistant", "content": reply})


def test_a_restarted_server_resumes_the_conversation_from_disk(demo_model, home):
    first = [SYSTEM, {"role": "user", "content": "Remember the number 42."}]
    with Server(demo_model) as server:
        reply1, body1, _ = chat(server.client, first, max_tokens=8)
    name = body1["kvchat"]["session"]
    saved = store.read(name)
    assert [m["content"] for m in saved["messages"]][-1] == reply1
    assert len(saved["ledger"]) == body1["kvchat"]["ledger_tokens"]

    second = [
        *first,
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "Which number?"},
    ]
    with Server(demo_model) as server:  # a new process's pool: nothing in memory
        assert server.pool.names() == []
        _, body2, headers2 = chat(server.client, second, max_tokens=8)
    stats = body2["kvchat"]
    assert stats["session"] == name and stats["match"] == "continued"
    assert stats["resumed_from_disk"] is True and headers2["x-kvchat-resumed-from-disk"] == "true"
    assert stats["rebuilt"] is None
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(saved["ledger"])


def test_a_session_written_by_kvchat_ask_is_continued_by_name(demo_model, home):
    ask_from_shell("notes", "Hello from the shell.")
    saved = store.read("notes")
    follow = {"role": "user", "content": "Hello from HTTP."}
    expected_prompt = render(demo_model, [*saved["messages"], follow], True)
    with Server(demo_model) as server:
        reply, body, headers = chat(
            server.client, [follow], max_tokens=6, extra_headers={"X-Session-Id": "notes"}
        )
        stats = body["kvchat"]
        assert stats["session"] == "notes" and stats["match"] == "named"
        assert stats["resumed_from_disk"] is True
        assert body["usage"]["prompt_tokens"] == len(expected_prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == common_prefix(
            saved["ledger"], expected_prompt
        )
        # the whole history may also be sent
        history = [*saved["messages"], follow, {"role": "assistant", "content": reply}]
        _, body3, _ = chat(
            server.client,
            [*history, {"role": "user", "content": "Again."}],
            max_tokens=6,
            extra_headers={"X-Session-Id": "notes"},
        )
        assert body3["kvchat"]["session"] == "notes"
        assert body3["kvchat"]["reused_tokens"] == held_after(
            body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
        )
    contents = [m["content"] for m in store.read("notes")["messages"]]
    assert contents[:2] == [m["content"] for m in saved["messages"]]
    assert contents[2:5] == ["Hello from HTTP.", reply, "Again."] and len(contents) == 6


def test_a_stopped_server_lets_go_of_its_sessions(demo_model, home):
    """While serving, the sessions it answered in are open (a lease each, so that another
    kvchat opening one is warned); once it stops, none is left behind."""
    with Server(demo_model) as server:
        _, named, _ = chat(
            server.client,
            [{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers={"X-Session-Id": "kept"},
        )
        _, anonymous, _ = chat(server.client, [{"role": "user", "content": "yo"}], max_tokens=2)
        names = sorted([named["kvchat"]["session"], anonymous["kvchat"]["session"]])
        assert names[0] == "kept" and names[1].startswith("serve-")
        leases = lock_file("kept").parent
        assert sorted(p.name for p in leases.glob("*.open")) == [
            f"{name}.{os.getpid()}.open" for name in names
        ]
        assert store.open_elsewhere("kept") == []  # its own lease: not another process's
    assert list(leases.glob("*.open")) == []
    assert [m["content"] for m in store.read("kept")["messages"]][0] == "hi"


def test_a_client_that_disconnects_mid_stream_stops_its_reply(demo_model, home):
    first = [{"role": "user", "content": "Talk for a long time."}]
    with Server(demo_model) as server:
        stream = server.client.chat.completions.create(
            model="demo", messages=first, temperature=0, stream=True, max_tokens=2000
        )
        seen = ""
        for chunk in stream:
            seen += "".join(c.delta.content or "" for c in chunk.choices)
            if len(seen) >= 6:
                break
        name = stream.response.headers["x-kvchat-session"]
        stream.close()
        server.wait_idle()
        # saved after the stop
        wait_until(lambda: store.read(name)["messages"][-1]["role"] == "assistant", every=0.05)
        session = server.pool.entry(name).session
        kept = session.messages[-1]
        assert kept.get("stopped") is True and kept["content"].startswith(seen)
        assert session.last_stats.generated_tokens < 2000
        assert len(session.ledger) == session.cache_tokens
        assert store.read(name)["ledger"] == session.ledger

        # The client continues with what it saw; the shared prefix is reused.
        second = [
            *first,
            {"role": "assistant", "content": seen},
            {"role": "user", "content": "Go on."},
        ]
        reply, body, _ = chat(server.client, second, max_tokens=8)
        prompt1 = len(render(demo_model, first, True))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1
        child = server.pool.entry(body["kvchat"]["session"]).session
        assert len(child.ledger) == child.cache_tokens
        assert child.messages[-1]["content"] == reply


def test_stop_strings_seed_and_top_p(demo_model, home):
    ask = [{"role": "user", "content": "Count with me."}]
    with Server(demo_model) as server:
        full, body, _ = chat(server.client, ask, max_tokens=12)
        assert len(full) >= 4
        stop = full[2:4]  # a piece of what it will say again, greedy
        cut, body_cut, _ = chat(
            server.client,
            [{"role": "user", "content": "Count with me."}],
            max_tokens=12,
            stop=[stop, "never said"],
        )
        assert cut == full[: full.index(stop)]
        assert body_cut["choices"][0]["finish_reason"] == "stop"
        streamed, stats, _ = chat_streamed(server.client, ask, max_tokens=12, stop=stop)
        assert streamed == cut
        session = server.pool.entry(stats["session"]).session
        assert session.messages[-1] == {"role": "assistant", "content": cut}  # not 'stopped'
        assert len(session.ledger) == session.cache_tokens
        assert store.read(stats["session"])["messages"][-1]["content"] == cut

        sampled = [
            chat(
                server.client,
                [{"role": "user", "content": f"Seeded {i % 2}."}],
                max_tokens=10,
                temperature=1.5,
                top_p=0.9,
                seed=7,
            )[0]
            for i in range(4)
        ]
        assert sampled[0] == sampled[2] and sampled[1] == sampled[3]
        other = chat(
            server.client,
            [{"role": "user", "content": "Seeded 0."}],
            max_tokens=10,
            temperature=1.5,
            top_p=0.9,
            seed=8,
        )[0]
        assert other != sampled[0]


def test_the_pools_memory_budget_offloads_and_a_later_turn_resumes_from_disk(demo_model, home):
    with Server(demo_model, pool=SessionPool(memory_budget_bytes=1)) as server:
        a = [{"role": "user", "content": "Conversation A."}]
        b = [{"role": "user", "content": "Conversation B, unrelated."}]
        reply_a, body_a, _ = chat(server.client, a, max_tokens=6)
        chat(server.client, b, max_tokens=6)
        name_a = body_a["kvchat"]["session"]
        assert not server.pool.entry(name_a).in_memory  # over budget: A's cache went to disk
        a += [{"role": "assistant", "content": reply_a}, {"role": "user", "content": "More."}]
        _, body, _ = chat(server.client, a, max_tokens=6)
        stats = body["kvchat"]
        assert stats["session"] == name_a and stats["match"] == "continued"
        assert stats["resumed_from_disk"] is True
        assert stats["reused_tokens"] == body_a["kvchat"]["ledger_tokens"]


def test_serve_counts_its_models_weights_in_the_memory_budget(demo_model, home):
    """`kvchat serve`'s pool, as the TUI's, counts the weights: a budget one byte over them
    holds only the newest cache (without the weights, both tiny caches would fit)."""
    from kvchat.cli.serve import serve_pool
    from kvchat.config import Config
    from kvchat.engine.models.registry import weight_bytes

    weights = weight_bytes(demo_model)
    pool = serve_pool(demo_model, Config(memory_budget=weights + 1))
    assert pool.memory_bytes() == weights and pool.models.holders() == {"demo": 1}
    with Server(demo_model, pool=pool) as server:
        _, body_a, _ = chat(
            server.client, [{"role": "user", "content": "Conversation A."}], max_tokens=6
        )
        _, body_b, _ = chat(
            server.client, [{"role": "user", "content": "Conversation B."}], max_tokens=6
        )
        a, b = (pool.entry(body["kvchat"]["session"]) for body in (body_a, body_b))
        assert 0 < 2 * b.cache_bytes <= weights  # the two caches alone would fit
        assert not a.in_memory and b.in_memory
        assert pool.models.holders() == {"demo": 3}  # the server's hold, and each session's


def test_a_client_that_gives_up_on_a_non_streamed_reply_stops_it(endless, home):
    with Server(endless) as server:
        impatient = server.client.with_options(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            chat(impatient, [{"role": "user", "content": "Write a great deal."}], max_tokens=5000)
        server.wait_idle()
        (name,) = server.pool.names()
        session = server.pool.entry(name).session
        assert session.messages[-1].get("stopped") is True
        assert session.last_stats.generated_tokens < 5000
        assert len(session.ledger) == session.cache_tokens
        assert store.read(name)["ledger"] == session.ledger


def test_the_servers_cache_kind_is_used_and_kept(demo_model, home):
    with Server(demo_model, kind="quantized:8") as server:
        first = [{"role": "user", "content": "Quantized, please."}]
        reply, body, _ = chat(server.client, first, max_tokens=6)
        assert body["kvchat"]["cache_kind"] == "quantized:8"
        _, body2, _ = chat(
            server.client,
            [
                *first,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Again."},
            ],
            max_tokens=6,
        )
        assert body2["kvchat"]["cache_kind"] == "quantized:8"
        assert body2["kvchat"]["reused_tokens"] == body["kvchat"]["ledger_tokens"]
    assert store.read(body["kvchat"]["session"])["cache_kind"] == "quantized:8"


def test_every_sampling_setting_is_a_request_field_and_honoured(demo_model, home):
    from kvchat.serve.schema import ChatRequest
    from kvchat.settings import GENERATION

    assert {s.api for s in GENERATION} <= set(ChatRequest.model_fields)
    ask = [{"role": "user", "content": "What is a hash table?"}]
    with Server(demo_model) as server:
        greedy = chat(server.client, ask, max_tokens=10, temperature=0)[0]
        top_1 = chat(
            server.client, ask, max_tokens=10, temperature=1.5, seed=3, extra_body={"top_k": 1}
        )[0]
        sampled = chat(server.client, ask, max_tokens=10, temperature=1.5, seed=3)[0]
        again = chat(server.client, ask, max_tokens=10, temperature=1.5, seed=3)[0]
        with pytest.raises(openai.BadRequestError, match="top_k"):
            chat(server.client, ask, max_tokens=4, extra_body={"top_k": -1})
    assert top_1 == greedy and sampled == again != greedy


def test_logit_bias_makes_the_reply_that_token(demo_model, home):
    token = demo_model.tokenizer.encode(" cache", add_special_tokens=False)[0]
    ask = [{"role": "user", "content": "Say anything."}]
    with Server(demo_model) as server:
        reply, body, _ = chat(server.client, ask, max_tokens=5, logit_bias={str(token): 100})
        free = chat(server.client, ask, max_tokens=5)[0]
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            chat(server.client, ask, max_tokens=2, logit_bias={"999999999": 5})
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            chat(server.client, ask, max_tokens=2, logit_bias={str(token): 101})
    assert body["usage"]["completion_tokens"] == 5
    assert reply == demo_model.tokenizer.decode([token] * 5) != free
