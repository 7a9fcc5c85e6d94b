"""A model sharded over MLX distributed ranks: two local ranks over the ring
backend on loopback, started by `kvchat launch`, against one process.

Each launch costs a few seconds (every rank imports mlx-lm, and with it transformers,
which reads its own source tree; rank 1 then often waits a second for rank 0 to
listen), so the scenarios share few launches: one replay, then three `ask --session`
runs on one session (create, resume, lose rank 1 mid-turn); the one process they are
held against runs in the test's own. The rest are unit tests that launch nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache
from mlx_lm.utils import load_model
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.cli.launch import _run
from kvchat.engine.caches.cache_check import Reference
from kvchat.engine.conversation.events import GenerationSettings, TokenLogprobs, TurnOptions
from kvchat.engine.conversation.session import Session, SessionError, TurnDone
from kvchat.engine.models import demo
from kvchat.engine.models.model import ModelLoadError
from kvchat.engine.sharding.driver import (
    LOCAL,
    UNSHARED,
    ShardedSession,
    bind,
    options_from,
    perform,
)
from kvchat.engine.sharding.link import Link, OpError, decode_op, encode_op
from kvchat.engine.sharding.sharded_model import choose_mode, layout, layout_problem
from kvchat.runtime import sessions
from kvchat.store.cache_file import read_cache
from kvchat.store.shards import delete_shard, write_shard
from tests.arch_models import TINY
from tests.helpers import LOSING_RANK_1, run_bounded, turn

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]
SCRIPT = {
    "system": "You are terse.",
    "turns": [
        "hello there",
        "what is a cache?",
        {"op": "regenerate"},
        "tell me more",
        {"op": "undo"},
        {"op": "cache", "kind": "quantized:8"},
        "and a map?",
    ],
}
COMPARED = (
    "op",
    "reply",
    "prompt_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "generated_tokens",
    "cache_tokens",
    "rebuilt",
)


def _free_port() -> int:
    """A port such that it and the next one are free (the ring backend uses one per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65000:
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free pair of ports")


def kvchat(*args, env=None, timeout=60):
    return run_bounded([*CLI, *args], timeout, {**os.environ, **(env or {})})


def launched(*args, env=None):
    """`kvchat launch -n 2 -- ARGS` over the ring backend on loopback."""
    return kvchat("launch", "-n", "2", "--port", str(_free_port()), "--", *args, env=env)


def launched_losing_rank_1(*args):
    """As :func:`launched`, through kvchat launch's own runner (its one-sentence report),
    with rank 1 killing itself in the middle of each turn."""
    runner = str(Path(sys.executable).with_name("mlx.launch"))
    argv = [
        runner,
        "-n",
        "2",
        "--backend",
        "ring",
        "--python",
        sys.executable,
        "--starting-port",
        str(_free_port()),
        "--",
        "-c",
        LOSING_RANK_1,
        *args,
    ]
    run = "import sys; from kvchat.cli.launch import _run; sys.exit(_run(sys.argv[1:]))"
    return run_bounded([sys.executable, "-c", run, *argv], 60, dict(os.environ))


def in_this_process(*args) -> str:
    """What `kvchat ARGS` prints, run by this process (a model it loads is one process's,
    and the test spares a start of Python and mlx-lm), with the CPU fast path off: the
    sharded model runs mlx-lm's generate_step, and so does one process without it."""
    run = CliRunner().invoke(app, list(args), env={"KVCHAT_CPU_FASTPATH": "0"})
    assert run.exit_code == 0, run.output
    return run.stdout


def replayed_alike(*args) -> list[dict]:
    """The turns of `replay ARGS --json` on two ranks, after checking that their replies
    and token counts are one process's."""
    two = launched(*args)
    assert two.returncode == 0, two.stderr
    sharded = json.loads(two.stdout)["turns"]
    single = json.loads(in_this_process(*args))["turns"]
    assert [[t.get(k) for k in COMPARED] for t in sharded] == [
        [t.get(k) for k in COMPARED] for t in single
    ]
    return sharded


@pytest.mark.timeout(120)
def test_replay_on_two_ranks_gives_the_replies_and_token_counts_of_one_process(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    args = ("replay", str(script), "--json", "--max-tokens", "12")
    sharded = replayed_alike(*args)
    replies = [t["reply"] for t in sharded if "reply" in t]
    assert len(replies) == 5 and all(replies) and replies[1] == replies[2]  # greedy regenerate
    assert sharded[1]["reused_tokens"] > 0 and sharded[2]["evaluated_tokens"] == 0


@pytest.mark.timeout(90)
def test_tensor_parallel_replay_gives_the_replies_of_one_process(tmp_path):
    """The demo's one KV head only allows a pipeline; this tiny qwen2 has two, so its
    attention and MLP are split over the ranks and every layer ends in an all-sum. The
    session starts on a quantized cache, which the ranks try out on the model together
    (rank 0 alone would wait on rank 1 forever)."""
    folder = tmp_path / "qwen2-kv2"
    folder.mkdir()
    tokenizer = demo.train_tokenizer()
    config = demo.model_config(
        {
            **TINY,
            "model_type": "qwen2",
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
        tokenizer,
    )
    demo.write_model(folder, config, tokenizer)
    assert choose_mode(*load_model(folder, lazy=True), 2, "tiny") == "tensor"
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"turns": ["hello there", "and then?", {"op": "regenerate"}]}))
    args = (
        "replay",
        str(script),
        "--model",
        str(folder),
        "--json",
        "--max-tokens",
        "6",
        "--cache",
        "quantized:8",
    )
    sharded = replayed_alike(*args)
    assert sharded[1]["reused_tokens"] > 0 and sharded[1]["reply"] == sharded[2]["reply"]
    assert [t["generated_tokens"] for t in sharded] == [6, 6, 6]  # random weights: no end token


@pytest.mark.timeout(180)
def test_ask_resumes_sharded_cache_files_and_a_lost_rank_damages_nothing(demo_model):
    base = ("ask", "-s", "dist", "--json", "--max-tokens", "8")
    first = launched(*base, "hello there")
    assert first.returncode == 0, first.stderr
    r1 = json.loads(first.stdout)
    folder = store.session_dir("dist")
    saved = json.loads((folder / "session.json").read_bytes())
    assert saved["model_fingerprint"] == demo_model.fingerprint + "+pipeline2"
    shard = (folder / "cache.rank1.safetensors").read_bytes()
    assert saved["cache"]["shards"] == [hashlib.sha256(shard).hexdigest()]
    assert len(saved["ledger"]) == r1["cache_tokens"]

    # Sampled at a temperature: every rank must still take the same tokens.
    second = launched(*base, "--temp", "0.9", "and more")
    assert second.returncode == 0, second.stderr
    r2 = json.loads(second.stdout)
    messages = [*saved["messages"], {"role": "user", "content": "and more"}]
    prompt = Session(demo_model, messages=messages).render(messages, True)
    assert r2["resumed_from_disk"] is True and r2["notice"] is None
    assert r2["prompt_tokens"] == len(prompt)
    assert r2["reused_tokens"] == len(saved["ledger"])  # only the new message is evaluated
    assert r2["evaluated_tokens"] == len(prompt) - len(saved["ledger"])
    saved = json.loads((folder / "session.json").read_bytes())
    for name in ("cache.safetensors", "cache.rank1.safetensors"):  # each rank's own layer
        cache, meta = load_prompt_cache(str(folder / name), return_metadata=True)
        assert meta["ledger"] == ",".join(map(str, saved["ledger"]))
        assert len(cache) == 1 and cache[0].offset == len(saved["ledger"]) == r2["cache_tokens"]

    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    lost = launched_losing_rank_1(*base, "a third question")
    assert lost.returncode == 1 and lost.stdout == ""
    assert lost.stderr == (  # one sentence: no traceback, no echo of the ring's errors
        "kvchat: rank 1 was killed by signal 9, so the run was ended on every rank; "
        "saved sessions are as they were last saved.\n"
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    loaded = store.load("dist", demo_model)  # on one machine: rebuilt from the transcript
    assert loaded.notice == (
        "The saved cache was not used (it was saved sharded over 2 ranks (pipeline parallel) "
        "and this run is on one machine); it was rebuilt from the transcript."
    )
    assert loaded.session.messages == json.loads(before["session.json"])["messages"]
    assert [m["content"] for m in loaded.session.messages[-4:]] == [
        "hello there",
        r1["reply"],
        "and more",
        r2["reply"],
    ]


# ------------------------------------------------------------- without launching


def test_a_session_on_one_machine_is_a_plain_session_that_the_store_keeps(demo_model, home):
    """No link, no driver: a model on one machine gets the conversation layer's Session,
    and the store saves and loads it (a sharded model's would go to every rank)."""
    chat = sessions.new_session(
        demo_model,
        kind="quantized:8",
        system="Be terse.",
        settings=GenerationSettings(max_tokens=4),
    )
    assert type(chat) is Session and chat.system == "Be terse." and chat.kind.name == "quantized:8"
    turn(chat, "hello")
    sessions.save_session(chat, "local")
    loaded = sessions.load_session("local", demo_model)
    assert type(loaded.session) is Session and loaded.resumed_from_disk
    assert loaded.session.ledger == chat.ledger and loaded.session.messages == chat.messages


def test_ops_travel_as_json_bytes_and_anything_else_is_refused():
    op = {"op": "send", "text": "héllo ✓ \x00", "settings": {"temp": 0.0}}
    assert decode_op(encode_op(op)) == op
    assert encode_op({"op": "end"}) == b'{"op":"end"}'
    for bad in (b"\xff\xfe", b"[1, 2]", b'{"op": "format-disk"}', b"{"):
        with pytest.raises(OpError, match="out of step"):
            decode_op(bad)
    with pytest.raises(OpError):
        encode_op({"op": "nope"})


def test_a_link_of_one_rank_sends_ops_and_gathers_rows():
    link = Link(mx.distributed.init())
    assert link.size == 1
    op = {"op": "load", "name": "x", "data": {"messages": [{"role": "user", "content": "é" * 999}]}}
    assert link.broadcast(op) == op
    assert link.gather(b"sha:abc") == [b"sha:abc"]
    assert link.total(7) == 7


def test_layouts_are_told_apart_in_words():
    assert layout("abc") == "on one machine"
    assert layout("abc+tensor2") == "sharded over 2 ranks (tensor parallel)"
    assert layout_problem("abc+pipeline4", "abc+pipeline2") == (
        "it was saved sharded over 4 ranks (pipeline parallel) and this run is sharded over "
        "2 ranks (pipeline parallel)"
    )
    assert layout_problem("abc", "abc") is None
    assert layout_problem("other+tensor2", "abc") is None  # another model: said elsewhere


def test_a_session_saved_on_one_machine_resumed_sharded_is_rebuilt_with_a_notice(demo_model):
    chat = Session(demo_model)
    chat.settings.max_tokens = 4
    next(e for e in chat.send("hello") if isinstance(e, TurnDone))
    store.save(chat, "single")
    sharded = replace(demo_model, fingerprint=demo_model.fingerprint + "+tensor2")
    loaded = store.load("single", sharded)
    assert loaded.notice == (
        "The saved cache was not used (it was saved on one machine and this run is sharded "
        "over 2 ranks (tensor parallel)); it was rebuilt from the transcript."
    )
    assert loaded.session.ledger == chat.render(chat.messages, False)


def test_sharding_is_tensor_where_heads_divide_else_pipeline_else_one_sentence(demo_model):
    config = json.loads((demo_model.path / "config.json").read_text())
    assert config["num_key_value_heads"] == 1  # the demo's one KV head cannot be split
    model, _ = load_model(demo_model.path, lazy=True)  # as sharding loads it: mlx-lm's own
    assert choose_mode(model, config, 2, "demo") == "pipeline"
    assert choose_mode(model, {**config, "num_key_value_heads": 2}, 2, "demo") == "tensor"
    with pytest.raises(ModelLoadError, match=r"^'demo' cannot be sharded over 4 ranks: .*\.$"):
        choose_mode(model, config, 4, "demo")


@pytest.mark.parametrize(
    "args",
    [
        ["launch", "--", "serve"],
        ["launch", "--", "sessions"],
        ["launch", "--", "--model", "demo", "doctor"],
    ],
)
def test_launch_runs_only_the_tui_ask_and_replay(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "A sharded run runs the TUI (`kvchat launch -n N -- [options]`;" in result.output


def test_a_sharded_session_shares_its_stop_and_refuses_what_it_cannot_send(demo_model):
    link = Link(mx.distributed.init())
    chat = ShardedSession(link, bind(Session(demo_model), link))
    events = chat.send("hello there")
    chat.stop()  # before the first token: every rank reads rank 0's flag at the same check
    [done] = [e for e in events if isinstance(e, TurnDone)]
    assert done.stopped and done.stats.generated_tokens == 0
    assert chat.messages[-1] == {"role": "assistant", "content": "", "stopped": True}
    with pytest.raises(SessionError, match="^A sharded run cannot switch branch yet;"):
        chat.switch_branch(0, 1)
    abandoned = chat.send("again")
    next(abandoned)
    abandoned.close()  # rank 0 left a turn the followers are still in: nothing more is sent
    with pytest.raises(SessionError, match="out of step"):
        chat.reset()


def test_a_restore_from_the_archive_is_an_op_every_rank_performs(demo_model):
    """Rank 0 sends it (the followers' caches follow theirs), and a follower performs it."""
    link = Link(mx.distributed.init())
    settings = GenerationSettings(max_tokens=4)
    chat = ShardedSession(link, bind(Session(demo_model, settings=settings), link))
    follower = Session(demo_model, settings=settings)
    for session in (chat, follower):
        for text in ("one", "two"):
            list(session.send(text))
        session.undo()
    undone = chat.archived
    assert [m["content"] for m in undone if m["role"] == "user"] == ["two"]
    chat.restore_archived(0)
    perform(follower, decode_op(encode_op({"op": "restore", "index": 0})), link)
    for session in (chat, follower):
        assert session.messages[-2:] == undone and session.archived == []
    assert chat.ledger == follower.ledger


class Recording(Link):
    """A link that keeps each operation rank 0 sends (as it travels: encoded, decoded)."""

    def __init__(self, group):
        super().__init__(group)
        self.sent: list[dict] = []

    def broadcast(self, op=None):
        received = super().broadcast(op)
        self.sent.append(received)
        return received


def test_a_turns_options_go_to_every_rank_with_its_op(demo_model):
    """Rank 0 sends the request's options with the turn's op (every rank samples, feeds and
    reports alike); a follower's turn from that op is rank 0's, and neither session takes
    the options as its own settings. Logits processors cannot travel: refused, nothing sent."""
    link = Recording(mx.distributed.init())
    own = GenerationSettings(max_tokens=6)
    chat = ShardedSession(link, bind(Session(demo_model, settings=own), link))
    follower = Session(demo_model, settings=replace(own))
    options = TurnOptions(
        settings=GenerationSettings(max_tokens=3, temp=1.0, seed=4, ignore_eos=True),
        start="Well,",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        variables={"enable_thinking": False},
        report_logprobs=2,
    )
    mine = list(chat.send("hello there", options))
    [op] = [o for o in link.sent if o["op"] == "send"]
    assert options_from(op["options"]) == options and op["settings"] == asdict(own)
    theirs = list(perform(follower, op, link))
    said = []
    for events in (mine, theirs):
        [done] = [e for e in events if isinstance(e, TurnDone)]
        assert done.reply.startswith("Well,") and done.stats.generated_tokens == 3
        reported = [(e.token, len(e.top)) for e in events if isinstance(e, TokenLogprobs)]
        assert reported == [(t, 2) for t in done.tokens]
        said.append((done.reply, done.tokens))
    assert said[0] == said[1] and chat.ledger == follower.ledger
    assert chat.settings == own == follower.settings == GenerationSettings(max_tokens=6)

    sent = len(link.sent)
    with pytest.raises(SessionError, match="^A sharded run cannot constrain a reply's tokens"):
        chat.send("again", TurnOptions(logits_processors=(lambda tokens, logits: logits,)))
    assert len(link.sent) == sent and chat.messages == follower.messages


LOST = (  # what mlx.launch relays when rank 1 is killed mid-turn (a line of rank 0's cut)
    "kvchat: a notice\n",
    "[ring] Socket",
    "\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m\n",
    " 4 was closed by the peer\n",
    "kvchat (rank 0): the run failed: boom\n",
    "\x1b[33m[WARN] Node with rank 0 exited with code -15 \x1b[0m\n",
)
RANK0 = (
    "kvchat: No saved session named 'x'.\n",
    "[WARN] Node with rank 0 exited with code 2\n",
    "[WARN] Node with rank 1 was killed\n",
)


@pytest.mark.parametrize(
    ("lines", "code", "err"),
    [
        (
            LOST,
            1,
            "kvchat: a notice\nkvchat: rank 1 was killed by signal 9, so the run was ended "
            "on every rank; saved sessions are as they were last saved.\n",
        ),
        (RANK0, 2, "kvchat: No saved session named 'x'.\n"),
    ],
)
def test_launch_names_the_rank_that_ended_the_run_and_nothing_else(lines, code, err, capfd):
    fake = f"import sys\nfor piece in {list(lines)!r}:\n    sys.stderr.write(piece); sys.stderr.flush()"
    assert _run([sys.executable, "-c", fake]) == code
    assert capfd.readouterr().err == err


def test_a_rank_reads_its_own_shard_only_as_session_json_vouches_for_it(demo_model):
    chat = Session(demo_model)
    chat.settings.max_tokens = 4
    [_ for _ in chat.send("hello")]
    sha = write_shard(chat, "shards", 1)  # what rank 1 writes (here the whole cache)
    store.save(chat, "shards", shards=[sha])
    folder, data = store.session_dir("shards"), store.read("shards")
    assert data["cache"]["shards"] == [sha]

    def read(rank=1):
        empty = Session(demo_model)
        reference = Reference(empty.cache, demo_model.model)
        return read_cache(folder, data, demo_model, data["ledger"], empty, reference, rank)

    cache, ledger, problem = read()
    assert problem is None and ledger == chat.ledger and cache[0].offset == len(chat.ledger)
    assert read(rank=2)[2] == f"{folder / 'cache.rank2.safetensors'} is missing"
    shard = folder / "cache.rank1.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert read()[2] == (f"{shard} is damaged (its checksum differs from the one in session.json)")
    store.save(chat, "shards")  # saved again on one machine: the shard is of no use now
    assert sorted(p.name for p in folder.iterdir()) == [
        "cache.safetensors",
        "cache.sha256",
        "session.json",
    ]


def test_a_dropped_shard_takes_its_folder_only_where_nothing_else_is_in_it(
    demo_model, home, tmp_path
):
    chat = Session(demo_model)
    chat.settings.max_tokens = 4
    [_ for _ in chat.send("hello")]
    write_shard(chat, "alone", 1)  # a host that keeps rank 1's shard only
    delete_shard("alone", 1)
    assert not os.path.lexists(store.session_dir("alone"))
    store.save(chat, "both", shards=[write_shard(chat, "both", 1)])  # ranks on one machine
    delete_shard("both", 1)
    assert sorted(p.name for p in store.session_dir("both").iterdir()) == [
        "cache.safetensors",
        "cache.sha256",
        "session.json",
    ]  # rank 0's: store.delete's
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cache.rank1.safetensors").write_bytes(b"kept")
    store.session_dir("link").symlink_to(elsewhere)
    with pytest.raises(store.StoreError, match="is a symbolic link, not a session folder"):
        delete_shard("link", 1)
    assert (elsewhere / "cache.rank1.safetensors").read_bytes() == b"kept"


def test_every_public_name_of_a_session_is_sent_to_every_rank_read_locally_or_refused(
    demo_model,
):
    """A sharded run's session sends the operations it defines to every rank, reads the
    LOCAL names from rank 0's session and refuses the UNSHARED ones: every public method,
    property and attribute of a Session is one of the three, so that a new one cannot
    run on rank 0 alone unnoticed (``complete`` and ``answer`` once did)."""
    names = {n for n in dir(Session(demo_model)) if not n.startswith("_")}
    sent = {n for n in vars(ShardedSession) if not n.startswith("_")} - {"count_bytes"}
    assert {"send", "edit", "regenerate", "undo", "reset", "settings"} <= sent
    assert not (sent & LOCAL) and not (sent & UNSHARED) and not (LOCAL & UNSHARED)
    assert names - sent - LOCAL - UNSHARED == set(), "say how a sharded run does these"
    assert (LOCAL | UNSHARED) - names == set(), "names a Session no longer has"
    assert {"complete", "answer"} <= UNSHARED
