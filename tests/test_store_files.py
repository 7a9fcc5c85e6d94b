"""Session folders and files that are not what they seem: symlinks, FIFOs, devices,
folders, huge files; a bad lock timeout; parents of KVCHAT_HOME. Nothing outside
the sessions folder may change, nothing may hang, every refusal is one sentence."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvchat import locations, store
from kvchat.cli import app
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]


def saved(lm, name: str, text: str = "Hello there.") -> Session:
    session = Session(lm, system="Be brief.", settings=GenerationSettings(max_tokens=6))
    [e for e in session.send(text) if isinstance(e, TurnDone)]
    store.save(session, name)
    return session


def cli(*args, env=None):
    """A kvchat command in this process; a traceback would show as an exception here."""
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def tree_digest(root) -> dict[str, str]:
    """Every entry under ``root`` (not following links): file bytes, link targets, modes."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                what = "link:" + os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                what = hashlib.sha256(open(path, "rb").read()).hexdigest()
            else:
                what = "dir"
            out[os.path.relpath(path, root)] = f"{what}:{oct(info.st_mode)}"
    return out


def one_sentence(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1, text
    return lines[0]


def test_symlinks_in_the_sessions_folder_change_nothing_outside(demo_model, home, tmp_path):
    """A symlinked session folder, symlinked session.json / cache / lock file: every
    command refuses or works around them, and the target tree keeps every byte."""
    outside = tmp_path / "outside"
    saved(demo_model, "source")
    outside.mkdir(mode=0o755)
    for name in ("session.json", "cache.safetensors"):
        (outside / name).write_bytes((store.session_dir("source") / name).read_bytes())
    (outside / ".tmp-precious").write_text("a stale-looking temp that is not ours")
    store.delete("source")
    sessions = locations.sessions_dir()
    (sessions / "evil").symlink_to(outside, target_is_directory=True)
    links = sessions / "links"
    links.mkdir(mode=0o700)
    (links / "session.json").symlink_to(outside / "session.json")
    (links / "cache.safetensors").symlink_to(outside / "cache.safetensors")
    (sessions / ".locks").mkdir(mode=0o700, exist_ok=True)
    (sessions / ".locks" / "lk.lock").symlink_to(outside / "created-through-lock")
    saved(demo_model, "good")
    temp_link = store.session_dir("good") / ".tmp-evil"  # the stale-temp cleanup's bait
    temp_link.symlink_to(outside / ".tmp-precious")
    before = tree_digest(outside)

    out = cli("ask", "--session", "good", "--max-tokens", "4", "--json", "Again.")
    assert out.exit_code == 0 and json.loads(out.stdout)["saved"] is True
    assert temp_link.is_symlink()  # a temp name that is not a regular file is left alone

    for name, why in (
        ("evil", "is a symbolic link, not a session folder"),
        ("links", "session.json is a symbolic link"),
        ("lk", "lk.lock is a symbolic link"),
    ):
        out = cli("ask", "--session", name, "--max-tokens", "4", "Hi.")
        assert out.exit_code == 1 and why in one_sentence(out.output), out.output
    for command in (
        ("sessions", "export", "evil"),
        ("sessions", "rm", "evil"),
        ("sessions", "export", "links"),
    ):
        out = cli(*command)
        assert out.exit_code == 1 and "symbolic link" in one_sentence(out.output), out.output
    for name in ("evil", "links"):  # shown like a damaged session: with a note, nothing read
        shown = json.loads(cli("sessions", "show", name, "--json").output)
        assert "symbolic link" in shown["note"] and shown["messages"] == 0

    listed = {s["name"]: s for s in json.loads(cli("sessions", "list", "--json").output)}
    assert listed["good"]["note"] is None and listed["good"]["turns"] == 2
    assert "symbolic link" in listed["evil"]["note"] and "symbolic link" in listed["links"]["note"]

    pruned = cli("sessions", "prune", "--older-than", "0s", "--yes")
    assert pruned.exit_code == 0, pruned.output
    lines = pruned.output.splitlines()
    assert lines[0] == "Removed 1 session(s): good."
    assert {line.split(":")[0] for line in lines[1:]} == {"Skipped evil", "Skipped links"}
    assert tree_digest(outside) == before
    assert (sessions / "evil").is_symlink() and (links / "session.json").is_symlink()


def test_a_symlinked_cache_is_not_read_and_is_replaced_not_written_through(
    demo_model, home, tmp_path
):
    saved(demo_model, "chat")
    target = tmp_path / "elsewhere.safetensors"
    cache = store.session_dir("chat") / "cache.safetensors"
    target.write_bytes(cache.read_bytes())
    cache.unlink()
    cache.symlink_to(target)
    before = target.read_bytes()
    loaded = store.load("chat", demo_model)
    assert not loaded.resumed_from_disk and "symbolic link" in loaded.notice
    store.save(loaded.session, "chat")
    assert target.read_bytes() == before and not cache.is_symlink()
    assert store.load("chat", demo_model).resumed_from_disk


def _fifo(path):
    os.mkfifo(path)


def _zero_device(path):
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero


def _zero_link(path):
    os.symlink("/dev/zero", path)


def _folder(path):
    os.mkdir(path)


SPECIAL = {
    "fifo": _fifo,
    "dev-zero-node": _zero_device,
    "dev-zero-link": _zero_link,
    "folder": _folder,
}


def test_a_cache_bigger_than_the_model_could_make_is_not_read(demo_model, home):
    saved(demo_model, "chat")
    cache = store.session_dir("chat") / "cache.safetensors"
    with open(cache, "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB on paper, nothing on disk
    loaded = store.load("chat", demo_model)
    assert not loaded.resumed_from_disk
    assert f"{cache} is 1,073,741,824 bytes, more than the " in loaded.notice


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_a_cache_that_is_not_a_regular_file_is_rebuilt_without_hanging(demo_model, home, kind):
    """Run as a real `ask` with a time limit: reading a FIFO or /dev/zero would hang."""
    saved(demo_model, "chat")
    cache = store.session_dir("chat") / "cache.safetensors"
    cache.unlink()
    SPECIAL[kind](cache)
    out = subprocess.run(
        [*CLI, "ask", "--session", "chat", "--max-tokens", "4", "--json", "More."],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["resumed_from_disk"] is False and got["saved"] is True
    assert "was rebuilt from the transcript" in got["notice"]
    assert (
        "not a regular file" in got["notice"]
        or "symbolic link" in got["notice"]
        or "is a folder" in got["notice"]
    )
    assert "Traceback" not in out.stderr
    assert stat.S_ISREG(os.lstat(cache).st_mode)  # the save put a real cache in its place
    assert [m["content"] for m in store.read("chat")["messages"]][-2] == "More."


JSON_REFUSALS = {
    "fifo": " is not a regular file; kvchat leaves it alone.",
    "dev-zero-link": " is a symbolic link; kvchat does not follow it.",
    "huge": " is 68,157,440 bytes, more than the 67,108,864 kvchat reads.",
}


@pytest.mark.parametrize("kind", sorted(JSON_REFUSALS))
def test_a_session_json_that_is_not_a_small_regular_file_is_refused(demo_model, home, kind):
    saved(demo_model, "good")
    saved(demo_model, "bad")
    path = store.session_dir("bad") / "session.json"
    path.unlink()
    if kind == "huge":
        with open(path, "wb") as f:
            f.truncate(65 << 20)  # sparse: no disk used, but more than kvchat reads
    else:
        SPECIAL[kind](path)
    with pytest.raises(store.StoreError) as caught:
        store.read("bad")
    assert str(caught.value) == f"{path}{JSON_REFUSALS[kind]}"
    listed = {s.name: s for s in store.list_sessions()}
    assert listed["good"].note is None and listed["bad"].note == str(caught.value)
    out = cli("ask", "--session", "bad", "--max-tokens", "4", "Hi.")
    assert out.exit_code == 1 and one_sentence(out.output) == f"kvchat: {caught.value}"


@pytest.mark.parametrize("value", ["abc", "-1", "1e400", "nan", "²"])
def test_a_bad_lock_timeout_is_one_sentence_and_leaves_no_folder(home, value):
    out = cli(
        "ask", "--session", "fresh", "--max-tokens", "4", "Hi.", env={"KVCHAT_LOCK_TIMEOUT": value}
    )
    assert out.exit_code == 1
    assert one_sentence(out.output) == (
        f"kvchat: KVCHAT_LOCK_TIMEOUT must be a number of seconds such as 30 or 2.5 "
        f"(it is {value!r})."
    )
    assert not store.session_dir("fresh").exists() and store.list_sessions() == []


def test_an_ask_refused_by_a_held_lock_leaves_no_folder(home):
    with store.session_lock("busy"):  # held by this process; the ask is another one
        out = subprocess.run(
            [*CLI, "ask", "--session", "busy", "--max-tokens", "4", "Hi."],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KVCHAT_LOCK_TIMEOUT": "0.2"},
        )
    assert out.returncode == 1 and out.stdout == ""
    assert "in use by another kvchat" in one_sentence(out.stderr)
    assert not store.session_dir("busy").exists()


def test_a_cache_without_session_json_is_kept_aside(demo_model, home):
    saved(demo_model, "chat")
    folder = store.session_dir("chat")
    old_cache = (folder / "cache.safetensors").read_bytes()
    (folder / "session.json").unlink()
    assert not store.exists("chat")
    out = cli("ask", "--session", "chat", "--max-tokens", "4", "--json", "Anew.")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    kept = [p for p in folder.iterdir() if p.name.startswith("cache.safetensors.orphan-")]
    assert len(kept) == 1 and kept[0].read_bytes() == old_cache
    assert got["notice"] == (
        f"{folder} held a cache without session.json; it was kept as "
        f"{kept[0].name} and a new session was started."
    )
    assert [m["content"] for m in store.read("chat")["messages"] if m["role"] == "user"] == [
        "Anew."
    ]


def test_parents_of_kvchat_home_are_private(tmp_path, monkeypatch):
    existing = tmp_path / "existing"
    existing.mkdir()
    existing.chmod(0o755)
    monkeypatch.setenv("KVCHAT_HOME", str(existing / "a" / "b" / "home"))
    old = os.umask(0o022)
    try:
        sessions = locations.sessions_dir()
    finally:
        os.umask(old)
    made = [existing / "a", existing / "a" / "b", existing / "a" / "b" / "home", sessions]
    assert [stat.S_IMODE(p.stat().st_mode) for p in made] == [0o700] * 4
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755  # folders that existed are left alone
