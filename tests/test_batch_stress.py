"""A reply in a batch is the reply alone (issue 37).

The cause found: a new conversation starts from a copy of a live session's cache
cut to the shared system prompt (``SessionPool.new_session``, as serve and the TUI
make sessions), and the pool copied from a session that was answering, in a merged
batch. The batch holds a merged sequence's keys and values; its own cache objects
kept their offset with no keys, so the copy claimed the system prompt while holding
zeros, and the new conversation's reply was another one. The stress harness
(tests/batch_stress.py) found it in 8 of 10 rounds on gpt_neox and qwen3_moe."""

from __future__ import annotations

import random
import re
import threading

import mlx.core as mx
import pytest
from helpers import wait_until
from typer.testing import CliRunner

from kvchat import batch_check
from kvchat.cli import app
from kvchat.engine.caches.kinds import held_tokens, make_cache, parse_kind
from kvchat.engine.conversation.events import GenerationSettings, TurnDone
from kvchat.engine.conversation.session import Session
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.per_model import core_for
from kvchat.runtime.pool import SessionPool
from tests.batch_stress import FAMILIES, stress

SYSTEM = batch_check.SYSTEM
SETTINGS = GenerationSettings(max_tokens=24, temp=0.0, ignore_eos=True)


def _reply(session: Session, text: str) -> tuple[int, ...]:
    return [e for e in session.send(text) if isinstance(e, TurnDone)][0].tokens


@pytest.fixture
def merged_demo(demo_model, monkeypatch):
    """The demo on MLX's path, where decoding sequences merge into one batch cache."""
    monkeypatch.setattr(demo_model.fast_path, "on", False)
    return demo_model


def test_a_new_session_never_starts_from_a_cache_a_merged_batch_holds(merged_demo):
    pool = SessionPool(ttl_s=None, memory_budget_bytes=None)
    first = pool.new_session(merged_demo, "standard", SYSTEM, SETTINGS, name="first")
    _reply(first, "hello")
    a = pool.new_session(merged_demo, "standard", SYSTEM, SETTINGS, name="a")
    b = pool.new_session(merged_demo, "standard", SYSTEM, SETTINGS, name="b")
    pool.drop("first")  # the live sessions with this system prompt are a and b
    threads = [
        threading.Thread(target=_reply, args=(s, t)) for s, t in ((a, "the sea"), (b, "ships"))
    ]
    for thread in threads:
        thread.start()
    core = core_for(merged_demo)

    def merged_now() -> bool:
        with GATE.exclusive():  # between two steps
            if core.path.merged is None or len(core.path.merged.seqs) < 2:
                return False
            merged_now.made = (  # type: ignore[attr-defined]
                pool.new_session(merged_demo, "standard", SYSTEM, SETTINGS, name="c"),
                a.fork_prefix(),
            )
            return True

    wait_until(merged_now, timeout=30, every=0.001)
    for thread in threads:
        thread.join()
    made, forked = merged_now.made  # type: ignore[attr-defined]
    # what a copy holds is what its ledger says (a lent cache copies as empty)
    assert held_tokens(forked.cache) == len(forked.ledger) == 0
    want = _reply(Session(merged_demo, system=SYSTEM, settings=SETTINGS), "what is a ship?")
    assert _reply(made, "what is a ship?") == want
    assert _reply(forked, "what is a ship?") == want


@pytest.mark.parametrize("name", ["demo", *FAMILIES])
def test_batched_replies_are_the_replies_alone(name, arch, demo_model, monkeypatch):
    """A round of four conversations (one long, joins, stops, penalties, seeds, log
    probabilities), under random scheduling delays; on the fast-path families on MLX's
    path too."""
    lm = demo_model if name == "demo" else arch(name)
    paths = [True, False] if lm.fast_path is not None else [True]
    for on in paths:
        if lm.fast_path is not None:
            monkeypatch.setattr(lm.fast_path, "on", on)
        outcomes = stress(lm, rounds=1, seed=random.Random(name).randrange(1000), long_words=120)
        assert all(o.got.tokens for o in outcomes)
        assert [o.problems for o in outcomes if o.problems] == []


def test_doctor_batch_checks_each_path_of_the_users_model(demo_model):
    out = CliRunner().invoke(app, ["doctor", "--batch", "--model", "demo", "--rounds", "1"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith("CPU fast path: its batched numpy step")
    assert lines[2].startswith("MLX: rows merged into mlx-lm's batch caches")
    for line in (lines[1], lines[3]):  # how many joined one step depends on the timing
        assert line.endswith(": 4 matched, all matched")
        assert re.search(r"4 replies in batches of up to [234] rows", line), line


def test_a_near_tie_is_told_from_a_token_of_another_reply(demo_model):
    """The harness forgives a token only where rounding could have drawn it: the reply
    alone's own token is one; the least likely token there is not."""
    conv = batch_check.Conversation(batch_check.words(20, random.Random(3)), SETTINGS)
    want = batch_check.alone(demo_model, conv)
    assert batch_check.near_tie(demo_model, conv, want, 5, want.tokens[5])
    context = [*want.ledger[: want.prompt], *want.tokens[:5]]
    cache = make_cache(demo_model.model, parse_kind("standard"))
    unlikely = int(mx.argmin(demo_model.model(mx.array([context]), cache=cache)[0, -1]).item())
    assert not batch_check.near_tie(demo_model, conv, want, 5, unlikely)
