"""Sessions with more than one writer: every save states the generation it builds on,
a save over someone else's is refused, and each writer keeps both sides (real
processes where two are involved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ask_from_shell, turn
from serve_helpers import Server, chat

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from tests.helpers import wait_until

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def kvchat_ask(*args: str) -> subprocess.Popen:
    """A real ``kvchat ask`` process (it inherits this test's KVCHAT_HOME)."""
    return subprocess.Popen(
        [*CLI, "ask", "--max-tokens", "6", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def finished(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out), err


def holds(name: str, text: str, reply: str) -> bool:
    """Whether ``text`` and then ``reply`` are saved in ``name``, the reply as the
    message's child (on the current path or on a branch)."""
    data = store.read(name)
    branches = data.get("branches")
    if branches is None:
        pairs = list(zip(data["messages"], data["messages"][1:]))
        return any((a["content"], b["content"]) == (text, reply) for a, b in pairs)
    nodes = branches["nodes"]
    return any(
        n["content"] == reply
        and n["role"] == "assistant"
        and n["parent"] >= 0
        and nodes[n["parent"]]["content"] == text
        for n in nodes
    )


def started(lm, text: str = "First.") -> Session:
    session = Session(lm, system="Be brief.", settings=GenerationSettings(max_tokens=6))
    turn(session, text)
    return session


def test_a_checked_save_moves_its_generation_forward(demo_model, home):
    mine = store.Generation()
    session = started(demo_model)
    store.save(session, "g", base=mine)
    assert mine.number == 1 and store.read("g")["generation"] == 1
    turn(session, "Second.")
    store.save(session, "g", base=mine)  # its own last save: no conflict
    assert mine.number == 2 and store.read("g")["generation"] == 2
    assert store.load("g", demo_model).generation == mine


def test_a_new_session_does_not_take_a_name_saved_meanwhile(demo_model, home):
    store.save(started(demo_model, "Theirs."), "taken")
    with pytest.raises(store.SessionChanged) as refused:
        store.save(started(demo_model, "Mine."), "taken", base=store.Generation())
    assert refused.value.data["messages"][1]["content"] == "Theirs."
    assert "saved by another kvchat" in str(refused.value)


def test_an_old_session_file_without_a_generation_loads_as_generation_0(demo_model, home):
    session = started(demo_model)
    store.save(session, "old")
    path = store.session_dir("old") / "session.json"
    data = json.loads(path.read_text())
    del data["generation"]  # as kvchat wrote it before generations
    path.write_text(json.dumps(data))
    loaded = store.load("old", demo_model)
    assert loaded.generation.number == 0 and loaded.resumed_from_disk
    assert loaded.session.messages == session.messages
    turn(loaded.session, "Next.")
    store.save(loaded.session, "old", base=loaded.generation)
    assert store.read("old")["generation"] == 1


@pytest.mark.parametrize("forged", ["7", -1, 2.5, None, [1]])
def test_a_forged_generation_is_refused_in_one_sentence(demo_model, home, forged):
    store.save(started(demo_model), "forged")
    path = store.session_dir("forged") / "session.json"
    data = json.loads(path.read_text())
    data["generation"] = forged
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    with pytest.raises(store.StoreError) as refused:
        store.load("forged", demo_model)
    message = str(refused.value)
    assert "generation" in message and str(path) in message and "left as it is" in message
    assert len(message.splitlines()) == 1
    with pytest.raises(store.StoreError):  # a checked save does not write over it either
        store.save(started(demo_model), "forged", base=store.Generation(1, "0" * 64))
    assert path.read_bytes() == before


def test_two_stores_racing_saves_of_one_session_lose_neither(demo_model, home):
    store.save(started(demo_model), "k1")
    a, b = store.load("k1", demo_model), store.load("k1", demo_model)
    reply_a = turn(a.session, "From A.").reply
    reply_b = turn(b.session, "From B.").reply
    store.save(a.session, "k1", base=a.generation)
    on_disk = (store.session_dir("k1") / "session.json").read_bytes()
    with pytest.raises(store.SessionChanged) as refused:
        store.save(b.session, "k1", base=b.generation)
    assert (store.session_dir("k1") / "session.json").read_bytes() == on_disk  # not written
    assert refused.value.generation.number == a.generation.number == 2
    assert refused.value.data["messages"][-2]["content"] == "From A."

    store.save_as_branch(b.session, "k1")
    data = store.read("k1")
    assert [m["content"] for m in data["messages"][-2:]] == ["From A.", reply_a]  # main line
    assert holds("k1", "From A.", reply_a) and holds("k1", "From B.", reply_b)
    assert data["generation"] == 3
    # the main line's cache still resumes; the other branch is there to switch to
    again = store.load("k1", demo_model)
    assert again.resumed_from_disk and again.notice is None
    assert again.session.branch_positions()[-2] == (1, 2)  # "From A." of two versions
    assert again.session.branches.nodes[-1].turn is not None  # B's reply keeps its stats


HELD_BEFORE_SAVE = """
import sys
import kvchat.runtime.sessions as sessions
from kvchat.cli import main
real = sessions.save_session
def held(*args, **kwargs):
    print("about-to-save", file=sys.stderr, flush=True)
    sys.stdin.readline()
    return real(*args, **kwargs)
sessions.save_session = held
sys.argv = ["kvchat", *sys.argv[1:]]
main()
"""


def waits_on_lock(pid: int, name: str) -> bool:
    """Whether process ``pid`` has session ``name``'s lock file open (it waits for it)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(f"/.locks/{name}.lock"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_ask_and_an_ask_racing_keep_both(demo_model, home):
    """Ask A has loaded and answered and is about to save (this test holds it there,
    from A's own process) when ask B starts: B waits for A's save and continues from it,
    so both exchanges are on the main line, A's first."""
    store.save(started(demo_model), "k2")
    held = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HELD_BEFORE_SAVE,
            "ask",
            "--session",
            "k2",
            "--max-tokens",
            "6",
            "--json",
            "Ask A.",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert held.stderr.readline() == "about-to-save\n"
    second = kvchat_ask("--session", "k2", "Ask B.")
    wait_until(
        lambda: waits_on_lock(second.pid, "k2"),
        60,
        0.02,
        alive=lambda: second.poll() is None,
        message="B never waited",
    )
    held.stdin.write("go\n")
    held.stdin.flush()
    (a, _), (b, _) = finished(held), finished(second)
    assert a["saved"] and b["saved"] and b["resumed_from_disk"]
    assert [m["content"] for m in store.read("k2")["messages"]][-4:] == [
        "Ask A.",
        a["reply"],
        "Ask B.",
        b["reply"],
    ]


def test_serve_and_ask_on_one_session_keep_both(demo_model, home):
    ask_from_shell("notes", "Hello from the shell.")
    with Server(demo_model) as server:
        first, _, _ = chat(
            server.client,
            [{"role": "user", "content": "Hello from HTTP."}],
            max_tokens=6,
            extra_headers={"X-Session-Id": "notes"},
        )
        shell, _ = finished(kvchat_ask("--session", "notes", "From the shell again."))
        second, body, _ = chat(
            server.client,
            [{"role": "user", "content": "HTTP again."}],
            max_tokens=6,
            extra_headers={"X-Session-Id": "notes"},
        )
        assert "kept as a branch" in body["kvchat"]["notice"]
    assert holds("notes", "Hello from HTTP.", first)
    assert holds("notes", "From the shell again.", shell["reply"])
    assert holds("notes", "HTTP again.", second)
    # the main line is the shell's, which was saved first
    assert store.read("notes")["messages"][-2]["content"] == "From the shell again."


def test_a_lease_names_the_other_live_process_and_stale_ones_are_ignored(home):
    store.session_dir("open").parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from kvchat import store; store.hold_open('open');"
            " print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert store.open_elsewhere("open") == [holder.pid]
        store.hold_open("open")  # this process's own lease is not "elsewhere"
        assert store.open_elsewhere("open") == [holder.pid]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert store.open_elsewhere("open") == []  # it is gone: its lease is stale
    assert [p.name for p in (home / "sessions" / ".locks").glob("open.*.open")] == [
        f"open.{os.getpid()}.open"
    ]
    store.let_go("open")
    assert not list((home / "sessions" / ".locks").glob("open.*.open"))
