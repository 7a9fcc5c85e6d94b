"""The ranks of a sharded TUI, started by kvchat itself over MLX's ring backend.

``mlx.launch`` pipes every rank's output, so a TUI on rank 0 would have no
terminal. For the TUI, ``kvchat launch`` starts the ring the way
``mlx.launch``'s ring backend does (mlx/_distributed_utils/launch.py): the
same host list and hostfile parsing, a JSON hostfile of ``ip:port`` per rank
named by ``MLX_HOSTFILE``, ``MLX_RANK``, and the same launch script, run by
bash here or by ``ssh`` on another host. Rank 0 is this process, in the
foreground with the terminal; the followers are subprocesses whose output goes
to a log file.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

LOCAL = "127.0.0.1"  # a host mlx.launch runs without ssh
DEFAULT_PORT = 32323  # mlx.launch's --starting-port
ENTRY = "from kvchat.cli import main; main()"  # what each rank runs (no script file to name)
ENDING_S = 10.0  # how long the followers get to end by themselves after "end"
LOST_S = 1.0  # how long they get otherwise (one may be going down with a lost rank)


class RingError(ValueError):
    """Hosts the ring backend cannot use, in one sentence."""


def ring_hosts(ranks: int, hosts: str | None, hostfile: Path | None):
    """The hosts of the run, one per rank, and the environment a hostfile sets for them
    (mlx.launch's ``Hostfile``), as ``mlx.launch`` reads ``-n``, ``--hosts`` and
    ``--hostfile``."""
    from mlx._distributed_utils.common import Hostfile

    try:
        parsed = (Hostfile.from_file(hostfile) if hostfile is not None
                  else Hostfile.from_list(hosts or LOCAL, ranks))
    except ValueError as exc:
        raise RingError(f"{exc}.") from None
    if any(not host.ips for host in parsed.hosts):
        raise RingError("The ring backend needs IP addresses, not host names, in --hosts "
                        "(or \"ips\" for every host of the hostfile).")
    if len(parsed.hosts) < 2:
        raise RingError("A sharded run needs at least 2 ranks.")
    return parsed


def ring_hostfile(hosts: list, port: int) -> str:
    """The ring backend's hostfile: for each rank, one ``ip:port`` per IP address, the
    ports counting up from ``port``, as mlx.launch writes it."""
    ring, next_port = [], port
    for host in hosts:
        ring.append([f"{ip}:{next_port + i}" for i, ip in enumerate(host.ips)])
        next_port += len(host.ips)
    return json.dumps(ring)


def follower_command(rank: int, host, hostfile: str, envs: list[str] = ()) -> str:
    """The shell command that starts rank ``rank`` on ``host``: mlx.launch's own launch
    script (``envs``, hostfile in a temporary file, ``MLX_RANK``, this Python), through
    ``ssh`` when the host is another machine."""
    from mlx._distributed_utils.launch import RemoteProcess

    local = host.ssh_hostname == LOCAL
    script = RemoteProcess.make_launch_script(
        rank, sys.executable, None, {"MLX_HOSTFILE": hostfile}, list(envs), ["-c", ENTRY], local)
    if local:
        return script
    return f"ssh -tt -o LogLevel=QUIET {shlex.quote(host.ssh_hostname)} {shlex.quote(script)}"


class Ring:
    """The followers of a run (ranks 1 and up) and rank 0's place in the ring.

    :meth:`start` writes the ring's hostfile, names it and rank 0 in this process's
    environment (for ``mx.distributed.init``) with the ``envs`` of ``hostfile`` (an
    mlx.launch ``Hostfile``), and starts the followers, their
    output appended to ``log``. ``on_lost(rank, code)`` is called, from a watcher
    thread, when a follower ends with a non-zero status before :meth:`finish`.
    :meth:`finish` ends them all and says which was ``lost``.
    """

    def __init__(self, hostfile, port: int, log: Path):
        self.hosts, self.envs = hostfile.hosts, list(hostfile.envs)
        self.port, self.log = port, log
        self.followers: list[subprocess.Popen] = []
        self.on_lost: Callable[[int, int], None] = lambda rank, code: None
        self.lost: tuple[int, int] | None = None
        self._ending = False
        self._hostfile: Path | None = None

    def start(self) -> None:
        text = ring_hostfile(self.hosts, self.port)
        fd, name = tempfile.mkstemp(prefix="kvchat-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        self._hostfile = Path(name)
        os.environ.update(e.split("=", 1) for e in self.envs if "=" in e)
        os.environ.update(MLX_HOSTFILE=name, MLX_RANK="0")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            for rank, host in enumerate(self.hosts[1:], 1):
                proc = subprocess.Popen(
                    follower_command(rank, host, text, self.envs), shell=True,
                    executable="/bin/bash",
                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
                self.followers.append(proc)
                threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if code and not self._ending:
            self.on_lost(rank, code)

    def running(self) -> bool:
        """True while every follower runs."""
        return all(proc.poll() is None for proc in self.followers)

    def finish(self, ended: bool) -> list[int | None]:
        """Wait for the followers (that were sent "end" when ``ended``; otherwise a moment,
        for one going down with a lost rank), ending the ones still running after that;
        return their exit statuses (None: had to be ended). ``lost`` is then the first
        follower that ended by itself with a non-zero status, and its status."""
        self._ending = True
        codes: list[int | None] = []
        for proc in self.followers:
            try:
                codes.append(proc.wait(ENDING_S if ended else LOST_S))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(ENDING_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                codes.append(None)
        if self._hostfile is not None:
            self._hostfile.unlink(missing_ok=True)
        self.lost = next(((rank, code) for rank, code in enumerate(codes, 1) if code), None)
        return codes
