"""The Session's collaborators, each alone: the cache keeper on the demo model's real
caches, the history on plain messages, the upkeep on the two."""

from __future__ import annotations

import threading
from functools import partial

import mlx.core as mx
import pytest

from kvchat.engine.caches.kinds import cache_offset, parse_kind
from kvchat.engine.conversation.events import GenerationSettings, SessionError
from kvchat.engine.conversation.history import History, archived_exchanges
from kvchat.engine.conversation.maintenance import CacheKeeper, common_prefix
from kvchat.engine.conversation.stats import Refilled, TurnStats
from kvchat.engine.conversation.template import encode, render
from kvchat.engine.conversation.upkeep import Upkeep
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import for_settings

TEXT = " ".join(f"The fox number {i} jumps over the lazy dog." for i in range(12))
OTHER = " ".join(f"The fox number {i} jumps over the sleeping cat." for i in range(12))


def keeper(lm) -> CacheKeeper:
    return CacheKeeper(lm, parse_kind("standard"), lambda: 0)


def fill(keeper: CacheKeeper, tokens: list[int], progress=None) -> int:
    return keeper.fill(tokens, step=16, stop=threading.Event(), progress=progress)


def keys(keeper: CacheKeeper) -> list[mx.array]:
    """Each layer's keys of the tokens the cache holds."""
    return [layer.state[0][..., : len(keeper.ledger), :] for layer in keeper.cache]


def stats(n: int) -> TurnStats:
    return TurnStats(n, 0, n, 0.0, 0.0, 1, 0.0, n, 0, "standard", 0, 0)


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# ------------------------------------------------------------------ the cache keeper


def test_the_keeper_fills_rewinds_and_refills_to_a_fresh_prefills_cache(demo_model):
    first, second = encode(demo_model, TEXT), encode(demo_model, OTHER)
    shared = common_prefix(first, second)
    assert 0 < shared < len(first)
    kept = keeper(demo_model)
    seen: list[tuple[int, int]] = []
    assert fill(kept, first, lambda done, total: seen.append((done, total))) == len(first)
    assert kept.ledger == first and cache_offset(kept.cache) == len(first) == kept.tokens
    assert seen[0] == (0, len(first)) and seen[-1] == (len(first), len(first))

    assert kept.rewind(shared) == (shared, None)
    assert kept.ledger == first[:shared] and cache_offset(kept.cache) == shared
    assert fill(kept, second) == len(second) - shared
    fresh = keeper(demo_model)
    fill(fresh, second)
    assert kept.ledger == fresh.ledger == second
    for a, b in zip(keys(kept), keys(fresh)):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_the_keeper_fills_only_tokens_that_extend_its_ledger(demo_model):
    kept = keeper(demo_model)
    tokens = encode(demo_model, TEXT)
    fill(kept, tokens[:20])
    with pytest.raises(ValueError, match="do not start with what the cache holds"):
        fill(kept, tokens[1:30])
    assert kept.ledger == tokens[:20] and cache_offset(kept.cache) == 20


def test_a_sequence_the_keeper_makes_extends_its_ledger_and_keeps_the_logits(demo_model):
    kept = keeper(demo_model)
    tokens = encode(demo_model, TEXT)
    fill(kept, tokens[:-1])
    sampler, processors = for_settings(GenerationSettings(temp=0.0))
    seq = kept.sequence(
        tokens[-1:], sampler=sampler, processors=processors, max_tokens=1, stop=threading.Event()
    )
    sampled = [m for m in core_for(demo_model).run(seq) if isinstance(m, int)]
    assert len(sampled) == 1  # the last sampled token is never fed
    assert kept.ledger == tokens and cache_offset(kept.cache) == len(tokens)
    logits = kept.prompt_logprobs
    assert logits is not None and logits[0] == len(tokens)
    assert kept.logprobs_at(len(tokens)) is logits[1] and kept.logprobs_at(3) is None
    kept.rewind(len(tokens) - 1)  # logits past the cache's end go with it
    assert kept.prompt_logprobs is None


def test_a_reset_empties_the_cache_once_and_says_why(demo_model):
    kept = keeper(demo_model)
    fill(kept, encode(demo_model, TEXT)[:10])
    assert kept.reset() is True
    assert kept.ledger == [] and kept.tokens == 0
    assert kept.pending_rebuild == "the cache was reset"
    assert kept.last_change is not None and kept.last_change.action == "reset"
    assert kept.reset() is False


def test_an_attached_cache_is_the_keepers_with_its_ledger(demo_model):
    source, kept = keeper(demo_model), keeper(demo_model)
    tokens = encode(demo_model, TEXT)
    fill(source, tokens)
    copied = source.copy_upto(25)
    assert copied is not None and copied[1] == tokens[:25]
    kept.attach(*copied)
    assert kept.ledger == tokens[:25] and cache_offset(kept.cache) == 25
    assert source.ledger == tokens and cache_offset(source.cache) == len(tokens)
    assert source.copy_upto(0) is None


# ------------------------------------------------------------------ the history


def test_a_turn_adds_its_reply_and_stats_to_the_path():
    history = History([msg("system", "S")])
    history.begin([*history.messages, msg("user", "a")])
    history.add_reply("A", stopped=True)
    history.add_turn(stats(5))
    assert history.messages[-1] == {"role": "assistant", "content": "A", "stopped": True}
    assert history.branches.holds(history.talk()) and history.turns == [stats(5)]
    assert history.branches.path_turns() == [stats(5)] and history.offset == 1


def test_a_revised_reply_replaces_its_node_and_keeps_its_stats():
    history = History([msg("user", "a"), msg("assistant", "A and more")], turns=[stats(3)])
    history.revise_reply({"role": "assistant", "content": "A", "tool_calls": []})
    assert history.messages[-1] == {"role": "assistant", "content": "A", "tool_calls": []}
    assert not history.branches.forked and history.branches.holds(history.talk())
    assert history.branches.path_turns() == [stats(3)]
    with pytest.raises(SessionError, match="assistant message"):
        history.revise_reply(msg("user", "x"))


def test_a_replaced_transcript_joins_the_tree_at_the_next_turn_only():
    history = History([msg("user", "a"), msg("assistant", "A")], turns=[stats(3)])
    previous = history.replace([msg("user", "b"), msg("assistant", "B")])
    assert previous == [msg("user", "a"), msg("assistant", "A")]
    assert history.positions() == [(1, 1), (1, 1)] and not history.branches.forked
    assert history.branch_record() is not None  # a save sees both paths
    assert not history.branches.forked  # ... without changing the tree
    history.begin([*history.messages, msg("user", "c")])
    assert history.positions() == [(2, 2), (1, 1), (1, 1)]
    assert history.turns == []  # B was the client's: no stats of it are known


def test_what_a_turn_answers_is_checked_before_anything_changes():
    history = History([msg("system", "S"), msg("user", "a"), msg("assistant", "A")])
    tree = history.branches.to_record()
    for bad in (
        lambda: history.asking("  "),
        lambda: history.answering([]),
        lambda: history.edited(2, "x"),
        lambda: history.edited(1, " "),
        lambda: history.regenerating(1),
        lambda: history.edited(0, "x"),  # the system prompt is not a user message
    ):
        with pytest.raises(SessionError):
            bad()
    assert history.branches.to_record() == tree and len(history.messages) == 3
    assert history.edited(1, "b") == [msg("system", "S"), msg("user", "b")]
    assert history.regenerating(None) == [msg("system", "S"), msg("user", "a")]


def test_undo_and_trim_keep_messages_stats_and_tree_in_step():
    talk = [msg("user", "a"), msg("assistant", "A"), msg("user", "b"), msg("assistant", "B")]
    history = History([msg("system", "S"), *talk], turns=[stats(1), stats(2)])
    assert history.trim(lambda messages: len(messages) > 3, 3) == 2
    assert history.messages == [msg("system", "S"), *talk[2:]] and history.archived == talk[:2]
    assert history.turns == [stats(2)] and history.branches.holds(history.talk())
    history.undo(1)
    assert history.messages == [msg("system", "S")] and history.turns == []
    assert history.archived == talk  # the trimmed exchange, then the undone one
    with pytest.raises(SessionError, match="Nothing to undo"):
        history.undo(1)
    with pytest.raises(SessionError, match="system prompt alone is over 0 tokens"):
        history.trim(lambda messages: True, 0)


def test_undo_archives_what_it_removes_with_the_branches_under_it():
    """An undone exchange goes to ``archived`` as a trimmed one does, with every branch
    that started under it (a regenerated reply); a version of the undone message itself
    (an edit) is a branch beside it and stays in the tree."""
    history = History([msg("system", "S"), msg("user", "a"), msg("assistant", "A")])
    history.begin(history.edited(1, "a2"))
    history.add_reply("A2", stopped=False)
    history.begin(history.regenerating(None))
    history.add_reply("A3", stopped=False)
    history.undo(1)
    assert history.messages == [msg("system", "S")]
    assert history.archived == [msg("user", "a2"), msg("assistant", "A2"), msg("assistant", "A3")]
    assert [n.message["content"] for n in history.branches.nodes] == ["a", "A"]


def test_a_switch_takes_the_other_paths_messages_and_stats():
    history = History([msg("user", "a"), msg("assistant", "A1")], turns=[stats(1)])
    history.begin([msg("user", "a")])
    history.add_reply("A2", stopped=False)
    history.add_turn(stats(2))
    history.switch(1, -1)
    assert history.messages[-1] == msg("assistant", "A1") and history.turns == [stats(1)]
    with pytest.raises(SessionError, match="no other version"):
        history.switch(1, -1)
    history.remove_pair(0)
    assert history.messages == [] and history.branches.nodes == []


# ------------------------------------------------------------------ the upkeep


def test_a_refill_makes_the_cache_hold_what_the_history_renders_to(demo_model):
    messages = [msg("user", "a fox?"), msg("assistant", "A dog."), msg("user", "why?")]
    history = History(messages[:2])
    kept = keeper(demo_model)
    upkeep = Upkeep(
        kept,
        history,
        partial(render, demo_model, tools=None),
        lambda messages, tokens, after: frozenset(),
        16,
        threading.Event(),
    )
    first = render(demo_model, messages[:2], False)
    assert upkeep.refill() == Refilled(0, len(first)) and kept.ledger == first
    history.replace([*messages, msg("assistant", "Because.")])
    whole = render(demo_model, history.messages, False)
    assert upkeep.refill() == Refilled(len(first), len(whole) - len(first))
    assert kept.ledger == whole and cache_offset(kept.cache) == len(whole)
    upkeep.undo(1)
    assert kept.ledger == first[: len(kept.ledger)] and cache_offset(kept.cache) == len(kept.ledger)
    assert kept.last_change is not None and kept.last_change.action == "undo"


def test_archived_exchanges_come_back_whole_at_the_end():
    """The archive is split at its user messages; a restore takes one exchange out of it
    and onto the end of the transcript and the tree's path; the stats stay with theirs."""
    talk = [msg("user", "a"), msg("assistant", "A"), msg("user", "b"), msg("assistant", "B")]
    history = History([msg("system", "S"), *talk], turns=[stats(1), stats(2)])
    history.trim(lambda messages: len(messages) > 3, 3)
    history.undo(1)
    assert archived_exchanges(history.archived) == [talk[:2], talk[2:]]
    assert archived_exchanges([]) == [] and history.turns == []
    history.restore_archived(1)
    assert history.messages == [msg("system", "S"), *talk[2:]] and history.archived == talk[:2]
    assert history.branches.holds(history.talk()) and history.turns == []
    history.begin(history.asking("c"))
    history.add_reply("C", stopped=False)
    history.add_turn(stats(3))
    history.restore_archived(0)
    assert history.talk() == [*talk[2:], msg("user", "c"), msg("assistant", "C"), *talk[:2]]
    assert history.archived == [] and history.turns == [stats(3)]
    history.undo(2)  # the restored reply has no stats: the undone one takes its own
    assert history.talk() == talk[2:] and history.turns == []
    for index in (0, -1):
        with pytest.raises(SessionError, match="no archived exchange"):
            History([msg("user", "a")]).restore_archived(index)


def test_a_restored_exchange_brings_its_other_replies_back_as_branches():
    """An exchange archived with a regenerated reply comes back as one exchange whose
    reply has two versions, the later one shown: not as two replies in a row."""
    history = History([msg("system", "S"), msg("user", "a"), msg("assistant", "A")])
    history.begin(history.regenerating(None))
    history.add_reply("A2", stopped=False)
    history.undo(1)
    assert archived_exchanges(history.archived) == [
        [msg("user", "a"), msg("assistant", "A"), msg("assistant", "A2")]
    ]
    history.restore_archived(0)
    assert history.messages == [msg("system", "S"), msg("user", "a"), msg("assistant", "A2")]
    assert history.positions() == [(1, 1), (1, 1), (2, 2)] and history.archived == []
    history.switch(2, -1)
    assert history.talk() == [msg("user", "a"), msg("assistant", "A")]
