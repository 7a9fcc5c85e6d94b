"""`kvchat sessions prune`: asks first on a terminal, refuses without --yes elsewhere,
skips and names the session in use, and clears what a killed removal left."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]
PRUNE = [*CLI, "sessions", "prune", "--older-than", "0s"]


@pytest.fixture
def three(demo_model, home) -> list[str]:
    session = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    [e for e in session.send("Hi.") if isinstance(e, TurnDone)]
    names = ["a", "b", "busy"]
    for name in names:
        store.save(session, name)
    return names


def names_left() -> list[str]:
    return sorted(s.name for s in store.list_sessions())


def test_prune_skips_and_names_the_session_in_use(three):
    with store.session_lock("busy"):  # an `ask` of this process holds it
        out = subprocess.run([*PRUNE, "--yes"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "Removed 2 session(s): a, b.",
        "Skipped busy: it is in use by another kvchat",
    ]
    assert names_left() == ["busy"]


def test_prune_without_a_terminal_needs_yes(three):
    out = subprocess.run(
        PRUNE, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "kvchat: Would delete 3 session(s) (a, b, busy); run it again with "
        "--yes to confirm, as standard input is not a terminal.\n"
    )
    assert names_left() == three


@pytest.mark.parametrize("answer", ["n", "y"])
def test_prune_on_a_terminal_asks_first(three, answer):
    controller, terminal = os.openpty()
    try:
        proc = subprocess.Popen(
            PRUNE, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        os.write(controller, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(controller)
        os.close(terminal)
    assert out.startswith("Delete 3 session(s): a, b, busy? [y/N]: ")
    if answer == "n":
        assert proc.returncode == 1 and err == "kvchat: Nothing was deleted.\n"
        assert names_left() == three
    else:
        assert proc.returncode == 0 and out.endswith("Removed 3 session(s): a, b, busy.\n")
        assert names_left() == []


def test_prune_clears_what_a_killed_removal_left(three, home):
    leftover = home / "sessions" / ".removing-a-0badf00d"
    os.rename(store.session_dir("a"), leftover)  # where a removal stood when it was killed
    assert names_left() == ["b", "busy"]  # never listed
    assert store.prune(3600) == store.Pruned(removed=[], skipped=[])
    assert not leftover.exists() and names_left() == ["b", "busy"]
