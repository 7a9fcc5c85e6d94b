"""Saves that cannot finish: a full disk, a file size limit, a save cut short
between the cache and session.json whose newer cache was then damaged."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import kill_when_stopped, stopped_before_rename, turn

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]
FIRST = ["Hello there.", "What is a cache?"]
NEXT = "And why is it fast?"


def conversation(lm) -> Session:
    session = Session(lm, system="Be brief.", settings=GenerationSettings(max_tokens=8))
    for text in FIRST:
        turn(session, text)
    return session


def snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def ask_more(limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        [*CLI, "ask", "--session", "chat", "--max-tokens", "6", NEXT],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit if limit_bytes else None,
    )


def expected_reply(lm) -> str:
    """What `ask_more` answers, computed in this process."""
    reference = conversation(lm)
    reference.settings.max_tokens = 6
    return turn(reference, NEXT).reply


def assert_previous_save_intact(lm, folder, before: dict[str, bytes]) -> None:
    assert snapshot(folder) == before  # same files, same bytes: no temporary file left
    loaded = store.load("chat", lm)
    assert loaded.resumed_from_disk and loaded.notice is None
    assert [m["content"] for m in loaded.session.messages if m["role"] == "user"] == FIRST


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and a kernel that lets this container mount one)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small file system needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(disk)], capture_output=True
    )
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_shows_the_reply_then_one_sentence(demo_model, small_disk, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(small_disk / "home"))
    store.save(conversation(demo_model), "chat")
    folder = store.session_dir("chat")
    before = snapshot(folder)
    filler = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # take every free block
        while True:
            os.write(filler, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28
    finally:
        os.close(filler)

    out = ask_more()
    assert out.returncode == 1
    assert out.stdout == expected_reply(demo_model) + "\n"  # the reply was shown
    assert out.stderr == (
        "kvchat: the message could not be kept on disk while it is sent "
        "(no space left on device).\n"
        "kvchat: Could not save session chat: no space left on device; "
        "the previous save is intact.\n"
    )
    (small_disk / "filler").unlink()
    assert_previous_save_intact(demo_model, folder, before)


def test_a_file_size_limit_shows_the_reply_then_one_sentence(demo_model, home):
    """RLIMIT_FSIZE needs no privileges: mlx's write of the cache fails with EFBIG."""
    store.save(conversation(demo_model), "chat")
    folder = store.session_dir("chat")
    before = snapshot(folder)
    out = ask_more(limit_bytes=8192)  # the cache is bigger than that, session.json smaller
    assert out.returncode == 1 and out.stdout == expected_reply(demo_model) + "\n"
    assert out.stderr == (
        "kvchat: Could not save session chat: [Errno 27] File too large; "
        "the previous save is intact.\n"
    )
    assert_previous_save_intact(demo_model, folder, before)


CUT_SHORT = """
import sys
from kvchat import store
from kvchat.engine.models.model import load_model
from kvchat.engine.conversation.session import TurnDone
loaded = store.load("chat", load_model("demo"))
[e for e in loaded.session.send(sys.argv[1]) if isinstance(e, TurnDone)]
store.save(loaded.session, "chat")
"""


def cut_short_before_session_json(lm) -> None:
    """A real save of one more turn, killed after the new cache is in place and before
    session.json is: the folder holds the old transcript and the newer cache."""
    store.save(conversation(lm), "chat")
    proc = subprocess.Popen(
        [sys.executable, "-c", stopped_before_rename(CUT_SHORT, "session.json"), NEXT],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert kill_when_stopped(proc, "session.json")


def _flip_tensor_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 4000, len(data), 97):  # the arrays, not the header
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped-bytes": lambda folder: _flip_tensor_bytes(folder / "cache.safetensors"),
    "no-checksum-file": lambda folder: (folder / "cache.sha256").unlink(),
    "checksum-file-of-another-cache": lambda folder: (folder / "cache.sha256").write_text(
        json.dumps({"sha256": "0" * 64, "bytes": 1, "ledger_sha256": "0" * 64})
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_newer_cache_is_verified_before_it_is_trimmed(demo_model, home, damage):
    cut_short_before_session_json(demo_model)
    folder = store.session_dir("chat")
    DAMAGE[damage](folder)
    loaded = store.load("chat", demo_model)
    assert not loaded.resumed_from_disk
    assert "its checksum cannot be verified against cache.sha256" in loaded.notice
    reference = conversation(demo_model)
    assert loaded.session.messages == reference.messages
    assert turn(loaded.session, NEXT).reply == turn(reference, NEXT).reply


def test_an_intact_newer_cache_is_still_trimmed_and_used(demo_model, home):
    cut_short_before_session_json(demo_model)
    loaded = store.load("chat", demo_model)
    assert loaded.resumed_from_disk and loaded.notice is None
    reference = conversation(demo_model)
    assert turn(loaded.session, NEXT).reply == turn(reference, NEXT).reply
