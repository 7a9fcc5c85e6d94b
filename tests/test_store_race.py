"""`kvchat sessions rm` racing with `kvchat ask`s that wait for the same session, in
real processes: no traceback, no completed turn lost.

Each round: a saved session with system prompt BASE and one turn; this test holds
its lock while two `ask --system NEW` and one `sessions rm` start and wait for it
(each has the lock file open), then lets go, so the three run in an order the
lock decides. An ask that ran before the rm resumed the BASE session (and says
that --system only applies to a new session); its turn went with the rm, as
asked. Every ask that ran after the rm must have its turn, reply and all, in
the session that remains.

The commands are real, separate processes running ``kvchat.cli.main``, forked
from a helper process that has imported kvchat once: a cold start spends about
a second of CPU in imports, which for 60 processes would make this test slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from tests.helpers import wait_until

FORK_SERVER = r"""
import json, os, sys
from kvchat.cli import main
import kvchat.config, kvchat.engine.models.model, kvchat.engine.conversation.session, kvchat.store  # what ask imports
children = {}
for line in sys.stdin:
    request = json.loads(line)
    if request == "wait":
        for pid, who in children.items():
            status = os.waitpid(pid, 0)[1]
            print(json.dumps([who, os.waitstatus_to_exitcode(status)]), flush=True)
        children.clear()
        print('"done"', flush=True)
        continue
    who, argv, out, err = request
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT, 0o600), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT, 0o600), 2)
        sys.argv = ["kvchat", *argv]
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    children[pid] = who
    print(json.dumps([who, pid]), flush=True)
"""
ROUNDS, AT_ONCE = 20, 5
SYSTEM_SKIPPED = "--system only applies to a new session"

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")


class Launcher:
    """Starts kvchat commands as forked processes; collects their exit codes and output."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.server = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def _send(self, request) -> None:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()

    def start(self, who: str, *argv: str) -> int:
        """Start ``kvchat *argv``; return its pid."""
        self._send(
            [who, list(argv), str(self.folder / f"{who}.out"), str(self.folder / f"{who}.err")]
        )
        got, pid = json.loads(self.server.stdout.readline())
        assert got == who
        return pid

    def wait(self) -> dict[str, tuple[int, str, str]]:
        """Every started command's (exit code, stdout, stderr), once all have ended."""
        self._send("wait")
        done = {}
        for line in self.server.stdout:
            if json.loads(line) == "done":
                return done
            who, code = json.loads(line)
            done[who] = (
                code,
                (self.folder / f"{who}.out").read_text(),
                (self.folder / f"{who}.err").read_text(),
            )
        raise AssertionError("the fork server stopped")

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


def _open_count(pid: int, name: str) -> int:
    """How many of process ``pid``'s file descriptors are open on session ``name``'s lock
    file (the condition the tests wait on, instead of a fixed time)."""
    count = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                count += target.endswith((f"/.locks/{name}.lock", f"/{name}/.lock"))
    return count


def waiting_on(pid: int, name: str) -> bool:
    """Whether process ``pid`` has session ``name``'s lock file open (it opens it right
    before it waits): ``.locks/<name>.lock``, or ``<name>/.lock`` where kvchat kept it
    before, so this test also shows the old layout failing."""
    return _open_count(pid, name) > 0


def test_rm_against_waiting_asks_loses_no_turn(demo_model, home, tmp_path):
    base = Session(demo_model, system="BASE", settings=GenerationSettings(max_tokens=4))
    [e for e in base.send("base turn") if isinstance(e, TurnDone)]
    figures = {"rounds": 0, "asks": 0, "after_rm": 0, "lost": 0, "tracebacks": 0}
    launcher = Launcher(tmp_path)
    try:
        for batch in range(ROUNDS // AT_ONCE):
            names = [f"race{batch}-{i}" for i in range(AT_ONCE)]
            _round(launcher, base, names, home, figures)
    finally:
        launcher.close()
    leftovers = [p.name for p in (home / "sessions").iterdir() if p.name.startswith(".removing-")]
    assert leftovers == []
    print(f"\nrm race: {figures}")
    assert figures == {
        "rounds": ROUNDS,
        "asks": 2 * ROUNDS,
        "after_rm": figures["after_rm"],
        "lost": 0,
        "tracebacks": 0,
    }


def _round(launcher: Launcher, base: Session, names: list[str], home: Path, figures) -> None:
    pids = {}
    with contextlib.ExitStack() as held:
        for name in names:
            store.save(base, name)
            held.enter_context(store.session_lock(name))
            for who in ("ask1", "ask2"):
                pids[f"{who} of {name}"] = launcher.start(
                    f"{who} of {name}",
                    "ask",
                    "--session",
                    name,
                    "--system",
                    "NEW",
                    "--max-tokens",
                    "3",
                    "--json",
                    f"{who} of {name}",
                )
            pids[f"rm of {name}"] = launcher.start(f"rm of {name}", "sessions", "rm", name)
        wait_until(
            lambda: all(waiting_on(pid, who.split(" of ")[1]) for who, pid in pids.items()),
            60,
            0.02,
            message="the commands never waited for the lock",
        )
    # The locks are released: each session's three commands now run in lock order.
    outs = launcher.wait()
    figures["tracebacks"] += sum("Traceback" in err for _, _, err in outs.values())
    for who, (code, _, err) in outs.items():
        assert code == 0, f"{who} failed: {err}"
    for name in names:
        figures["rounds"] += 1
        lock = home / "sessions" / ".locks" / f"{name}.lock"
        assert lock.exists() == store.exists(name)  # rm takes its lock file with it
        assert outs[f"rm of {name}"][1] == f"Removed session {name}.\n"
        asks = {who: json.loads(outs[f"{who} of {name}"][1]) for who in ("ask1", "ask2")}
        after = {
            f"{who} of {name}" for who in asks if SYSTEM_SKIPPED not in outs[f"{who} of {name}"][2]
        }
        figures["asks"] += len(asks)
        figures["after_rm"] += len(after)
        if not after:
            assert not store.exists(name)  # both asks ran before the rm
            continue
        messages = store.read(name)["messages"]
        assert messages[0] == {"role": "system", "content": "NEW"}
        kept = {
            m["content"]: messages[i + 1]["content"]
            for i, m in enumerate(messages)
            if m["role"] == "user"
        }
        figures["lost"] += len(after - set(kept))
        assert set(kept) == after
        for text in after:
            reply = json.loads(outs[text][1])
            assert kept[text] == reply["reply"] and reply["saved"] is True


def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(home):
    """A waits for `x` while `rm` holds it; rm deletes the session and its lock file;
    C then locks the new lock file. When rm lets go, A must wait for C, not hold the
    removed file's lock beside C (two holders at once)."""
    store.session_dir("x").mkdir(parents=True)
    events = {e: threading.Event() for e in ("a_got", "c_got", "c_release")}

    def waiter():
        with store.session_lock("x", timeout=30):
            events["a_got"].set()

    def newcomer():
        with store.session_lock("x", timeout=30):
            events["c_got"].set()
            events["c_release"].wait(30)

    with store.session_lock("x"):
        a = threading.Thread(target=waiter)
        a.start()
        # ours, and A's as it waits
        wait_until(
            lambda: _open_count(os.getpid(), "x") >= 2, 30, message="A never opened the lock file"
        )
        store.delete("x")  # re-entrant: removes the folder, then the lock file
        c = threading.Thread(target=newcomer)
        c.start()
        assert events["c_got"].wait(10)  # C locked a new lock file at once
    assert not events["a_got"].wait(0.5)  # rm let go; A still waits, for C
    events["c_release"].set()
    assert events["a_got"].wait(10)
    a.join()
    c.join()
