"""Sessions on disk: round trips for every cache kind, crashes mid-save, damaged files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest
from helpers import kill_when_stopped, stopped_before_rename, turn
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session

SETTINGS = GenerationSettings(max_tokens=10)
SYSTEM = "You are terse."
FIRST = ["Hello there.", "What is a cache?"]
NEXT = "And why is it fast?"
KINDS = ["standard", "quantized:8", "quantized:4", "rotating:256", "chunked:256", "concatenate"]


def conversation(lm, kind: str = "standard", texts=FIRST) -> Session:
    session = Session(lm, kind=kind, system=SYSTEM, settings=GenerationSettings(max_tokens=10))
    for text in texts:
        turn(session, text)
    return session


def folder(name: str):
    return store.session_dir(name)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_every_kind(demo_model, home, kind):
    session = conversation(demo_model, kind)
    reference = conversation(demo_model, kind)
    path = store.save(session, "chat")

    loaded = store.load("chat", demo_model)
    assert loaded.resumed_from_disk and loaded.notice is None
    resumed = loaded.session
    assert resumed.messages == session.messages
    assert resumed.ledger == session.ledger
    assert resumed.kind.name == kind
    assert [t.to_dict() for t in resumed.turns] == [t.to_dict() for t in session.turns]

    got, want = turn(resumed, NEXT), turn(reference, NEXT)
    assert got.reply == want.reply
    assert got.stats.evaluated_tokens == want.stats.evaluated_tokens
    assert got.stats.reused_tokens == want.stats.reused_tokens > 0
    assert got.stats.rebuilt is None

    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in ("session.json", "cache.safetensors"):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o600
    assert not [p for p in path.iterdir() if p.name.startswith(store.TMP_PREFIX)]


RESUME_SCRIPT = """
import json, sys
from kvchat import store
from kvchat.engine.models.model import load_model
from kvchat.engine.conversation.session import TurnDone
loaded = store.load("chat", load_model("demo"))
done = [e for e in loaded.session.send(sys.argv[1]) if isinstance(e, TurnDone)][0]
store.save(loaded.session, "chat")
print(json.dumps({"reply": done.reply, "resumed": loaded.resumed_from_disk,
                  "notice": loaded.notice, **done.stats.to_dict()}))
"""


def test_resume_in_a_new_process(demo_model, home):
    store.save(conversation(demo_model), "chat")
    reference = conversation(demo_model)
    want = turn(reference, NEXT)

    out = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, NEXT], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    assert got["resumed"] is True and got["notice"] is None
    assert got["reply"] == want.reply
    assert got["evaluated_tokens"] == want.stats.evaluated_tokens
    assert got["reused_tokens"] == want.stats.reused_tokens > 0
    assert store.load("chat", demo_model).session.messages == reference.messages


@pytest.mark.parametrize("stage", ["cache", "json"])
def test_killed_mid_save_keeps_the_previous_save(demo_model, home, stage):
    """A save killed before the cache rename, or between the two renames, loses nothing."""
    store.save(conversation(demo_model), "chat")
    before = (folder("chat") / "session.json").read_bytes()
    target = {"cache": "cache.safetensors", "json": "session.json"}[stage]
    proc = subprocess.Popen(
        [sys.executable, "-c", stopped_before_rename(RESUME_SCRIPT, target), NEXT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert kill_when_stopped(proc, target)
    assert (folder("chat") / "session.json").read_bytes() == before

    loaded = store.load("chat", demo_model)
    reference = conversation(demo_model)
    assert loaded.session.messages == reference.messages
    # Between the renames the new cache extends the old ledger: it is trimmed back, not rebuilt.
    assert loaded.resumed_from_disk and loaded.notice is None
    assert turn(loaded.session, NEXT).reply == turn(reference, NEXT).reply
    store.save(loaded.session, "chat")  # and the folder is usable again
    assert not [p for p in folder("chat").iterdir() if p.name.startswith(store.TMP_PREFIX)]


def _rewrite_cache_metadata(path, **changes):
    cache, meta = load_prompt_cache(str(path), return_metadata=True)
    save_prompt_cache(str(path), cache, {**meta, **changes})


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


DAMAGE = {
    "missing": lambda d: (d / "cache.safetensors").unlink(),
    "truncated": lambda d: os.truncate(
        d / "cache.safetensors", (d / "cache.safetensors").stat().st_size // 2
    ),
    "garbage": lambda d: (d / "cache.safetensors").write_bytes(os.urandom(5000)),
    "flipped-bytes": lambda d: _flip(d / "cache.safetensors"),
    "other-model": lambda d: _edit_json(d / "session.json", model_fingerprint="0123456789abcdef"),
    "other-model-cache": lambda d: _rewrite_cache_metadata(
        d / "cache.safetensors", model_fingerprint="0123456789abcdef"
    ),
    "other-version": lambda d: _rewrite_cache_metadata(
        d / "cache.safetensors", kvchat_version="0.0.1"
    ),
    "ledger-differs": lambda d: _edit_json(
        d / "session.json",
        ledger=[t + 1 for t in json.loads((d / "session.json").read_text())["ledger"]],
    ),
    "other-kind": lambda d: _rewrite_cache_metadata(
        d / "cache.safetensors", cache_kind="concatenate"
    ),
}


def _flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 4000, len(data), 97):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cache_rebuilds_from_the_transcript(demo_model, home, damage):
    session = conversation(demo_model)
    store.save(session, "chat")
    DAMAGE[damage](folder("chat"))
    files = {p.name: p.read_bytes() for p in folder("chat").iterdir() if p.is_file()}

    progress = []
    loaded = store.load("chat", demo_model, progress=lambda done, total: progress.append(done))
    assert not loaded.resumed_from_disk
    assert loaded.notice and loaded.notice.startswith("The saved cache was not used (")
    assert "\n" not in loaded.notice
    assert progress and progress[-1] == len(loaded.session.ledger)
    assert loaded.session.messages == session.messages
    # nothing on disk was touched by the load
    assert {p.name: p.read_bytes() for p in folder("chat").iterdir() if p.is_file()} == files

    reference = conversation(demo_model)
    got, want = turn(loaded.session, NEXT), turn(reference, NEXT)
    assert got.reply == want.reply
    # the rebuilt cache serves the next turn, which counts what the load recomputed
    assert got.stats.reused_tokens == 0 and got.stats.evaluated_tokens == got.stats.prompt_tokens
    assert turn(loaded.session, NEXT).stats.reused_tokens > 0  # and the turn after reuses


@pytest.mark.parametrize("extra", [[1, 2, 3], None])
def test_ledger_sharing_a_prefix_with_the_cache_keeps_that_prefix(demo_model, home, extra):
    """A ledger that differs from the cache's only after a prefix keeps the prefix, exactly."""
    store.save(conversation(demo_model), "chat")
    path = folder("chat") / "session.json"
    ledger = json.loads(path.read_text())["ledger"]
    _edit_json(path, ledger=ledger + extra if extra else ledger[:-5])
    loaded = store.load("chat", demo_model)
    assert loaded.resumed_from_disk and loaded.notice is None
    kept = len(ledger) if extra else len(ledger) - 5
    assert loaded.session.ledger == ledger[:kept] and loaded.session.cache_tokens == kept
    reference = conversation(demo_model)
    assert turn(loaded.session, NEXT).reply == turn(reference, NEXT).reply


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[1, 2]", b'{"messages": "hello"}', b"\xff\xfe\x00garbage"],
)
def test_damaged_session_json_is_an_error_naming_the_file(demo_model, home, content):
    store.save(conversation(demo_model), "chat")
    path = folder("chat") / "session.json"
    path.write_bytes(content)
    with pytest.raises(store.StoreError) as err:
        store.load("chat", demo_model)
    assert str(path) in str(err.value)
    assert path.read_bytes() == content
    assert (folder("chat") / "cache.safetensors").exists()
    [summary] = store.list_sessions()
    assert summary.name == "chat" and summary.note and str(path) in summary.note


@pytest.mark.parametrize("name", ["", "..", ".hidden", "a/b", "../escape", "x" * 101, "a b", "é"])
def test_bad_names_are_refused(home, name):
    with pytest.raises(store.StoreError, match="Invalid session name"):
        store.session_dir(name)


def test_list_export_delete_prune(demo_model, home):
    session = conversation(demo_model)
    store.save(session, "old")
    store.save(session, "new")
    _edit_json(folder("old") / "session.json", updated="2000-01-01T00:00:00+00:00")
    names = [s.name for s in store.list_sessions()]
    assert names == ["new", "old"]
    summary = store.list_sessions()[0]
    assert summary.turns == 2 and summary.cache_tokens == len(session.ledger)
    assert summary.size_bytes > 0 and summary.model_id == "demo" and summary.note is None

    md = store.export("new", "md")
    assert md.startswith("# new") and FIRST[1] in md and "## Assistant" in md
    data = json.loads(store.export("new", "json"))
    assert data["messages"] == session.messages
    with pytest.raises(store.StoreError):
        store.export("new", "html")

    assert store.prune(3600) == store.Pruned(removed=["old"], skipped=[])
    assert not store.exists("old") and store.exists("new")
    store.delete("new")
    assert not store.exists("new") and store.list_sessions() == []
    with pytest.raises(store.StoreError, match="No saved session"):
        store.delete("new")
    with pytest.raises(store.StoreError, match="No saved session"):
        store.load("new", demo_model)


def test_parse_duration():
    assert store.parse_duration("30d") == 30 * 86400
    assert store.parse_duration("12h") == 12 * 3600
    assert store.parse_duration("90m") == 90 * 60
    with pytest.raises(store.StoreError):
        store.parse_duration("soon")


def test_lock_waits_then_fails_clearly(home):
    entered = threading.Event()
    release = threading.Event()

    def hold():
        with store.session_lock("chat"):
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(5)
    try:
        with pytest.raises(store.StoreError, match="in use by another kvchat"):
            with store.session_lock("chat", timeout=0.2):
                pass
    finally:
        release.set()
        holder.join()
    with store.session_lock("chat", timeout=0.2):
        with store.session_lock("chat"):  # re-entrant in one thread
            pass


def test_empty_session_round_trips(demo_model, home):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    store.save(session, "empty")
    loaded = store.load("empty", demo_model)
    assert loaded.notice is None and loaded.session.messages == session.messages
    assert not (folder("empty") / "cache.safetensors").exists()
    assert turn(loaded.session, NEXT).reply == turn(session, NEXT).reply
