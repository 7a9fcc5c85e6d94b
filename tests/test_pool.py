"""SessionPool: offload on TTL and memory budget, transparent reload, shared-prefix starts."""

from __future__ import annotations

import pytest
from helpers import turn

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.runtime.pool import SessionPool

SYSTEM = "You are terse."
TEXTS = ["Hello there.", "What is a cache?"]
NEXT = "And why is it fast?"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings() -> GenerationSettings:
    return GenerationSettings(max_tokens=10)


def chat(lm, system=SYSTEM, texts=TEXTS) -> Session:
    session = Session(lm, system=system, settings=settings())
    for text in texts:
        turn(session, text)
    return session


def test_ttl_offloads_and_reloads_transparently(demo_model, home):
    clock = Clock()
    pool = SessionPool(ttl_s=60, memory_budget_bytes=0, clock=clock)
    a = pool.add("a", chat(demo_model))
    clock.now += 30
    pool.add("b", chat(demo_model, texts=["Something else."]))
    held = len(a.ledger)

    clock.now += 45  # a idle 75 s, b 45 s
    assert pool.expire() == ["a"]
    entry = pool.entry("a")
    assert not entry.in_memory and entry.cache_bytes == 0 and a.cache_bytes < 1000
    assert a.messages == chat(demo_model).messages  # the transcript stays
    assert store.exists("a") and not store.exists("b")
    assert pool.memory_bytes() == pool.entry("b").cache_bytes > 0

    reference = chat(demo_model)
    same = pool.get("a")
    assert same is a and pool.entry("a").in_memory and len(a.ledger) == held
    got, want = turn(a, NEXT), turn(reference, NEXT)
    assert got.reply == want.reply
    assert got.stats.reused_tokens == want.stats.reused_tokens > 0
    assert got.stats.evaluated_tokens == want.stats.evaluated_tokens
    assert pool.expire(now=clock.now + 10) == []
    assert set(pool.expire(now=clock.now + 1000)) == {"a", "b"}


def test_offload_saves_only_when_changed(demo_model, home):
    pool = SessionPool(ttl_s=0)
    pool.add("a", chat(demo_model))
    assert pool.expire(now=10**12) == []  # ttl 0: never
    pool.offload("a")
    mtime = (store.session_dir("a") / "session.json").stat().st_mtime_ns
    pool.get("a")
    assert not pool.entry("a").dirty
    pool.offload("a")
    assert (store.session_dir("a") / "session.json").stat().st_mtime_ns == mtime
    turn(pool.get("a"), NEXT)
    assert pool.entry("a").dirty
    pool.offload("a")
    assert store.load("a", demo_model).session.messages[-2]["content"] == NEXT


def test_a_greedy_regenerate_is_a_change_to_save(demo_model, home):
    """At temperature 0 a regenerate gives the same text and ledger; its figures are new."""
    pool = SessionPool()
    session = pool.add("g", chat(demo_model))
    pool.save("g")
    before = session.turns[-1].to_dict()
    list(session.regenerate())
    assert session.messages[-1]["content"] and session.turns[-1].to_dict() != before
    assert pool.entry("g").dirty
    pool.save("g")
    assert store.read("g")["turns"][-1] == session.turns[-1].to_dict()
    assert store.read("g")["turns"][-1]["evaluated_tokens"] == 0


def test_rename_keeps_what_the_pool_knows_of_the_last_save(demo_model, home):
    pool = SessionPool()
    session = pool.add("old", chat(demo_model))
    pool.save("old")
    store.save(session, "new")
    store.delete("old")
    pool.rename("old", "new")
    assert "old" not in pool and pool.entry("new").session is session
    assert not pool.entry("new").dirty  # a tab renamed after a save needs no second save
    turn(session, NEXT)
    assert pool.entry("new").dirty


def test_budget_offloads_least_recently_used_first(demo_model, home):
    clock = Clock()
    pool = SessionPool(ttl_s=0, memory_budget_bytes=1, clock=clock)
    for name in ("a", "b", "c"):
        pool.add(name, chat(demo_model, texts=[f"Hello from {name}."]))
        clock.now += 1
    one = pool.entry("a").cache_bytes
    pool.memory_budget_bytes = 2 * one
    pool.touch("a")  # a is now the most recent, b the least
    assert pool.enforce_budget() == ["b"]
    assert [e.name for e in pool.entries() if e.in_memory] == ["a", "c"]
    pool.memory_budget_bytes = 1
    assert pool.enforce_budget() == ["c"]  # the most recent one always stays
    assert [e.name for e in pool.entries() if e.in_memory] == ["a"]

    reference = chat(demo_model, texts=["Hello from b."])
    b = pool.get("b")
    got, want = turn(b, NEXT), turn(reference, NEXT)
    assert got.reply == want.reply and got.stats.reused_tokens == want.stats.reused_tokens > 0


@pytest.mark.quantized_attention
def test_new_session_shares_the_system_prompt_prefix(demo_model, home):
    pool = SessionPool()
    pool.add("a", chat(demo_model))
    fresh = Session(demo_model, system=SYSTEM, settings=settings())
    system_tokens = len(fresh.render(fresh.messages, False))

    shared = pool.new_session(demo_model, "standard", SYSTEM, settings(), name="b")
    assert "b" in pool and len(shared.ledger) == system_tokens
    got, want = turn(shared, TEXTS[0]), turn(fresh, TEXTS[0])
    assert got.reply == want.reply
    assert got.stats.reused_tokens == system_tokens and want.stats.reused_tokens == 0
    assert got.stats.evaluated_tokens == want.stats.evaluated_tokens - system_tokens

    other = pool.new_session(demo_model, "standard", "A different prompt.", settings())
    assert other.ledger == []
    other_kind = pool.new_session(demo_model, "quantized:8", SYSTEM, settings())
    assert other_kind.ledger == []
    pool.offload("a")
    pool.offload("b")
    assert pool.new_session(demo_model, "standard", SYSTEM).ledger == []  # none live


def test_drop(demo_model, home):
    pool = SessionPool()
    pool.add("a", chat(demo_model))
    pool.save("a")
    pool.drop("a")
    assert "a" not in pool and store.exists("a")
    loaded = pool.open("a", demo_model)
    assert loaded.resumed_from_disk and "a" in pool
    pool.drop("a", delete_from_disk=True)
    assert not store.exists("a")


def test_discard_deletes_a_copy_only_an_offload_wrote(demo_model, home):
    pool = SessionPool(ttl_s=60, memory_budget_bytes=0)
    pool.add("never-saved", chat(demo_model))
    pool.add("saved", chat(demo_model, texts=["Keep this."]))
    pool.save("saved")
    assert pool.offload("never-saved") and pool.offload("saved")
    assert store.exists("never-saved") and store.exists("saved")

    pool.discard("never-saved")  # the user never asked for this copy
    pool.discard("saved")  # this one was saved on request: it stays, as it was
    assert not store.exists("never-saved") and "never-saved" not in pool
    assert store.load("saved", demo_model).session.messages[-2]["content"] == "Keep this."

    pool.open("saved", demo_model)  # opened from disk, offloaded, discarded: it stays
    pool.offload("saved")
    pool.discard("saved")
    assert store.exists("saved") and pool.names() == []
