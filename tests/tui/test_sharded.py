"""The TUI on a model sharded over two ranks: rank 0 runs the real app under
``App.run_test`` in its own process (tests/tui/sharded_driver.py), rank 1 follows, both
started by ``kvchat launch``'s own code over the ring backend on loopback; a run whose
rank 1 is on a host ssh cannot reach ends before rank 0 joins. The rest are unit tests
of the ring's hosts, hostfile and commands, which launch nothing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from mlx_lm.models.cache import load_prompt_cache
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.cli import ring as ring_module
from kvchat.cli.launch import tui_flags
from kvchat.cli.ring import (
    LOCAL,
    Ring,
    RingError,
    follower_command,
    rank_ended,
    ring_hostfile,
    ring_hosts,
)
from kvchat.engine.conversation.session import Session
from kvchat.tui.sharded import ONE_TAB
from kvchat.tui.widgets.sidebar import human_bytes
from tests.helpers import run_bounded
from tests.test_sharding import CLI, _free_port, in_this_process, kvchat, launched

from .test_sidebar import flat


@pytest.mark.timeout(90)
def test_the_tui_on_two_ranks_answers_as_one_process_and_shows_each_ranks_cache(
    demo_model, home, tmp_path
):
    text = "hello there"
    driver = _driver(tmp_path, text)
    assert driver.returncode == 0, driver.stderr
    seen = json.loads(driver.stdout.splitlines()[-1])
    single = json.loads(in_this_process("ask", "--json", "--max-tokens", "8", text))
    assert seen["reply"] == single["reply"] and seen["reply"]
    assert len(seen["ledger"]) == single["cache_tokens"]

    # Each rank's figure is its own cache's: rank 1's is that of the shard it saved (autosave,
    # in a home of its own: the driver kept a copy before the drop).
    cache, meta = load_prompt_cache(str(tmp_path / "cache.rank1.safetensors"), return_metadata=True)
    assert meta["ledger"] == ",".join(map(str, seen["ledger"]))
    assert [c.offset for c in cache] == [len(seen["ledger"])]  # its one layer of the two
    rank1 = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert seen["rank_bytes"] == [seen["local_bytes"], rank1] and rank1 > 0
    assert (
        "ranks 2 ranks, pipeline parallel "
        f"rank 0 {human_bytes(seen['local_bytes'])} rank 1 {human_bytes(rank1)} turns 1"
    ) in flat(seen["sidebar"])

    # The kind dialog opens (no probe on rank 0 alone) and a switch converts every rank's.
    assert seen["dialog"] == "KindDialog"
    q8 = seen["quantized_bytes"]
    assert len(q8) == 2 and q8[0] == q8[1] and 0 < q8[0] < seen["local_bytes"] / 1.5

    # What a sharded run cannot do is said in one sentence each, and nothing else happens.
    assert seen["tabs"] == 1
    assert seen["notices"] == [
        ONE_TAB,
        "A sharded run cannot switch branch yet; run this session on one machine for that.",
    ]

    # A drop from disk (F8, confirmed): every rank deletes its files of the session, and the
    # one tab holds a new, empty session, made on every rank, which answers as one process.
    name = seen["session"]
    assert seen["before_drop"] == [
        {
            name: ["cache.safetensors", "cache.sha256", "session.json"],
            ".locks": [f"{name}.lock", f"{name}.open"],
        },  # locked to save; open in the TUI
        {name: ["cache.rank1.safetensors"]},
    ]  # rank 1's home: its shard only
    assert (
        f"Drop '{name}' and start a new session in its tab? It is saved on" in seen["drop_dialog"]
    )
    dropped = seen["after_drop"]
    assert dropped["listed"] == [{".locks": ["chat-2.open"]}, {}] and dropped["saved"] is False
    assert dropped["notices"][-1] == f"Dropped {name} from memory and disk on every rank."
    assert dropped["tabs"] == ["chat-2"] and dropped["widgets"] == ["Welcome"]
    assert dropped["messages"] == [] and dropped["ledger"] == [] and dropped["rank_bytes"] == [0, 0]
    again = seen["again"]
    assert again["reply"] == single["reply"]
    assert again["reused_tokens"] == 0 and again["evaluated_tokens"] == single["evaluated_tokens"]
    assert again["cache_tokens"] == single["cache_tokens"]
    assert [s.name for s in store.list_sessions()] == ["chat-2"]  # autosaved; chat-1 is gone
    assert sorted(p.name for p in (tmp_path / "rank1-home" / "sessions").iterdir()) == ["chat-2"]
    assert seen["status"] == 0 and seen["followers"] == [0]  # Ctrl+Q ended rank 1 cleanly


@pytest.mark.timeout(90)
def test_a_rank_lost_mid_reply_ends_the_tui_with_one_sentence_and_damages_nothing(
    demo_model, home, tmp_path
):
    kept = Session(demo_model)
    kept.settings.max_tokens = 4
    [_ for _ in kept.send("hello")]
    store.save(kept, "kept")
    folder = store.session_dir("kept")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    driver = _driver(tmp_path, "a question", "lost")
    assert driver.returncode == 0, driver.stderr
    seen = json.loads(driver.stdout.splitlines()[-1])
    assert seen["status"] == 1 and seen["followers"] == [-9]
    assert driver.stderr.endswith(
        "kvchat: rank 1 was killed by signal 9, so the run was ended on every rank; "
        "saved sessions are as they were last saved.\n"
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [s.name for s in store.list_sessions()] == ["kept"]  # the broken turn: not saved


@pytest.mark.timeout(90)
def test_a_session_saved_by_two_ranks_resumes_in_the_tui_with_every_ranks_shard(
    demo_model, home, tmp_path
):
    first = launched("ask", "-s", "big", "--json", "--max-tokens", "6", "hello there")
    assert first.returncode == 0, first.stderr
    ledger = json.loads((store.session_dir("big") / "session.json").read_bytes())["ledger"]
    driver = _driver(tmp_path, "and more", "resume=big")
    assert driver.returncode == 0, driver.stderr
    seen = json.loads(driver.stdout.splitlines()[-1])
    assert seen["name"] == "big" and seen["status"] == 0 and seen["followers"] == [0]
    assert seen["notices"] == [
        f"Resumed with its cache from disk ({len(ledger):,} tokens): "
        "the next turn evaluates only the new message."
    ]
    assert seen["stats"]["reused_tokens"] == len(ledger) > 0  # rank 1 read its shard too
    assert seen["stats"]["rebuilt"] is None and min(seen["rank_bytes"]) > 0

    # Dropped from memory only: every rank's files stay as saved (autosave, with the new
    # turn); the one tab then holds a new session.
    assert seen["after_drop"]["tabs"] == ["chat-1"]
    assert seen["after_drop"]["notices"][-1] == (
        "Saved big on every rank and dropped it from memory (kvchat launch -- --resume big "
        "reopens it)."
    )
    folder = store.session_dir("big")
    saved = json.loads((folder / "session.json").read_bytes())
    assert saved["messages"][-2]["content"] == "and more"
    shard = folder / "cache.rank1.safetensors"
    assert saved["cache"]["shards"] == [hashlib.sha256(shard.read_bytes()).hexdigest()]
    assert load_prompt_cache(str(shard))[0].offset == len(saved["ledger"]) > len(ledger)


@pytest.mark.timeout(60)
def test_a_model_no_rank_can_load_ends_the_run_with_rank_0s_sentence_only(home, tmp_path):
    missing = tmp_path / "no-model"
    run = kvchat("launch", "-n", "2", "--port", str(_free_port()), "--", "--model", str(missing))
    assert run.returncode == 2
    assert run.stderr == (
        f"kvchat: Could not load model '{missing}': there is no such folder, "
        "and it is not a Hugging Face model id either. Use --model demo, or "
        "pass the path of a downloaded mlx-lm model folder.\n"
    )
    log = Path(os.environ["KVCHAT_CACHE_DIR"]) / "ranks.log"  # rank 1's output: not shown
    assert f"kvchat (rank 1): Could not load model '{missing}'" in log.read_text()


@pytest.mark.skipif(
    shutil.which("ssh") is None, reason="no ssh client on this machine (CI installs openssh-client)"
)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["192.0.2.1", "silent"])
def test_a_host_ssh_cannot_reach_ends_the_run_in_one_sentence_within_its_timeout(
    demo_model, home, tmp_path, host
):
    """192.0.2.1 (TEST-NET-1) refuses here and drops packets elsewhere; a port that takes
    the connection but never says a word is ssh's connect timeout at work."""
    kept = Session(demo_model)
    kept.settings.max_tokens = 2
    [_ for _ in kept.send("hello")]
    store.save(kept, "kept")
    before = {p.name: p.read_bytes() for p in store.session_dir("kept").iterdir()}
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        if host == "silent":
            host = f"ssh://127.0.0.1:{silent.getsockname()[1]}"
            why = "Connection timed out during banner exchange"
        else:
            why = "ssh: connect to host 192.0.2.1 port 22: [^)]+"
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(
            json.dumps(
                {"hosts": [{"ssh": LOCAL, "ips": [LOCAL]}, {"ssh": host, "ips": ["127.0.0.1"]}]}
            )
        )
        run = run_bounded(  # the bound: ssh's 2 s, and the start and end of rank 0
            [
                *CLI,
                "launch",
                "--hostfile",
                str(hostfile),
                "--port",
                str(_free_port()),
                "--",
                "--model",
                "demo",
            ],
            30,
            {**os.environ, "KVCHAT_SSH_TIMEOUT": "2"},
        )
    assert run.returncode == 1 and run.stdout == ""
    assert re.fullmatch(
        f"kvchat: could not reach {re.escape(host)} over ssh within 2 s \\({why}\\), so the run "
        "was ended on every rank; saved sessions are as they were last saved\\.\n",
        run.stderr,
    )
    assert {p.name: p.read_bytes() for p in store.session_dir("kept").iterdir()} == before


def _driver(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return run_bounded(
        [
            sys.executable,
            "-m",
            "tests.tui.sharded_driver",
            str(_free_port()),
            str(tmp_path / "ranks.log"),
            *args,
        ],
        80,
        {**os.environ, "PYTHONPATH": os.getcwd()},
    )


# ------------------------------------------------------------- without launching


def test_local_ranks_get_a_ring_hostfile_of_loopback_ports_and_mlx_launchs_script():
    hosts = ring_hosts(2, None, None).hosts
    assert [h.ssh_hostname for h in hosts] == [LOCAL, LOCAL]
    text = ring_hostfile(hosts, 5000)
    assert json.loads(text) == [["127.0.0.1:5000"], ["127.0.0.1:5001"]]
    command = follower_command(1, hosts[1], text)
    assert not command.startswith("ssh")
    assert "export MLX_HOSTFILE=$fname;" in command
    assert f"echo {shlex.quote(text)} >$fname;" in command
    assert "export MLX_RANK=1;" in command
    assert f"cmd=({shlex.quote(sys.executable)} -c " in command


def test_other_hosts_are_reached_by_ssh_with_every_ip_a_port(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps(
            {
                "envs": ["MLX_X=a b"],
                "hosts": [
                    {"ssh": "mac1", "ips": ["10.0.0.1"]},
                    {"ssh": "mac2", "ips": ["10.0.0.2", "10.0.1.2"]},
                ],
            }
        )
    )
    parsed = ring_hosts(2, None, hostfile)  # -n counts for --hosts only, as in mlx.launch
    text = ring_hostfile(parsed.hosts, 4000)
    assert json.loads(text) == [["10.0.0.1:4000"], ["10.0.0.2:4001", "10.0.1.2:4002"]]
    command = follower_command(1, parsed.hosts[1], text, parsed.envs, tmp_path / "ssh log")
    assert command.startswith(
        "ssh -tt -o LogLevel=ERROR -o BatchMode=yes -o ConnectTimeout=10 "
        f"-E '{tmp_path / 'ssh log'}' mac2 '"
    )
    monkeypatch.setenv("KVCHAT_SSH_TIMEOUT", "3")
    assert " -o ConnectTimeout=3 " in follower_command(1, parsed.hosts[1], text)
    script = shlex.split(command)[-1]
    assert "export MLX_X='a b'; " in script and "export MLX_RANK=1;" in script
    listed = ring_hosts(1, "10.0.0.1,10.0.0.2", None)
    assert json.loads(ring_hostfile(listed.hosts, 7)) == [["10.0.0.1:7"], ["10.0.0.2:8"]]


@pytest.mark.parametrize(
    ("ranks", "hosts", "message"),
    [
        (1, "mac1,mac2", "The ring backend needs IP addresses, not host names"),
        (1, None, "A sharded run needs at least 2 ranks."),
        (2, "10.0.0.1,,10.0.0.2", "Hostname cannot be empty."),
    ],
)
def test_hosts_the_ring_cannot_use_are_refused_in_one_sentence(ranks, hosts, message):
    with pytest.raises(RingError, match=f"^{message}"):
        ring_hosts(ranks, hosts, None)


def test_a_rank_that_never_says_it_joins_ends_the_run_after_a_while(tmp_path, monkeypatch):
    monkeypatch.setattr(ring_module, "JOIN_S", 0.3)
    monkeypatch.setattr(ring_module, "LOST_S", 0.1)
    ring = Ring(ring_hosts(2, None, None), _free_port(), tmp_path / "ranks.log")
    ring.followers = [subprocess.Popen(["sleep", "30"])]  # alive, and silent
    ring._ready = [threading.Event()]
    assert ring.wait_ready() == (
        f"kvchat: rank 1 (127.0.0.1) did not start within 0.3 s (its output is in "
        f"{tmp_path / 'ranks.log'}), so the run was ended on every rank; saved sessions are "
        "as they were last saved."
    )
    assert ring.finish(False) == [None]  # ended by the ring


def test_without_ssh_a_run_on_other_hosts_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here
    assert [h.ssh_hostname for h in ring_hosts(2, None, None).hosts] == [LOCAL, LOCAL]
    result = CliRunner().invoke(app, ["launch", "-n", "1", "--hosts", "10.0.0.1,10.0.0.2", "--"])
    assert result.exit_code == 2
    assert result.output == (
        "kvchat: Starting a rank on 10.0.0.2 needs ssh, which is not "
        "installed here (on Debian or Ubuntu: apt-get install "
        "openssh-client).\n"
    )


def test_tui_options_are_read_by_kvchats_own_definitions():
    from kvchat.settings import FLAGS

    none = dict.fromkeys(s.name for s in FLAGS)
    assert tui_flags(
        ["--model", "demo", "--max-tokens", "8", "--top-k", "3", "--resume", "chat-1"]
    ) == {
        "model": "demo",
        "cache": None,
        "system": None,
        "resume": "chat-1",
        "flags": {**none, "max_tokens": 8, "top_k": 3},
    }
    assert tui_flags(["--system", "be brief ✓"])["system"] == "be brief ✓"
    assert tui_flags([]) == {**dict.fromkeys(("model", "cache", "system", "resume")), "flags": none}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "mpi", "--"], "kvchat: The TUI runs over the ring backend only"),
        (["--hosts", "mac1,mac2", "--"], "kvchat: The ring backend needs IP addresses"),
        (["--", "--max-tokens", "many"], "kvchat: Invalid value for '--max-tokens'"),
        (["-n", "1", "--", "--model", "demo"], "kvchat: A sharded run needs at least 2 ranks."),
    ],
)
def test_a_sharded_tui_that_cannot_start_says_why_before_starting_any_rank(args, message):
    result = CliRunner().invoke(app, ["launch", *args])
    assert result.exit_code == 2
    assert result.output.startswith(message)


def test_a_lost_rank_is_named_in_one_sentence():
    assert rank_ended(1, -9) == (
        "kvchat: rank 1 was killed by signal 9, so the run was ended "
        "on every rank; saved sessions are as they were last saved."
    )
    assert rank_ended(2, 3).startswith("kvchat: rank 2 exited with status 3, so")
