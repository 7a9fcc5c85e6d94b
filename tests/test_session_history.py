"""The Session's methods for a transcript changed from outside a turn (a server's client
resending its history, a reply cut at a stop string, tools' results), on the demo model
with real caches: the ledger stays exactly what the cache holds, and the next turn
evaluates only what the cache does not share with its prompt."""

from __future__ import annotations

import pytest

from kvchat.engine.caches.kinds import cache_offset
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import GenerationSettings, Session, SessionError
from tests.helpers import turn

SETTINGS = GenerationSettings(max_tokens=8, temp=0.0)
SYSTEM = "You are a terse assistant."
QUESTIONS = ["What is a cache?", "Why is it fast?", "What is a ledger?"]


def talked(lm, questions=QUESTIONS) -> Session:
    session = Session(lm, system=SYSTEM, settings=SETTINGS)
    for text in questions:
        turn(session, text)
    return session


def assert_ledger_is_the_cache(session: Session) -> None:
    assert cache_offset(session.cache) == len(session.ledger) == session.cache_tokens


def fresh_reply(lm, messages: list[dict], text: str) -> str:
    """The reply to ``messages`` then ``text`` from an empty cache."""
    return turn(Session(lm, settings=SETTINGS, messages=messages), text).reply


def test_a_replaced_history_is_reconciled_by_the_next_turns_prefix_match(demo_model):
    session = talked(demo_model)
    ledger = session.ledger
    # the client's copy: the first exchange as it was, then another second question
    history = [*session.messages[:3], {"role": "user", "content": "Is it small?"}]
    history.append({"role": "assistant", "content": "Yes, quite small."})
    previous = session.replace_history(history)

    assert len(previous) == 7 and previous[3]["content"] == QUESTIONS[1]
    assert session.messages == history and session.ledger == ledger  # the cache waits
    assert session.branch_positions() == [(1, 1)] * 5  # the tree catches up at the turn
    prompt = session.render([*history, {"role": "user", "content": "Why?"}], True)
    shared = common_prefix(ledger, prompt)
    assert 0 < shared < len(ledger)

    done = turn(session, "Why?")
    assert done.stats.reused_tokens == shared
    assert done.stats.evaluated_tokens == len(prompt) - shared
    assert done.reply == fresh_reply(demo_model, history, "Why?")
    assert_ledger_is_the_cache(session)
    assert session.branch_position(3) == (2, 2)  # the old second question is a branch
    assert len(session.turns) == 2  # the first reply's, and this one's


def test_putting_the_old_history_back_costs_nothing(demo_model):
    session = talked(demo_model)
    reference = talked(demo_model)
    previous = session.replace_history(session.messages[:1])
    session.replace_history(previous)  # the request failed: as it was
    assert session.messages == reference.messages and session.ledger == reference.ledger
    assert len(session.turns) == len(reference.turns) == 3  # no stats were lost

    done, expected = turn(session, "Thanks."), turn(reference, "Thanks.")
    assert done.stats.evaluated_tokens == expected.stats.evaluated_tokens
    assert done.stats.reused_tokens == expected.stats.reused_tokens
    assert done.reply == expected.reply and session.branch_record() is None


def test_a_fresh_session_takes_a_clients_history(demo_model):
    history = talked(demo_model, QUESTIONS[:2]).messages
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    session.replace_history(history)
    prompt = session.render([*history, {"role": "user", "content": "And?"}], True)

    done = turn(session, "And?")
    assert done.stats.reused_tokens == 0 and done.stats.evaluated_tokens == len(prompt)
    assert done.reply == fresh_reply(demo_model, history, "And?")
    assert session.messages[:-2] == history and session.branch_record() is None
    assert_ledger_is_the_cache(session)


def test_a_revised_reply_trims_the_cache_and_leaves_no_branch(demo_model):
    session = talked(demo_model)
    ledger = session.ledger
    reply = session.messages[-1]["content"]
    cut = reply[: len(reply) // 2]
    session.revise_reply({"role": "assistant", "content": cut})

    assert session.messages[-1] == {"role": "assistant", "content": cut}
    rendered = session.render(session.messages, False)
    kept = session.ledger
    assert len(kept) < len(ledger) and kept == rendered[: len(kept)] == ledger[: len(kept)]
    assert_ledger_is_the_cache(session)
    assert session.branch_record() is None and session.branch_positions() == [(1, 1)] * 7
    assert len(session.turns) == 3  # the revised reply keeps its stats

    prompt = session.render([*session.messages, {"role": "user", "content": "Go on."}], True)
    done = turn(session, "Go on.")
    assert done.stats.reused_tokens == len(kept)
    assert done.stats.evaluated_tokens == len(prompt) - len(kept)
    assert done.reply == fresh_reply(demo_model, session.messages[:-2], "Go on.")
    assert session.branch_record() is None


def test_only_a_reply_is_revised(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    with pytest.raises(SessionError, match="no reply to revise"):
        session.revise_reply({"role": "assistant", "content": "x"})
    turn(session, QUESTIONS[0])
    before = session.messages
    with pytest.raises(SessionError, match="assistant message"):
        session.revise_reply({"role": "user", "content": "x"})
    assert session.messages == before


def test_tools_results_are_answered_in_one_call(demo_model):
    session = talked(demo_model, QUESTIONS[:1])
    ledger = session.ledger
    results = [{"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    prompt = session.render([*session.messages, *results], True)

    done = [e for e in session.answer(results)][-1]
    assert done.stats.reused_tokens == common_prefix(ledger, prompt) == len(ledger)
    assert done.stats.evaluated_tokens == len(prompt) - len(ledger)
    assert [m["role"] for m in session.messages[-3:]] == ["assistant", "tool", "assistant"]
    assert_ledger_is_the_cache(session)


def test_an_answer_to_no_tool_result_changes_nothing(demo_model):
    session = talked(demo_model, QUESTIONS[:1])
    before, ledger = session.messages, session.ledger
    for results in ([], [{"role": "user", "content": "not a tool's"}]):
        with pytest.raises(SessionError, match="not a tool's result"):
            session.answer(results)
        assert session.messages == before and session.ledger == ledger


def test_the_transcript_and_the_ledger_change_only_through_the_session(demo_model):
    session = talked(demo_model, QUESTIONS[:1])
    messages, ledger = session.messages, session.ledger
    session.messages.append({"role": "user", "content": "lost"})
    session.messages[0]["content"] = "changed"  # a copy of the message too
    session.ledger.clear()
    assert session.messages == messages and session.ledger == ledger
    with pytest.raises(AttributeError):
        session.messages = []  # type: ignore[misc]
    with pytest.raises(AttributeError):
        session.ledger = []  # type: ignore[misc]


def test_an_undone_exchange_comes_back_from_the_archive(demo_model):
    """Undo archives the exchange; restoring it puts exactly it back at the end, the next
    turn's reply is the uncached one, and a save keeps both lists as they are."""
    from kvchat import store
    from kvchat.engine.conversation.history import archived_exchanges

    session = talked(demo_model)
    undone = session.messages[-2:]
    session.undo()
    assert archived_exchanges(session.archived) == [undone]
    session.restore_archived(0)
    assert session.messages[-2:] == undone and len(session.messages) == 7
    assert session.archived == []
    assert_ledger_is_the_cache(session)
    held = session.ledger  # the cache is not faked: it holds what it held before
    with pytest.raises(SessionError, match="no archived exchange 0"):
        session.restore_archived(0)
    # the next turn sees it: the same reply as from an empty cache, only the rest evaluated
    done = turn(session, "And a checkpoint?")
    assert done.reply == fresh_reply(demo_model, session.messages[:-2], "And a checkpoint?")
    assert done.stats.reused_tokens == len(held) > 0
    assert done.stats.evaluated_tokens == done.stats.prompt_tokens - len(held)
    # one exchange archived, one restored: a save and a resume keep both lists
    session.undo()
    kept = session.messages
    store.save(session, "restored")
    loaded = store.load("restored", demo_model).session
    assert loaded.messages == kept and loaded.archived == session.archived
    assert [m["content"] for m in loaded.archived if m["role"] == "user"] == ["And a checkpoint?"]
    assert loaded.messages[-2:] == undone
