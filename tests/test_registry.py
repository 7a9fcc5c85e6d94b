"""ModelRegistry: models load on demand, are shared, counted and unloaded when unused;
the pool counts their weights in its memory budget; the scheduler serialises turns on
different models; a changed system prompt keeps the cache up to the change."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from helpers import turn

from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.engine.models.model import ModelLoadError
from kvchat.engine.models.registry import ModelRegistry, weight_bytes
from kvchat.runtime.pool import SessionPool

OTHER = "demo@q4"  # the demo's shape with 4-bit weights: another model, built in a second


def test_a_model_loads_once_is_shared_and_unloads_with_its_last_holder(kvchat_dirs):
    registry = ModelRegistry()
    first = registry.acquire(OTHER)
    assert registry.acquire(OTHER) is first
    assert registry.holders() == {OTHER: 2}
    assert registry.weight_bytes() == weight_bytes(first) > 0
    gone = weakref.ref(first.model)
    assert registry.release(first) is False and registry.holders() == {OTHER: 1}
    assert registry.release(first) is True
    del first
    gc.collect()
    assert registry.holders() == {} and registry.get(OTHER) is None
    assert registry.weight_bytes() == 0
    assert gone() is None  # nothing else kept the weights


def test_a_model_that_cannot_load_leaves_the_registry_as_it_was(demo_model, tmp_path):
    registry = ModelRegistry()
    registry.retain(demo_model)
    with pytest.raises(ModelLoadError, match="Could not load model") as error:
        registry.acquire(str(tmp_path / "no-such-model"))
    assert "\n" not in str(error.value)
    assert registry.holders() == {"demo": 1}


def test_the_pool_holds_each_open_sessions_model_and_counts_its_weights(demo_model, home):
    registry = ModelRegistry()
    registry.retain(demo_model)  # the front end's default model
    other = registry.acquire(OTHER)
    pool = SessionPool(ttl_s=0, models=registry)
    a = pool.add("a", Session(demo_model, settings=GenerationSettings(max_tokens=4)))
    b = pool.add("b", Session(other, settings=GenerationSettings(max_tokens=4)))
    registry.release(other)  # the loader's hold: the pool's session holds it now
    assert registry.holders() == {"demo": 2, OTHER: 1}
    turn(a, "hello there")
    turn(b, "hello there")
    weights = weight_bytes(demo_model) + weight_bytes(other)
    assert pool.memory_bytes() == weights + a.allocated_bytes + b.allocated_bytes

    # a budget the models alone nearly fill: the older cache goes to disk, models stay
    pool.memory_budget_bytes = weights + b.allocated_bytes
    pool.touch("b")
    assert pool.enforce_budget() == ["a"]
    assert registry.holders() == {"demo": 2, OTHER: 1}

    gone = weakref.ref(other.model)
    del other
    pool.drop("b")
    del b
    gc.collect()
    assert registry.holders() == {"demo": 2} and gone() is None
    pool.drop("a")
    assert registry.holders() == {"demo": 1}  # the front end still holds its default


def test_turns_on_two_models_never_overlap_and_match_their_solo_runs(demo_model, kvchat_dirs):
    registry = ModelRegistry()
    other = registry.acquire(OTHER)
    solo = {
        lm.model_id: turn(
            Session(lm, settings=GenerationSettings(max_tokens=12)), "Say something."
        ).reply
        for lm in (demo_model, other)
    }
    assert solo["demo"] != solo[OTHER]  # the two models answer differently

    scheduler = Scheduler()
    spans: dict[str, tuple[float, float]] = {}
    replies: dict[str, str] = {}

    def run(lm) -> None:
        session = Session(lm, settings=GenerationSettings(max_tokens=12))
        with scheduler.turn(lm.model_id):
            started = time.perf_counter()
            replies[lm.model_id] = turn(session, "Say something.").reply
            spans[lm.model_id] = (started, time.perf_counter())

    threads = [threading.Thread(target=run, args=(lm,)) for lm in (demo_model, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (s1, e1), (s2, e2) = sorted(spans.values())
    assert e1 <= s2  # one turn at a time, whatever the model
    assert replies == solo


def test_a_new_system_prompt_keeps_the_cache_up_to_the_change(demo_model):
    session = Session(
        demo_model, system="You are terse.", settings=GenerationSettings(max_tokens=6)
    )
    turn(session, "hello there")
    old = list(session.ledger)
    kept = session.set_system("You are verbose.")
    tokenizer = demo_model.tokenizer
    rendered = tokenizer.encode(
        tokenizer.apply_chat_template(session.messages, tokenize=False), add_special_tokens=False
    )
    assert 0 < kept == common_prefix(old, rendered) < len(old)
    assert session.ledger == old[:kept] and session.cache_tokens == kept
    assert session.messages[0] == {"role": "system", "content": "You are verbose."}
    assert session.set_system("") < kept and session.messages[0]["role"] == "user"


def test_a_closed_session_lets_go_of_its_cache_and_model(kvchat_dirs):
    registry = ModelRegistry()
    lm = registry.acquire(OTHER)
    session = Session(lm, settings=GenerationSettings(max_tokens=4))
    turn(session, "hello there")
    assert session.cache_tokens > 0
    gone = weakref.ref(lm.model)
    registry.release(lm)
    del lm
    gc.collect()
    assert gone() is not None  # the session still uses it
    session.close()
    gc.collect()
    assert gone() is None and session.ledger == [] and session.cache_tokens == 0
    assert session.messages[-1]["role"] == "assistant"  # the transcript stays readable
