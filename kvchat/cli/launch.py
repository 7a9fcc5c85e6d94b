"""``kvchat launch``: run the TUI, ``kvchat ask`` or ``kvchat replay`` on a model sharded over
several ranks (processes, machines).

Every rank runs this same kvchat; rank 0 runs the command and the others follow
it (kvchat/engine/sharding/driver.py). ``ask`` and ``replay`` go by way of MLX's own
``mlx.launch``, which ends every rank when one fails, but exits 0 whatever
happened; this wrapper reads its notes and says which rank ended the run, in one
sentence, with a non-zero status. The TUI needs the terminal, which
``mlx.launch`` does not give rank 0: for it, this process is rank 0 and starts
the other ranks itself (kvchat/cli/ring.py).
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

from kvchat import locations
from kvchat.settings import FLAGS

from .common import (
    RANK0_FAILED,
    SHARDED_COMMANDS,
    SHARDED_ONLY,
    app,
    as_text,
    fail,
    load_or_exit,
)
from .ring import DEFAULT_PORT, ENTRY, Ring, RingError, rank_ended, ring_hosts

RANK_NOTE = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TUI_OPTIONS = ("model", "cache", "system", "resume")  # kvchat's own, besides the settings flags


def ranks_log() -> Path:
    """Where the followers of a sharded TUI write their output."""
    return locations.cache_dir() / "ranks.log"


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
    """Run the TUI, `ask` or `replay` on a model sharded over several ranks:
    `kvchat launch -n 2 -- [--model M ...]` (the TUI), or `kvchat launch -n 2 -- ask TEXT`.

    Every host needs this Python at the same path, kvchat, and the same model
    folder (or Hugging Face id); each rank keeps its own cache shard beside the
    session. Tensor parallel where the model allows it, else pipeline. The TUI
    runs here as rank 0, over the ring backend; the first host is this machine.
    """
    command = list(ctx.args)
    if backend not in ("ring", "mpi"):
        raise fail(f"--backend is ring or mpi, not {backend!r}.", 2)
    if ranks < 1:
        raise fail("-n must be at least 1.", 2)
    if not command or command[0].startswith("-"):
        raise typer.Exit(_tui(command, ranks, hosts, hostfile, backend, port))
    if command[0] not in SHARDED_COMMANDS:
        raise fail(SHARDED_ONLY, 2)
    runner = Path(sys.executable).with_name("mlx.launch")
    found = str(runner) if runner.is_file() else shutil.which("mlx.launch")
    if found is None:
        raise fail("mlx.launch is not installed beside this Python; install mlx.", 2)
    where = ["--hostfile", str(hostfile)] if hostfile else ["--hosts", hosts] if hosts else []
    argv = [
        found,
        "-n",
        str(ranks),
        *where,
        "--backend",
        backend,
        "--python",
        sys.executable,
        *(["--starting-port", str(port)] if port else []),
        "--",
        "-c",
        ENTRY,
        *command,
    ]
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
    assert proc.stderr is not None  # stderr=PIPE
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
    typer.echo(rank_ended(rank, code), err=True)
    return 1


def _lost(ended: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """The followers that failed by themselves (not ended by mlx.launch's SIGTERM after
    another rank failed), in the order they ended."""
    return [(r, c) for r, c in ended if r and c not in (None, -signal.SIGTERM)]


def tui_flags(args: list[str]) -> dict:
    """The TUI's options (``kvchat``'s own, read by its own definitions) from ``args``:
    :func:`kvchat.tui.run.tui_app`'s keyword arguments."""
    options = typer.core.TyperCommand(
        "kvchat",
        params=typer.main.get_command(app).params,
        context_settings={"allow_extra_args": True},
    )
    try:
        with options.make_context("kvchat", list(args)) as ctx:
            if ctx.args:  # a command: not one this way runs
                raise fail(SHARDED_ONLY, 2)
            params = dict(ctx.params)
    except typer.TyperException as exc:  # click's usage errors, as typer carries them
        raise fail(exc.format_message(), 2) from None
    if params["system"] is not None:
        params["system"] = as_text(params["system"], "--system")
    return {**{k: params[k] for k in TUI_OPTIONS}, "flags": {s.name: params[s.name] for s in FLAGS}}


def _tui(
    args: list[str],
    ranks: int,
    hosts: str | None,
    hostfile: Path | None,
    backend: str,
    port: int | None,
) -> int:
    """Run the TUI on rank 0 (this process) of a ring this process starts."""
    flags = tui_flags(args)
    if backend != "ring":
        raise fail(
            "The TUI runs over the ring backend only (mlx.launch, which starts the "
            "MPI backend, gives rank 0 no terminal).",
            2,
        )
    try:
        ring = Ring(ring_hosts(ranks, hosts, hostfile), port or DEFAULT_PORT, ranks_log())
    except RingError as exc:
        raise fail(str(exc), 2) from None
    return sharded_tui(ring, flags)


def sharded_tui(ring: Ring, flags: dict, run=None) -> int:
    """Start ``ring``, join it as rank 0, and ``run`` the TUI (built from ``flags``) on its
    sharded model; end the followers afterwards. Returns the exit status. (Tests pass a
    ``run`` that drives the app under ``App.run_test``.)"""
    from kvchat import store
    from kvchat.config import ConfigError
    from kvchat.engine.sharding.link import start
    from kvchat.tui.run import run_app, tui_app

    ring.start()
    try:
        late = ring.wait_ready()  # mx.distributed.init waits for every rank; nothing wakes it
    except BaseException:  # Ctrl+C meanwhile: the followers end too
        ring.finish(False)
        raise
    if late is not None:  # most often: ssh could not reach a host
        ring.finish(False)
        typer.echo(late, err=True)
        return 1
    link = failed = None
    said = False  # rank 0 ended the run itself and said why
    try:
        link = start()
        app = tui_app(**flags)
        app.shard(load_or_exit(app.config.model))
        ring.on_lost = lambda rank, code: _tell(app)
        status = (run or run_app)(app) or 0
    except (store.StoreError, ConfigError) as exc:
        typer.echo(f"kvchat: {exc}", err=True)
        status, said = 2, True
    except typer.Exit as exc:  # load_or_exit said why; each follower fails alike and ends
        status, said, link = exc.exit_code, True, None
    except RuntimeError as exc:  # a collective failed: most often, another rank died
        status, failed = 1, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    finally:
        ring.on_lost = lambda rank, code: None
        ended = link is not None and not link.broken and ring.running()
        if ended and link is not None:
            try:
                link.broadcast({"op": "end"})
            except RuntimeError:  # a follower went in the meantime
                ended = False
        ring.finish(ended)
    if ring.lost is not None and not said:
        typer.echo(rank_ended(*ring.lost), err=True)
        return 1
    if failed is not None:
        typer.echo(f"{RANK0_FAILED}{failed}", err=True)
    return status


def _tell(app) -> None:
    """From a watcher thread: tell the running app that a rank was lost."""
    try:
        app.call_from_thread(app.rank_lost)
    except RuntimeError:  # the app has closed already
        pass
