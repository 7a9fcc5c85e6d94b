"""Search across saved sessions: the SQLite FTS5 index follows saves and removals, is
rebuilt when damaged, never reads the user's text as FTS5 syntax, survives a locked
database during a save, and `kvchat sessions search` prints matches escaped."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import stat
import subprocess
import sys

import pytest
from helpers import turn

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.store import search_index as index
from kvchat.store.base import StoreError

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def _saved(lm, name: str, text: str) -> Session:
    session = Session(lm, settings=GenerationSettings(max_tokens=4))
    turn(session, text)
    store.save(session, name)
    return session


@pytest.fixture
def two(demo_model, home):
    _saved(demo_model, "zoo", "tell me about zebras and their stripes, and quokkas")
    _saved(demo_model, "farm", "the aardvark eats ants with the quokkas")


def test_search_finds_the_right_session_role_and_word(two):
    found = store.search_sessions("zebras")
    assert [(h.name, h.role, h.index) for h in found.hits] == [("zoo", "user", 0)]
    assert "[zebras]" in found.hits[0].snippet and found.notes == []
    assert found.hits[0].last_used == store.read("zoo")["updated"]
    hits = store.search_sessions("AARDVARK ant").hits  # case folded, every word, prefixes
    assert [(h.name, h.role) for h in hits] == [("farm", "user")]
    assert "[aardvark]" in hits[0].snippet and "[ants]" in hits[0].snippet
    assert store.search_sessions("zebras aardvark").hits == []  # every word, one message
    assert store.matching_sessions("zeb") == {"zoo"}
    assert store.matching_sessions("the") == store.matching_sessions("quok") == {"zoo", "farm"}


def test_a_later_save_replaces_the_rows_and_removal_drops_them(two, demo_model):
    session = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    turn(session, "now only about giraffes")
    store.save(session, "zoo")
    assert store.search_sessions("zebras").hits == []
    assert [h.name for h in store.search_sessions("giraffes").hits] == ["zoo"]
    store.delete("farm")
    assert store.search_sessions("aardvark").hits == []
    # "quokkas" was in the zebras and aardvark messages only (the demo never says it)
    assert store.matching_sessions("quok") == set()
    assert store.prune(0).removed == ["zoo"]
    assert store.matching_sessions("giraffes") == set()


def test_newest_session_first_and_limit(two, demo_model):
    _saved(demo_model, "newer", "zebras again")
    hits = store.search_sessions("zebras").hits
    assert [h.name for h in hits] == ["newer", "zoo"]
    assert [h.name for h in store.search_sessions("zebras", limit=1).hits] == ["newer"]


@pytest.mark.parametrize("damage", ["garbage", "old-schema", "missing", "symlink"])
def test_a_damaged_or_missing_index_is_rebuilt_with_one_notice(two, tmp_path, damage):
    path = index.index_path()
    if damage == "garbage":
        path.write_bytes(b"not a database at all" * 100)
    elif damage == "old-schema":
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA user_version = 0")
    elif damage == "missing":
        path.unlink()
    else:
        (tmp_path / "elsewhere").write_bytes(b"x")
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
    found = store.search_sessions("zebras")
    assert [h.name for h in found.hits] == ["zoo"]
    rebuilt = [n for n in found.notes if "rebuilt" in n]
    assert len(rebuilt) == (0 if damage == "missing" else 1)
    if damage == "symlink":  # replaced, never followed
        assert (tmp_path / "elsewhere").read_bytes() == b"x"
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert store.search_sessions("zebras").notes == []  # one notice, not one per search
    assert [h.name for h in store.search_sessions("aardvark").hits] == ["farm"]


def test_reindex_rebuilds_the_same_rows_from_disk(two):
    before = store.search_sessions("the").hits
    assert store.reindex() == []
    assert store.search_sessions("the").hits == before


def test_a_damaged_or_foreign_session_is_skipped_with_a_note(two, tmp_path):
    broken = store.session_dir("broken")
    broken.mkdir()
    (broken / "session.json").write_text(json.dumps({"messages": "zebras"}))
    (tmp_path / "other").mkdir()
    store.session_dir("linked").symlink_to(tmp_path / "other")
    found = store.search_sessions("zebras")
    assert [h.name for h in found.hits] == ["zoo"]
    assert any("broken" in n and "not searched" in n for n in found.notes), found.notes
    assert any("linked" in n and "not a session folder" in n for n in found.notes), found.notes


QUERIES = [
    '"',
    "*",
    "OR",
    "(",
    ")",
    "NEAR",
    "NEAR(zebras stripes)",
    "zebras OR ants",
    '"zebras',
    "zebras*",
    "-zebras",
    "text:zebras",
    "^zebras",
    "zebras AND",
    "NOT",
    "{text}",
    "'",
    '"" ""',
    'zeb"ras',
    "\\",
    "%",
    "_",
    "zebras\x00",
    "zebras\x1b[31m",
]


@pytest.mark.parametrize("query", QUERIES)
def test_fts5_syntax_in_the_query_is_searched_for_never_raised(two, query):
    hits = store.search_sessions(query).hits
    store.matching_sessions(query)
    words = "".join(c if c.isalnum() else " " for c in query).split()
    if words and all(w.lower() in ("zebras", "text", "ras", "zeb") for w in words):
        assert {h.name for h in hits} <= {"zoo"}
    if query in ('"zebras', "zebras*", "-zebras", "^zebras", "zebras\x00"):
        assert [h.name for h in hits] == ["zoo"], query


def test_random_fts5_syntax_never_raises(two):
    rng = random.Random(7)
    alphabet = [
        '"',
        "*",
        "(",
        ")",
        ":",
        "^",
        "-",
        "+",
        "OR",
        "AND",
        "NOT",
        "NEAR",
        " ",
        "zeb",
        "ras",
        ",",
        "{",
        "}",
        "'",
        "\\",
    ]
    for _ in range(200):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        if query.strip():
            store.search_sessions(query)
            store.matching_sessions(query)


@pytest.mark.parametrize("query", ["", "   ", "\t\n", "\x00"])
def test_an_empty_query_is_one_sentence(home, query):
    with pytest.raises(StoreError, match=r"^Nothing to search for; give a word or a phrase\.$"):
        store.search_sessions(query)
    assert store.matching_sessions(query) == set()


def test_a_locked_index_does_not_break_a_save_and_catches_up(two, demo_model, monkeypatch):
    monkeypatch.setattr(index, "BUSY_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(index.index_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        _saved(demo_model, "late", "a question about okapis")
        with pytest.raises(
            StoreError, match=r"search index .* cannot be used \(database is locked\)"
        ):
            store.search_sessions("zebras")  # a lock is no damage: nothing is rebuilt
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert store.read("late")["messages"][0]["content"] == "a question about okapis"
    assert store.matching_sessions("okapis") == set()  # the save's update was refused
    assert store.matching_sessions("zebras") == {"zoo"}  # the index was not replaced
    assert [h.name for h in store.search_sessions("okapis").hits] == ["late"]  # caught up


def test_without_fts5_a_like_scan_of_the_same_table(two, monkeypatch):
    monkeypatch.setattr(index, "HAS_FTS5", False)
    store.reindex()
    hits = store.search_sessions("ZEBRAS stripes").hits
    assert [(h.name, h.role) for h in hits] == [("zoo", "user")]
    assert "[zebras]" in hits[0].snippet
    assert store.search_sessions("%").hits == [] and store.search_sessions("_").hits == []
    assert store.matching_sessions("aard") == {"farm"}


def test_cli_search_prints_the_match_escaped(demo_model, home):
    session = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    turn(session, "zebras \x1b]0;pwned\x07 \x1b[2J here")
    store.save(session, "evil")
    run = subprocess.run(
        [*CLI, "sessions", "search", "zebras"],
        capture_output=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout.decode()
    assert out.startswith("evil #0 user (") and "[zebras]" in out
    assert "\\x1b]0;pwned\\x07" in out and "\\x1b[2J" in out and "\x1b" not in out
    as_json = subprocess.run(
        [*CLI, "sessions", "search", "zebras", "--json", "--limit", "1"],
        capture_output=True,
        timeout=120,
        env=os.environ.copy(),
    )
    hits = json.loads(as_json.stdout)
    assert [(h["name"], h["role"], h["index"]) for h in hits] == [("evil", "user", 0)]
    assert "\x1b]0;pwned\x07" in hits[0]["snippet"]
    empty = subprocess.run(
        [*CLI, "sessions", "search", " "], capture_output=True, timeout=120, env=os.environ.copy()
    )
    assert empty.returncode == 1
    assert b"Nothing to search for; give a word or a phrase." in empty.stderr
