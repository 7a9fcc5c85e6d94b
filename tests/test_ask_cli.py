"""`kvchat ask` and `kvchat sessions` in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def kvchat(*args, input=None, env=None):
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        input=input,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def inproc(*args):
    """The same command in this process (fast; for cases that need no second process)."""
    result = CliRunner().invoke(app, list(args))
    result.returncode = result.exit_code
    return result


def ask(*args, run=kvchat, **kw):
    out = run("ask", "--max-tokens", "8", "--json", *args, **kw)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def quick_ask(*args):
    return ask(*args, run=inproc)


def test_ask_twice_resumes_from_disk(demo_model, home):
    first = ask("--session", "x", "--system", "Be brief.", "Hello there.")
    second = ask("--session", "x", "What is a cache?")
    assert first["resumed_from_disk"] is False and second["resumed_from_disk"] is True
    assert first["notice"] is None and second["notice"] is None

    reference = Session(demo_model, system="Be brief.", settings=GenerationSettings(max_tokens=8))
    for text, got in (("Hello there.", first), ("What is a cache?", second)):
        done = [e for e in reference.send(text) if isinstance(e, TurnDone)][0]
        assert got["reply"] == done.reply
        assert got["evaluated_tokens"] == done.stats.evaluated_tokens
        assert got["reused_tokens"] == done.stats.reused_tokens
    assert second["reused_tokens"] > 0
    assert store.load("x", demo_model).session.messages == reference.messages


def test_ask_generation_flags_win_over_a_resumed_sessions_saved_ones(home):
    ask("--session", "s", "Hello there.", run=inproc)  # saved with --max-tokens 8
    out = kvchat("ask", "--session", "s", "--max-tokens", "2", "--temp", "0.5", "--json", "Go on.")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_tokens"] == 2
    assert store.read("s")["settings"]["max_tokens"] == 2
    assert store.read("s")["settings"]["temp"] == 0.5


def test_ask_plain_text_and_stdin(home):
    out = kvchat("ask", "--max-tokens", "6", "-", input="Hello from stdin.\n")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.endswith("\n")
    assert store.list_sessions() == []  # no --session: nothing saved


def test_ask_cache_kind_and_json_fields(home):
    got = quick_ask("--session", "q", "--cache", "quantized:8", "Hi.")
    assert got["cache_kind"] == "quantized:8" and got["session"] == "q"
    again = quick_ask("--session", "q", "Again.")
    assert again["cache_kind"] == "quantized:8" and again["resumed_from_disk"]


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["ask", "   "], 2, "empty"),
        (["ask", "--cache", "bogus", "hi"], 2, "Unknown cache kind"),
        (["ask", "--session", "../evil", "hi"], 2, "Invalid session name"),
        (["ask", "--model", "/no/such/model", "hi"], 2, "/no/such/model"),
        (["sessions", "show", "missing"], 1, "No saved session"),
        (["sessions", "rm", "missing"], 1, "No saved session"),
        (["sessions", "export", "missing"], 1, "No saved session"),
        (["sessions", "prune", "--older-than", "soon"], 2, "Invalid duration"),
    ],
)
def test_errors_are_one_line(home, args, code, words):
    out = inproc(*args)
    assert out.returncode == code
    assert words in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_damaged_session_json_fails_clearly(home):
    quick_ask("--session", "d", "Hi.")
    path = store.session_dir("d") / "session.json"
    path.write_text("{oops")
    out = kvchat("ask", "--session", "d", "Hi again.")
    assert out.returncode == 1 and str(path) in out.stderr and "Traceback" not in out.stderr
    assert path.read_text() == "{oops"


def test_damaged_cache_gives_a_notice(home):
    quick_ask("--session", "n", "Hi.")
    (store.session_dir("n") / "cache.safetensors").write_bytes(b"garbage")
    got = quick_ask("--session", "n", "Hi again.")
    assert "rebuilt from the transcript" in got["notice"] and not got["resumed_from_disk"]
    # the tokens the load recomputed count as this turn's evaluated ones, not as reused
    assert got["rebuilt"] is None and got["reused_tokens"] == 0 and got["reply"]
    assert got["evaluated_tokens"] == got["prompt_tokens"]


def test_locked_session_waits_or_fails_clearly(home):
    quick_ask("--session", "l", "Hi.")
    with store.session_lock("l"):
        out = kvchat("ask", "--session", "l", "Blocked?", env={"KVCHAT_LOCK_TIMEOUT": "0.5"})
    assert out.returncode == 1 and "in use by another kvchat" in out.stderr
    assert "Traceback" not in out.stderr

    # two at once: the second waits for the first, and both turns are kept
    procs = [
        subprocess.Popen(
            [*CLI, "ask", "--session", "l", "--max-tokens", "8", "--json", text],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for text in ("One.", "Two.")
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(r["resumed_from_disk"] for r in results)
    users = [m["content"] for m in store.read("l")["messages"] if m["role"] == "user"]
    assert users[0] == "Hi." and sorted(users[1:]) == ["One.", "Two."]


def test_sessions_commands(home):
    quick_ask("--session", "s1", "Hi.")
    quick_ask("--session", "s2", "Hello.")
    listed = json.loads(inproc("sessions", "list", "--json").stdout)
    assert [s["name"] for s in listed] == ["s2", "s1"]
    assert listed[0]["turns"] == 1 and listed[0]["model_id"] == "demo"
    table = inproc("sessions", "list").stdout
    assert "s1" in table and "NAME" in table
    shown = json.loads(inproc("sessions", "show", "s1", "--json").stdout)
    assert shown["name"] == "s1" and shown["last_turn"]["generated_tokens"] > 0
    md = inproc("sessions", "export", "s1").stdout
    assert md.startswith("# s1") and "Hi." in md
    data = json.loads(inproc("sessions", "export", "s1", "--format", "json").stdout)
    assert data["messages"][0] == {"role": "user", "content": "Hi."}
    out = inproc("sessions", "prune", "--older-than", "30d")
    assert out.returncode == 0 and "Removed 0" in out.stdout
    assert inproc("sessions", "rm", "s1").returncode == 0
    assert [s.name for s in store.list_sessions()] == ["s2"]


def test_every_generation_setting_is_a_flag_checked_and_saved(home):
    from kvchat.settings import FLAGS

    shown = " ".join(inproc("ask", "--help").stdout.split())
    assert all(s.option in shown for s in FLAGS)  # --top-k, --min-p, --seed, ...
    greedy = quick_ask("--temp", "0", "Tell me about the cache.")["reply"]
    assert quick_ask("--temp", "1.5", "--top-k", "1", "Tell me about the cache.")["reply"] == greedy
    ask(
        "--session",
        "p",
        "--top-k",
        "5",
        "--repetition-penalty",
        "1.2",
        "--seed",
        "9",
        "Hi.",
        run=inproc,
    )
    saved = store.read("p")["settings"]
    assert (saved["top_k"], saved["repetition_penalty"], saved["seed"]) == (5, 1.2, 9)
    ask("--session", "p", "--min-p", "0.1", "Go on.", run=inproc)  # the others stay saved
    saved = store.read("p")["settings"]
    assert (saved["top_k"], saved["seed"], saved["min_p"]) == (5, 9, 0.1)
    out = inproc("ask", "--top-k", "-1", "Hi.")
    assert out.returncode == 2 and "--top-k = -1: must be at least 0." in out.stderr


def test_a_demo_built_on_first_use_says_the_disk_it_takes_and_how_far_it_is(
    home, tmp_path, monkeypatch
):
    """The first ask on a demo not built yet says so, with the bytes its weights take
    before the first layer is written, then the build's and the load's last counts (stderr
    is not a terminal: no count in place; mlx-lm's quantizer adds its own line); the next
    ask says nothing."""
    from kvchat.engine.models.demo import demo_path

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    first = inproc("ask", "--model", "demo@q4", "--max-tokens", "2", "Hello.")
    assert first.returncode == 0, first.output
    lines = [line for line in first.stderr.splitlines() if line.startswith("kvchat: ")]
    size = lines[1].rpartition(" of ")[2]
    assert lines == [
        f"kvchat: building demo@q4 on its first use, into {demo_path('demo@q4')}",
        f"kvchat: demo@q4: 0 of 2 layers written, 0 B of {size}",
        f"kvchat: demo@q4: 2 of 2 layers written, {size} of {size}",
        "kvchat: demo@q4: 2 of 2 layers read",
    ]
    assert size.endswith(" KiB") and float(size.split()[0]) > 0
    again = inproc("ask", "--model", "demo@q4", "--max-tokens", "2", "Hello.")
    assert again.returncode == 0 and again.stderr == ""
