"""Helpers shared by the engine and store tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.engine.conversation.session import Session, TurnDone
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.sequence import Left

# What each rank of a test's sharded run may run in place of kvchat's entry
# (kvchat/cli/ring.py's ENTRY): rank 1 kills itself at the third token of each turn.
LOSING_RANK_1 = """
import os, signal
from kvchat.cli import main

def die(i):
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)

main(on_token=die if os.environ.get("MLX_RANK") == "1" else None)
"""


def wait_until(
    condition,
    timeout: float = 10.0,
    every: float = 0.01,
    *,
    alive=None,
    message: str = "the condition never held",
) -> None:
    """Poll ``condition()`` until it holds; AssertionError saying ``message`` after
    ``timeout`` seconds, or as soon as ``alive()`` (what it waits on: a process still
    running, say) no longer holds. How a test waits on another thread or process, never a
    fixed sleep; TUI tests use tests/tui/conftest.py's ``until``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert alive is None or alive(), f"{message}: what it waited on has ended"
        assert time.monotonic() < deadline, message
        time.sleep(every)


def turn(session: Session, text: str) -> TurnDone:
    """Run one turn of ``session`` to its end; return its ``TurnDone``."""
    return [e for e in session.send(text) if isinstance(e, TurnDone)][0]


def run_bounded(
    argv: list[str],
    timeout: float,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own, the whole group killed if it
    outlives ``timeout`` (a launch's ranks would otherwise wait on each other forever)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def stopped_before_rename(script: str, target: str) -> str:
    """``script``, run in a process of its own, stopped for good (to be killed) right
    before a write renames or links its file to a name ending in ``target``; it prints
    ``stopped-before:<target>`` on stderr first. The fault lives here, in the test's
    process: kvchat's code has no hook for it."""
    prelude = f"""
import os as _os, sys as _sys, threading as _threading
def _stopping(real):
    def call(src, dst, *args, **kwargs):
        if str(dst).endswith({target!r}):
            print("stopped-before:" + {target!r}, file=_sys.stderr, flush=True)
            _threading.Event().wait()
        return real(src, dst, *args, **kwargs)
    return call
_os.replace = _stopping(_os.replace)
_os.link = _stopping(_os.link)
"""
    return prelude + script


def kill_when_stopped(proc: subprocess.Popen, target: str) -> bool:
    """Read ``proc``'s stderr until :func:`stopped_before_rename` says it stopped, then
    kill it; whether it had stopped there."""
    stopped = any(f"stopped-before:{target}" in line for line in proc.stderr)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return stopped


def run_all(core, seqs, on_token=None) -> dict:
    """Run ``seqs`` on a generation core at once, every one joined before its first step
    (the core holds the gate until all have joined), each on its own thread; ``on_token(seq, messages)`` after each token."""
    out = {}

    def run(seq):
        gen = core.run(seq)
        got = []
        for message in gen:
            got.append(message)
            if isinstance(message, int) and on_token is not None and on_token(seq, got):
                gen.close()
                break
        out[id(seq)] = got
        assert not got or not isinstance(got[-1], Left) or got[-1].error is None, got[-1]

    start_together(core, [threading.Thread(target=run, args=(s,)) for s in seqs])
    return out


def start_together(core, threads: list[threading.Thread]) -> None:
    """Start ``threads``, each submitting one sequence to ``core``, so that all have
    joined before the core's first step (it waits on the gate held meanwhile); then
    wait for them to finish."""
    with GATE.exclusive():
        for t in threads:
            t.start()
        with core._cond:
            assert core._cond.wait_for(lambda: len(core._joining) == len(threads), 60)
    for t in threads:
        t.join(120)


def ask_from_shell(session: str, text: str) -> None:
    """``kvchat ask --session SESSION --model demo --max-tokens 6 --json TEXT``, as a user
    types it in a shell (in this process); it must succeed."""
    argv = ["ask", "--session", session, "--model", "demo", "--max-tokens", "6", "--json", text]
    out = CliRunner().invoke(app, argv)
    assert out.exit_code == 0, out.output


def with_template(lm, folder, template: str):
    """A copy of ``lm``'s model folder at ``folder`` whose tokenizer_config.json carries
    ``template`` as its chat template, loaded like any model folder."""
    import json
    import shutil

    from kvchat.engine.models.model import load_model

    shutil.copytree(lm.path, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return load_model(str(folder))


def mypy_errors(folder, source: str) -> list[str]:
    """The error lines mypy gives for ``source`` (written to ``use.py`` in ``folder``),
    checked against the project's types. mypy runs in a process of its own: run in the
    test process, it left the test run aborting at exit."""
    import sys

    use = folder / "use.py"
    use.write_text(source, encoding="utf-8")
    argv = [sys.executable, "-m", "mypy", str(use), "--no-error-summary"]
    done = subprocess.run([*argv, "--cache-dir", str(folder)], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if ": error:" in line]
