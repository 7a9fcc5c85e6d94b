"""``kvchat launch``: run ``kvchat ask`` or ``kvchat replay`` on a model sharded over several
ranks (processes, machines), by way of MLX's own ``mlx.launch``.

Every rank runs this same kvchat; rank 0 runs the command and the others follow
it (kvchat/engine/distributed.py). ``mlx.launch`` ends every rank when one
fails, but exits 0 whatever happened; this wrapper reads its notes and says
which rank ended the run, in one sentence, with a non-zero status.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from .common import RANK0_FAILED, SHARDED_COMMANDS, SHARDED_ONLY, _fail, app

RANK_NOTE = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What each rank runs: this kvchat's entry point (there is no script file to name).
ENTRY = "from kvchat.cli import main; main()"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    ranks: Annotated[int, typer.Option("-n", "--ranks", help="Ranks per host.")] = 2,
    hosts: Annotated[
        str | None, typer.Option(help="Comma-separated hosts (IP addresses for ring).")
    ] = None,
    hostfile: Annotated[
        Path | None, typer.Option(help="An mlx.launch hostfile (JSON) naming the hosts.")
    ] = None,
    backend: Annotated[str, typer.Option(help="ring (TCP) or mpi.")] = "ring",
    port: Annotated[int | None, typer.Option(help="First TCP port of the ring backend.")] = None,
) -> None:
    """Run `ask` or `replay` on a model sharded over several ranks: kvchat launch -n 2 -- ask TEXT.

    Every host needs this Python at the same path, kvchat, and the same model
    folder (or Hugging Face id); each rank keeps its own cache shard beside the
    session. Tensor parallel where the model allows it, else pipeline.
    """
    command = list(ctx.args)
    if not command or command[0] not in SHARDED_COMMANDS:
        raise _fail(SHARDED_ONLY, 2)
    if backend not in ("ring", "mpi"):
        raise _fail(f"--backend is ring or mpi, not {backend!r}.", 2)
    if ranks < 1:
        raise _fail("-n must be at least 1.", 2)
    runner = Path(sys.executable).with_name("mlx.launch")
    found = str(runner) if runner.is_file() else shutil.which("mlx.launch")
    if found is None:
        raise _fail("mlx.launch is not installed beside this Python; install mlx.", 2)
    where = ["--hostfile", str(hostfile)] if hostfile else ["--hosts", hosts] if hosts else []
    argv = [found, "-n", str(ranks), *where, "--backend", backend, "--python", sys.executable,
            *(["--starting-port", str(port)] if port else []), "--", "-c", ENTRY, *command]
    raise typer.Exit(_run(argv))


def _run(argv: list[str]) -> int:
    """Run ``mlx.launch``, passing its output through; return the run's exit status,
    after one sentence naming the rank that ended it, when one did."""
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
    ended: list[tuple[int, int | None]] = []
    # The ring's notes, rank 0's failure and anything after a follower failed: echoes of
    # a lost rank, shown only if rank 0 is the one that ended the run. (mlx.launch
    # relays output in pieces, so a line of theirs can be cut by one of its notes.)
    held: list[str] = []
    for raw in proc.stderr:
        line = raw.decode("utf-8", "replace")
        note = RANK_NOTE.search(ANSI.sub("", line))
        if note:
            ended.append((int(note[1]), int(note[2]) if note[2] is not None else None))
        elif _lost(ended) or "[ring]" in line or RANK0_FAILED in line:
            held.append(line)
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
    proc.wait()
    lost = _lost(ended)
    rank, code = lost[0] if lost else ended[0] if ended else (0, proc.returncode)
    if rank == 0 and code is not None and code >= 0:
        sys.stderr.write("".join(held))
        return code  # rank 0 ended first and said why itself
    how = ("was killed" if code is None else f"was killed by signal {-code}" if code < 0
           else f"exited with status {code}")
    typer.echo(f"kvchat: rank {rank} {how}, so the run was ended on every rank; "
               "saved sessions are as they were last saved.", err=True)
    return 1


def _lost(ended: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """The followers that failed by themselves (not ended by mlx.launch's SIGTERM after
    another rank failed), in the order they ended."""
    return [(r, c) for r, c in ended if r and c not in (None, -signal.SIGTERM)]
