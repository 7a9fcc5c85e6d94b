"""The saved prompt history and the text that comes into the message box from outside."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from kvchat import locations
from kvchat.tui import prompt_history as history
from kvchat.tui.prompt_tools import (
    PromptToolError,
    edit_in_editor,
    editor_command,
    file_request,
    read_text_file,
)
from tests.helpers import wait_until


def test_history_is_newest_first_once_each_capped_and_private(home):
    for prompt in ["first", "second", "first", "  ", "x" * (history.MAX_ENTRY_CHARS + 1)]:
        history.remember(prompt)
    assert history.load() == ["first", "second"]
    path = history.history_file()
    assert path.parent == locations.data_dir()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == ["first", "second"]
    for n in range(history.MAX_ENTRIES + 5):
        history.remember(f"p{n}")
    loaded = history.load()
    assert len(loaded) == history.MAX_ENTRIES and loaded[0] == f"p{history.MAX_ENTRIES + 4}"


def test_history_never_follows_a_symlink_and_survives_a_bad_file(home, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(["secret"]))
    path = history.history_file()
    path.symlink_to(target)
    assert history.load() == []  # not read through the link
    history.remember("mine")
    assert not path.is_symlink() and history.load() == ["mine"]
    assert json.loads(target.read_text()) == ["secret"]  # the link's target is untouched
    path.write_text("{not json")
    assert history.load() == []
    assert history.merged(["b", "a"], ["a", "c", ""]) == ["b", "a", "c"]


def test_file_request_and_reading_files(tmp_path):
    assert file_request("/file notes.txt") == ("", "notes.txt")
    assert file_request("Summarize:\n/file ~/a b.txt") == ("Summarize:\n", "~/a b.txt")
    assert file_request("/file ") is None and file_request("see /file x") is None

    text = tmp_path / "t.txt"
    text.write_text("héllo\n\tworld\n")
    assert read_text_file(str(text)) == "héllo\n\tworld\n"
    link = tmp_path / "link.txt"
    link.symlink_to(text)
    assert read_text_file(str(link)) == "héllo\n\tworld\n"  # the user named it: followed

    (tmp_path / "nul.bin").write_bytes(b"ab\0cd")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    (tmp_path / "big.txt").write_bytes(b"a" * 101)
    cases = {
        str(tmp_path / "missing.txt"): f"No file at {tmp_path / 'missing.txt'}.",
        str(tmp_path): f"{tmp_path} is a folder; give a file's path.",
        str(tmp_path / "nul.bin"): "is not a text file (it holds NUL bytes or is not UTF-8).",
        str(tmp_path / "latin.txt"): "is not a text file (it holds NUL bytes or is not UTF-8).",
        str(tmp_path / "big.txt"): "is 101 bytes, more than the 100 kvchat reads.",
    }
    for path, message in cases.items():
        with pytest.raises(PromptToolError) as raised:
            read_text_file(path, limit=100)
        assert message in str(raised.value) and "\n" not in str(raised.value)


def _editor(tmp_path, body: str) -> list[str]:
    script = tmp_path / "editor.py"
    script.write_text(f"import sys\npath = sys.argv[1]\n{body}\n")
    return [sys.executable, str(script)]


def test_the_editor_runs_on_a_private_file_and_its_text_comes_back(tmp_path):
    command = _editor(
        tmp_path,
        (
            "import os, stat\n"
            "assert stat.S_IMODE(os.stat(path).st_mode) == 0o600\n"
            "text = open(path).read()\n"
            "open(path, 'w').write(text + ' and more\\n')"
        ),
    )
    assert edit_in_editor("draft", command) == "draft and more"
    failing = _editor(tmp_path, "open(path, 'w').write('lost'); sys.exit(3)")
    with pytest.raises(PromptToolError, match="exited with status 3; the message is unchanged"):
        edit_in_editor("draft", failing)
    with pytest.raises(PromptToolError, match="could not be started"):
        edit_in_editor("draft", [str(tmp_path / "no-such-editor")])


def test_editor_command_prefers_visual_and_says_when_none_is_set():
    assert editor_command({"VISUAL": "code -w", "EDITOR": "vi"}) == ["code", "-w"]
    assert editor_command({"EDITOR": "vi"}) == ["vi"]
    with pytest.raises(PromptToolError, match=r"^Set \$EDITOR to edit messages in an editor\.$"):
        editor_command({"EDITOR": " "})


_WRITER = """
import sys, time
from pathlib import Path
from kvchat.tui import prompt_history as history
tag, go = sys.argv[1], Path(sys.argv[2])
(go.parent / f"ready-{tag}").touch()
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.001)
for n in range(60):
    history.remember(f"{tag}-{n}")
"""


def test_two_kvchats_sending_at_once_lose_no_prompt(home, tmp_path):
    import subprocess

    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, tag, str(go)], env=env)
        for tag in ("a", "b")
    ]
    wait_until(
        lambda: all((tmp_path / f"ready-{t}").exists() for t in "ab"),
        60,
        alive=lambda: all(w.poll() is None for w in writers),
        message="the writers never got ready",
    )
    go.touch()
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    saved = history.load()
    assert sorted(saved) == sorted(f"{t}-{n}" for t in "ab" for n in range(60))
    assert [p for p in saved if p.startswith("a-")] == [f"a-{n}" for n in reversed(range(60))]
