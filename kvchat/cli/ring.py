"""The ranks of a sharded TUI, started by kvchat itself over MLX's ring backend.

``mlx.launch`` pipes every rank's output, so a TUI on rank 0 would have no
terminal. For the TUI, ``kvchat launch`` starts the ring the way
``mlx.launch``'s ring backend does (mlx/_distributed_utils/launch.py): the
same host list and hostfile parsing, a JSON hostfile of ``ip:port`` per rank
named by ``MLX_HOSTFILE``, ``MLX_RANK``, and the same launch script, run by
bash here or by ``ssh`` on another host. Rank 0 is this process, in the
foreground with the terminal; the followers are subprocesses whose output goes
to a log file.

Rank 0 joins the ring (``mx.distributed.init``) only once every follower has
said that it is joining too: the ring backend waits for every rank, holding
Python's lock, so nothing in this process could end a wait for a rank that
never comes. ``ssh`` runs in batch mode (keys only: it never asks for a
password or about a host key) with a connect timeout, so a host that cannot be
reached ends its follower within that time, and ssh's own messages go to a
file of their own, for the sentence that says why (:meth:`Ring.wait_ready`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

LOCAL = "127.0.0.1"  # a host mlx.launch runs without ssh
DEFAULT_PORT = 32323  # mlx.launch's --starting-port
ENTRY = "from kvchat.cli import main; main()"  # what each rank runs (no script file to name)
ENDING_S = 10.0  # how long the followers get to end by themselves after "end"
LOST_S = 1.0  # how long they get otherwise (one may be going down with a lost rank)
SSH_TIMEOUT_S = 10  # how long ssh may take to reach a host (KVCHAT_SSH_TIMEOUT overrides)
SSH_STATUS = 255  # ssh's own failures (it cannot connect or log in)
READY_ENV = "KVCHAT_RING_READY"  # set for the followers: they say READY as they join
READY = "kvchat: this rank joins the ring"
JOIN_S = 120.0  # how long a follower may take to say READY (ssh and Python's start)
ENDED = "so the run was ended on every rank; saved sessions are as they were last saved."


def ssh_timeout() -> int:
    """Seconds ssh may take to reach a host: ``KVCHAT_SSH_TIMEOUT`` when it is a whole
    number of seconds, else SSH_TIMEOUT_S."""
    value = os.environ.get("KVCHAT_SSH_TIMEOUT", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else SSH_TIMEOUT_S


def rank_ended(rank: int, code: int | None) -> str:
    """The sentence that says a rank ended the run."""
    how = (
        "was killed"
        if code is None
        else f"was killed by signal {-code}"
        if code < 0
        else f"exited with status {code}"
    )
    return f"kvchat: rank {rank} {how}, {ENDED}"


class RingError(ValueError):
    """Hosts the ring backend cannot use, in one sentence."""


def ring_hosts(ranks: int, hosts: str | None, hostfile: Path | None):
    """The hosts of the run, one per rank, and the environment a hostfile sets for them
    (mlx.launch's ``Hostfile``), as ``mlx.launch`` reads ``-n``, ``--hosts`` and
    ``--hostfile``."""
    from mlx._distributed_utils.common import Hostfile

    try:
        parsed = (
            Hostfile.from_file(hostfile)
            if hostfile is not None
            else Hostfile.from_list(hosts or LOCAL, ranks)
        )
    except ValueError as exc:
        raise RingError(f"{exc}.") from None
    if any(not host.ips for host in parsed.hosts):
        raise RingError(
            "The ring backend needs IP addresses, not host names, in --hosts "
            '(or "ips" for every host of the hostfile).'
        )
    if len(parsed.hosts) < 2:
        raise RingError("A sharded run needs at least 2 ranks.")
    remote = [h.ssh_hostname for h in parsed.hosts[1:] if h.ssh_hostname != LOCAL]
    if remote and shutil.which("ssh") is None:
        raise RingError(
            f"Starting a rank on {remote[0]} needs ssh, which is not installed "
            "here (on Debian or Ubuntu: apt-get install openssh-client)."
        )
    return parsed


def ring_hostfile(hosts: list, port: int) -> str:
    """The ring backend's hostfile: for each rank, one ``ip:port`` per IP address, the
    ports counting up from ``port``, as mlx.launch writes it."""
    ring, next_port = [], port
    for host in hosts:
        ring.append([f"{ip}:{next_port + i}" for i, ip in enumerate(host.ips)])
        next_port += len(host.ips)
    return json.dumps(ring)


def follower_command(
    rank: int,
    host,
    hostfile: str,
    envs: Sequence[str] = (),
    ssh_log: Path | None = None,
    entry: str = ENTRY,
) -> str:
    """The shell command that starts rank ``rank`` on ``host``: mlx.launch's own launch
    script (``envs``, hostfile in a temporary file, ``MLX_RANK``, this Python), through
    ``ssh`` when the host is another machine (in batch mode, with a connect timeout,
    its own messages appended to ``ssh_log``); the rank runs ``python -c entry``."""
    from mlx._distributed_utils.launch import RemoteProcess

    local = host.ssh_hostname == LOCAL
    script = RemoteProcess.make_launch_script(
        rank, sys.executable, None, {"MLX_HOSTFILE": hostfile}, list(envs), ["-c", entry], local
    )
    if local:
        return script
    log = f"-E {shlex.quote(str(ssh_log))} " if ssh_log is not None else ""
    return (
        f"ssh -tt -o LogLevel=ERROR -o BatchMode=yes -o ConnectTimeout={ssh_timeout()} "
        f"{log}{shlex.quote(host.ssh_hostname)} {shlex.quote(script)}"
    )


class Ring:
    """The followers of a run (ranks 1 and up) and rank 0's place in the ring.

    :meth:`start` writes the ring's hostfile, names it and rank 0 in this process's
    environment (for ``mx.distributed.init``) with the ``envs`` of ``hostfile`` (an
    mlx.launch ``Hostfile``), and starts the followers, their output appended to
    ``log``; :meth:`wait_ready` waits until they join. ``on_lost(rank, code)`` is
    called, from a watcher thread, when a follower ends with a non-zero status before
    :meth:`finish`. :meth:`finish` ends them all and says which was ``lost``.
    """

    entry = ENTRY  # the Python each follower runs

    def __init__(self, hostfile, port: int, log: Path):
        self.hosts, self.envs = hostfile.hosts, list(hostfile.envs)
        self.port, self.log = port, log
        self.followers: list[subprocess.Popen] = []
        self.on_lost: Callable[[int, int], None] = lambda rank, code: None
        self.lost: tuple[int, int] | None = None
        self._ending = False
        self._hostfile: Path | None = None
        self._ssh_logs: dict[int, Path] = {}  # rank: where its ssh writes its own messages
        self._ready: list[threading.Event] = []  # per follower: it said READY
        self._relays: list[threading.Thread] = []

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
                if host.ssh_hostname != LOCAL:
                    fd, path = tempfile.mkstemp(prefix=f"kvchat-ssh-rank{rank}-", suffix=".log")
                    os.close(fd)
                    self._ssh_logs[rank] = Path(path)
                command = follower_command(
                    rank,
                    host,
                    text,
                    [*self.envs, f"{READY_ENV}=1"],
                    self._ssh_logs.get(rank),
                    self.entry,
                )
                proc = subprocess.Popen(
                    command,
                    shell=True,
                    executable="/bin/bash",
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=out,
                    start_new_session=True,
                )
                self.followers.append(proc)
                self._ready.append(threading.Event())
                relay = threading.Thread(
                    target=self._relay, args=(proc, self._ready[-1]), daemon=True
                )
                relay.start()
                self._relays.append(relay)
                threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    def _relay(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        """Append a follower's output to the log, noting when it says READY."""
        seen = b""
        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE
        with open(self.log, "ab", buffering=0) as out:
            while chunk := os.read(stdout.fileno(), 65536):
                out.write(chunk)
                if not ready.is_set():
                    seen = seen[-len(READY) :] + chunk
                    if READY.encode() in seen:
                        ready.set()
        stdout.close()

    def wait_ready(self) -> str | None:
        """Wait until every follower is joining the ring. Returns None, or the sentence
        saying why one is not: it ended (most often: ssh could not reach its host), or it
        did not say READY within JOIN_S seconds."""
        deadline = time.monotonic() + JOIN_S
        while True:
            for rank, proc in enumerate(self.followers, 1):
                if proc.poll() is not None:
                    return self._unreachable(rank, proc.returncode) or rank_ended(
                        rank, proc.returncode
                    )
            waiting = [r for r, ready in enumerate(self._ready, 1) if not ready.is_set()]
            if not waiting:
                return None
            if time.monotonic() > deadline:
                return (
                    f"kvchat: rank {waiting[0]} ({self.hosts[waiting[0]].ssh_hostname}) "
                    f"did not start within {JOIN_S:g} s (its output is in {self.log}), "
                    f"{ENDED}"
                )
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if code and not self._ending:
            self.on_lost(rank, code)

    def _unreachable(self, rank: int, code: int) -> str | None:
        """The sentence saying that ssh could not reach rank ``rank``'s host, when that is
        why it ended with status ``code`` (ssh's own failure), with ssh's last message."""
        log = self._ssh_logs.get(rank)
        if log is None or code != SSH_STATUS:
            return None
        try:
            lines = log.read_text("utf-8", "replace").splitlines()
        except OSError:
            lines = []
        said = [line.strip() for line in lines if line.strip()]
        why = said[-1].rstrip(".") if said else f"ssh exited with status {code}"
        return (
            f"kvchat: could not reach {self.hosts[rank].ssh_hostname} over ssh within "
            f"{ssh_timeout()} s ({why}), {ENDED}"
        )

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
        for relay in self._relays:  # the followers' last words, into the log
            relay.join(LOST_S)
        for path in [self._hostfile, *self._ssh_logs.values()]:
            if path is not None:
                path.unlink(missing_ok=True)
        self.lost = next(((rank, code) for rank, code in enumerate(codes, 1) if code), None)
        return codes
