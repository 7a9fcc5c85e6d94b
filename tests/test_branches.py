"""Branches: edit an earlier message, regenerate any reply, switch branch, delete a pair.

The tree on its own (no model), then the Session's operations on the real demo
model and real caches, then the branches on disk and in the exports.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvchat import store
from kvchat.engine.caches.kinds import cache_offset
from kvchat.engine.conversation.branches import BranchError, Branches, talk
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import GenerationSettings, Session, SessionError, TurnDone
from kvchat.store.base import SESSION_FILE, session_dir

SETTINGS = GenerationSettings(max_tokens=8)
SYSTEM = "You are terse."


def msgs(*texts: str) -> list[dict]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


def finish(events) -> TurnDone:
    done = [e for e in events if isinstance(e, TurnDone)]
    assert len(done) == 1
    return done[0]


def fresh_reply(lm, messages: list[dict]) -> str:
    *history, last = messages
    session = Session(lm, settings=replace(SETTINGS), messages=[dict(m) for m in history])
    return finish(session.send(last["content"])).reply


# ------------------------------------------------------------------ the tree


def test_talk_is_the_messages_without_the_system_prompt(demo_model):
    plain = msgs("a", "A")
    with_system = [{"role": "system", "content": SYSTEM}, *plain]
    assert talk(with_system) == plain and talk(plain) == plain and talk([]) == []
    assert talk(plain) is not plain  # a new list: the caller may change it
    session = Session(demo_model, system=SYSTEM, messages=plain)
    assert session.talk() == plain
    session.set_system("Be brief.")
    assert session.messages == [{"role": "system", "content": "Be brief."}, *plain]


def test_record_adds_a_branch_where_the_messages_part():
    tree = Branches.linear(msgs("a", "A", "b", "B"))
    tree.record(msgs("a", "A", "c", "C"))
    assert [n.message["content"] for n in tree.nodes] == ["a", "A", "b", "B", "c", "C"]
    assert tree.position(2) == (2, 2) and tree.position(1) == (1, 1)
    tree.record(msgs("a", "A", "b", "B"))  # an existing path adds nothing
    assert len(tree.nodes) == 6 and tree.position(2) == (1, 2)


def test_positions_of_every_message_in_one_pass(demo_model):
    tree = Branches.linear(msgs("a", "A", "b", "B1"))
    tree.record(msgs("a", "A", "b", "B2"))
    tree.record(msgs("a", "A", "c", "C"))
    tree.record(msgs("a", "A", "b", "B3", "d"))
    assert tree.positions() == [(1, 1), (1, 1), (1, 2), (3, 3), (1, 1)]
    assert [tree.position(i) for i in range(5)] == tree.positions()
    messages = [{"role": "system", "content": SYSTEM}, *msgs("a", "A", "c", "C")]
    session = Session.restore(demo_model, messages=messages, kind="standard", branches=tree)
    assert session.branch_positions() == [(1, 1)] * 5  # the tree has not caught up
    session.replace_history(session.messages[:1] + tree.messages())
    assert session.branch_positions() == [(1, 1), *tree.positions()]
    assert session.branch_position(4) == (3, 3)


def test_a_new_path_is_recorded_without_searching_the_nodes_it_adds(monkeypatch):
    """A linear tree (every load and new session makes one) takes one pass, not a search
    of the tree per message."""
    searched = []
    real = Branches.children

    def counted(tree, parent):
        searched.append(parent)
        return real(tree, parent)

    monkeypatch.setattr(Branches, "children", counted)
    texts = [f"m{i}" for i in range(40)]
    tree = Branches.linear(msgs(*texts))
    assert searched == [-1] and tree.messages() == msgs(*texts)
    searched.clear()
    tree.record(msgs(*texts[:20], "other", "reply"))  # a fork: found, then new ones added
    assert searched == [tree.path[19]]
    assert tree.positions()[20] == (2, 2) and len(tree.nodes) == 42


def test_switch_goes_down_the_branch_as_it_was_left():
    tree = Branches.linear(msgs("a", "A", "b", "B1"))
    tree.record(msgs("a", "A", "b", "B2"))
    tree.record(msgs("a", "A", "c", "C"))
    assert tree.switch(2, -1)
    assert [m["content"] for m in tree.messages()] == ["a", "A", "b", "B2"]
    assert tree.switch(3, -1)
    assert [m["content"] for m in tree.messages()] == ["a", "A", "b", "B1"]
    assert tree.switch(2, 1)
    assert tree.switch(2, -1)  # back to b: the last seen reply under it, B1
    assert [m["content"] for m in tree.messages()] == ["a", "A", "b", "B1"]
    assert not tree.switch(2, -1) and not tree.switch(0, 1)


def test_remove_pair_moves_what_followed_up():
    tree = Branches.linear(msgs("a", "A", "b", "B", "c", "C"))
    tree.record(msgs("a", "A", "b", "B", "d", "D"))
    tree.record(msgs("a", "A", "b", "B2"))  # another version of B goes with the pair
    tree.switch(3, -1)
    tree.remove_pair(2)
    assert [m["content"] for m in tree.messages()] == ["a", "A", "d", "D"]
    assert [n.message["content"] for n in tree.nodes] == ["a", "A", "c", "C", "d", "D"]
    assert tree.position(2) == (2, 2)


def test_truncate_and_drop_first():
    tree = Branches.linear(msgs("a", "A", "b", "B"))
    tree.record(msgs("a", "A2"))
    tree.record(msgs("a", "A", "c", "C"))
    tree.truncate(2)  # c and C go; b and B, another branch after A, stay
    assert [n.message["content"] for n in tree.nodes] == ["a", "A", "b", "B", "A2"]
    tree.record(msgs("a", "A", "e", "E"))
    tree.drop_first(2)  # a and A were trimmed from the history: A2 goes with them
    assert [n.message["content"] for n in tree.nodes] == ["b", "B", "e", "E"]
    assert tree.nodes[0].parent == -1 and tree.nodes[2].parent == -1 and tree.path == [2, 3]


def test_a_record_round_trips_and_a_bad_one_is_refused():
    tree = Branches.linear(msgs("a", "A"))
    tree.record(msgs("b", "B"))
    again = Branches.from_record(tree.to_record(), msgs("b", "B"))
    assert again.to_record() == tree.to_record()
    record = tree.to_record()
    with pytest.raises(BranchError, match="differs"):
        Branches.from_record(record, msgs("a", "A"))
    record["nodes"][1]["parent"] = 3
    with pytest.raises(BranchError, match="earlier node"):
        Branches.from_record(record, msgs("b", "B"))


# ------------------------------------------------------------------ sessions


def three_turns(lm) -> Session:
    session = Session(lm, system=SYSTEM, settings=replace(SETTINGS))
    for text in ("first question", "second question", "third question"):
        finish(session.send(text))
    return session


def test_edit_trims_to_the_edit_point_and_keeps_the_old_branch(demo_model):
    session = three_turns(demo_model)
    old = list(session.messages)
    ledger = list(session.ledger)
    done = finish(session.edit(3, "second, edited"))
    prompt = session.render([*old[:3], {"role": "user", "content": "second, edited"}], True)
    assert done.stats.reused_tokens == common_prefix(ledger, prompt)
    assert done.stats.evaluated_tokens == len(prompt) - done.stats.reused_tokens
    # only the tokens after the edit point: the first exchange stayed in the cache
    assert done.stats.reused_tokens >= len(session.render(old[:3], False))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])
    assert [m["content"] for m in session.messages[1:4:2]] == ["first question", "second, edited"]
    assert len(session.messages) == 5 and session.branch_position(3) == (2, 2)
    assert len(session.turns) == 2 and session.turns[-1] is done.stats

    switched = session.switch_branch(3, -1)
    assert session.messages == old
    tokens = session.render(old, False)
    assert session.ledger == tokens and cache_offset(session.cache) == len(tokens)
    # the cache was kept as far as the two branches agree, the rest evaluated
    assert switched.reused == common_prefix(
        tokens,
        session.render(
            [*old[:3], {"role": "user", "content": "second, edited"}, done_reply(done)], False
        ),
    )
    assert switched.evaluated == len(tokens) - switched.reused
    assert len(session.turns) == 3
    reply = finish(session.send("fourth question")).reply
    assert reply == fresh_reply(demo_model, session.messages[:-1])


def done_reply(done: TurnDone) -> dict:
    return {"role": "assistant", "content": done.reply}


def test_regenerate_an_earlier_reply_as_a_new_branch(demo_model):
    session = three_turns(demo_model)
    session.settings.temp = 1.0
    old = list(session.messages)
    done = finish(session.regenerate(2))
    assert session.messages[:2] == old[:2] and len(session.messages) == 3
    assert session.messages[2]["content"] == done.reply
    if done.reply != old[2]["content"]:  # an equal reply is the same branch, not a copy
        assert session.branch_position(2) == (2, 2)
        session.switch_branch(2, -1)
        assert session.messages == old
    with pytest.raises(SessionError, match="not a reply"):
        session.regenerate(1)


def test_delete_a_pair_trims_the_cache_exactly(demo_model):
    session = three_turns(demo_model)
    old = list(session.messages)
    ledger = list(session.ledger)
    result = session.delete_pair(3)
    assert session.messages == old[:3] + old[5:]
    tokens = session.render(session.messages, False)
    assert session.ledger == tokens and cache_offset(session.cache) == len(tokens)
    assert result.reused == common_prefix(ledger, tokens)
    assert result.evaluated == len(tokens) - result.reused
    assert len(session.turns) == 2
    reply = finish(session.send("next")).reply
    assert reply == fresh_reply(demo_model, session.messages[:-1])
    with pytest.raises(SessionError, match="not a user message"):
        session.delete_pair(2)


def test_editing_to_nothing_changes_nothing(demo_model):
    session = three_turns(demo_model)
    old = list(session.messages)
    with pytest.raises(SessionError, match="cannot be empty"):
        session.edit(3, "  \n")
    assert session.messages == old


# ------------------------------------------------------------------ on disk


def test_branches_are_saved_loaded_and_exported(demo_model, home):
    session = three_turns(demo_model)
    old = list(session.messages)
    finish(session.edit(5, "third, edited"))
    edited = list(session.messages)
    store.save(session, "tree")
    data = json.loads((session_dir("tree") / SESSION_FILE).read_text())
    assert data["messages"] == edited
    assert [n["content"] for n in data["branches"]["nodes"]][-2:] == [
        "third, edited",
        edited[-1]["content"],
    ]

    loaded = store.load("tree", demo_model)
    assert loaded.resumed_from_disk and loaded.session.messages == edited
    switched = loaded.session.switch_branch(5, -1)
    assert loaded.session.messages == old
    assert switched.reused == common_prefix(
        session.render(edited, False), session.render(old, False)
    )

    exported = json.loads(store.export("tree", "json"))
    assert exported["branches"] == data["branches"]
    assert "2 message(s) on other branches" in store.export("tree", "md")


def test_a_load_builds_the_saved_tree_once(demo_model, home, monkeypatch):
    session = three_turns(demo_model)
    finish(session.edit(3, "second, edited"))
    store.save(session, "once")
    saved = json.loads((session_dir("once") / SESSION_FILE).read_text())["branches"]
    built = []
    real = Branches.from_record.__func__

    def counted(cls, record, messages):
        built.append(len(record["nodes"]))
        return real(cls, record, messages)

    monkeypatch.setattr(Branches, "from_record", classmethod(counted))
    loaded = store.load("once", demo_model).session
    assert built == [len(saved["nodes"])]  # by the schema's check, then handed to the session
    assert loaded.branches.to_record() == saved
    assert loaded.messages == session.messages and loaded.branch_position(3) == (2, 2)


def test_a_session_without_branches_saves_as_before(demo_model, home):
    session = three_turns(demo_model)
    store.save(session, "plain")
    data = json.loads((session_dir("plain") / SESSION_FILE).read_text())
    assert "branches" not in data
    loaded = store.load("plain", demo_model).session
    assert loaded.branch_position(3) == (1, 1)
    assert len(loaded.branches.path_turns()) == 3


def test_a_damaged_branch_record_is_refused_and_left_alone(demo_model, home):
    session = three_turns(demo_model)
    finish(session.edit(3, "other"))
    store.save(session, "bad")
    path = session_dir("bad") / SESSION_FILE
    data = json.loads(path.read_text())
    data["branches"]["path"][0] = len(data["branches"]["nodes"]) - 1
    raw = json.dumps(data).encode()
    path.write_bytes(raw)
    with pytest.raises(store.StoreError, match="damaged.*branches.path") as error:
        store.load("bad", demo_model)
    assert "\n" not in str(error.value)
    assert path.read_bytes() == raw


def test_messages_set_from_outside_are_saved_as_a_branch_without_changing_the_tree(demo_model):
    session = three_turns(demo_model)
    old = list(session.messages)
    session.replace_history([*old[:3], {"role": "user", "content": "set by a server"}])
    before = session.branches.to_record()
    record = session.branch_record()
    assert session.branches.to_record() == before  # a read changes nothing
    assert record["nodes"][-1]["content"] == "set by a server" and len(record["path"]) == 3
    assert session.branch_position(3) == (1, 1)  # the tree catches up at the next turn
    finish(session.send("and then"))
    assert session.branch_position(3) == (2, 2)


def test_undo_and_trim_keep_the_tree_in_step(demo_model):
    session = three_turns(demo_model)
    finish(session.edit(5, "third, edited"))
    session.undo()  # the edited exchange goes, with its versions; the original stays
    assert [m["content"] for m in session.talk()][::2] == ["first question", "second question"]
    assert session.branches.holds(session.talk())
    assert [n.message["content"] for n in session.branches.nodes][4] == "third question"
    finish(session.send("a new third"))
    assert session.branch_position(5) == (2, 2)  # the original is the other version
    dropped = session.trim_history(len(session.render(session.messages, False)) - 1)
    assert dropped == 2 and session.branches.holds(session.talk())
    assert session.branch_position(3) == (2, 2)  # forked after the trimmed turn: kept
    assert session.ledger == session.render(session.messages, False)
    switched = session.switch_branch(3, -1)
    assert session.talk()[2]["content"] == "third question" and switched.evaluated > 0
