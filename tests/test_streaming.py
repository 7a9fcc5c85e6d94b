"""Replies stream as text, the transcript keeps exactly the generated text, and the
figures of a turn say what happened."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from kvchat.cli import stream_reply
from kvchat.engine.caches.kinds import allocated_bytes, cache_bytes, compacted
from kvchat.engine.conversation.session import (
    Chunk,
    GenerationSettings,
    Prefill,
    Session,
    TurnDone,
)
from kvchat.engine.conversation.text import ReplyText
from kvchat.safety import printable

SYSTEM = "You are terse."
MESSAGES = ["Hello there.", "What is a cache?", "Tell me more.", "And then?", "Thanks."]


def events_of(session: Session, text: str) -> list:
    return list(session.send(text))


def test_chunks_count_the_reply_s_tokens_as_they_come(endless):
    """Each piece says how many tokens the reply has so far (a live count and rate):
    rising, and the last one the turn's generated tokens."""
    session = Session(endless, settings=GenerationSettings(max_tokens=20))
    events = events_of(session, "Count with me.")
    counts = [e.tokens for e in events if isinstance(e, Chunk)]
    assert counts == sorted(counts) and counts[0] >= 1
    assert counts[-1] == events[-1].stats.generated_tokens == 20


def test_chunks_carry_the_reply_before_the_turn_ends(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=24))
    for text in MESSAGES[:3]:
        events = events_of(session, text)
        done = events[-1]
        assert isinstance(done, TurnDone)
        pieces = [e.text for e in events if isinstance(e, Chunk)]
        assert "".join(pieces) == done.reply != ""
        assert all(pieces), "every chunk carries text"
        assert len(pieces) > 1, "the reply arrives in pieces, not in one block at the end"
        first_chunk = next(i for i, e in enumerate(events) if isinstance(e, Chunk))
        assert first_chunk < len(events) - 1


def test_transcript_holds_exactly_the_decoded_reply(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=24))
    tokenizer = demo_model.tokenizer
    for text in MESSAGES[:3]:
        done = events_of(session, text)[-1]
        tokens = list(done.tokens)
        assert len(tokens) == done.stats.generated_tokens
        # the cache holds the prompt and every generated token but (at most) the last
        assert session.ledger[done.stats.prompt_tokens :] in (tokens, tokens[:-1])
        eos = tokenizer.eos_token_ids
        reply_tokens = [t for t in tokens if t not in eos]
        assert done.reply == tokenizer.decode(reply_tokens)
        assert session.messages[-1]["content"] == done.reply


def test_leading_space_of_the_first_token_is_kept(demo_model):
    """The demo's replies often start with a space token: mlx-lm's BPE detokenizer drops it."""
    tokenizer = demo_model.tokenizer
    space_word = tokenizer.encode(" str", add_special_tokens=False)
    text = ReplyText(tokenizer)
    streamed = "".join(text.add(t) for t in space_word * 3) + text.finish()
    assert streamed == " str str str" == text.text


@pytest.mark.parametrize("kind", ["standard", "rotating:128", "quantized:8"])
def test_follow_ups_evaluate_only_the_new_message(demo_model, kind):
    """Each follow-up reuses the whole ledger of the turn before: the reply re-renders
    to the tokens that were generated, so only the new message and template tokens are
    evaluated, and nothing is rebuilt (a rotating cache that wrapped never needs a trim)."""
    session = Session(
        demo_model, kind=kind, system=SYSTEM, settings=GenerationSettings(max_tokens=32)
    )
    events_of(session, MESSAGES[0])
    for text in MESSAGES[1:]:
        before = list(session.ledger)
        done = events_of(session, text)[-1]
        prompt = session.render(session.messages[:-1], True)
        assert prompt[: len(before)] == before
        assert done.stats.reused_tokens == len(before)
        assert done.stats.evaluated_tokens == len(prompt) - len(before)
        assert done.stats.evaluated_tokens < 40
        assert done.stats.rebuilt is None


def test_incomplete_character_never_reaches_the_text(demo_model):
    tokenizer = demo_model.tokenizer
    snowman = tokenizer.encode("☃ x", add_special_tokens=False)
    text = ReplyText(tokenizer)
    pieces = [text.add(t) for t in snowman]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + text.finish() == "☃ x"
    cut = ReplyText(tokenizer)
    byte_tokens = tokenizer.encode("☃", add_special_tokens=False)
    if len(byte_tokens) > 1:  # a character spread over byte tokens, cut after the first
        assert cut.add(byte_tokens[0]) == "" and cut.finish() == ""


def test_stop_during_prefill_reports_what_reached_the_cache(demo_model):
    settings = GenerationSettings(max_tokens=8, prefill_step=16)
    session = Session(demo_model, system=SYSTEM, settings=settings)
    done = None
    for event in session.send(" ".join(MESSAGES * 8)):
        if isinstance(event, Prefill) and event.done >= 32:
            session.stop()
        if isinstance(event, TurnDone):
            done = event
    stats = done.stats
    assert stats.stopped and stats.generated_tokens == 0 and stats.ttft_s == 0.0
    # The core prefills on its own thread, so the stop lands a chunk or more after the
    # event that asked for it; what reached the cache is whole chunks, and said exactly.
    held = len(session.ledger)
    assert stats.evaluated_tokens == held == stats.cache_tokens
    assert 32 <= held < stats.prompt_tokens - 1 and held % 16 == 0


def test_undo_and_trim_take_their_turns_stats_along(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=8))
    for text in MESSAGES[:4]:
        events_of(session, text)
    assert len(session.turns) == 4
    list(session.regenerate())
    assert len(session.turns) == 4, "a regenerate replaces the stats of the reply it replaces"
    session.undo()
    assert len(session.turns) == 3
    assert session.last_stats.prompt_tokens < session.render(session.messages, False).__len__()
    dropped = session.trim_history(len(session.render(session.messages, False)) - 1)
    assert dropped == 2 and len(session.turns) == 2
    assert len(session.turns) == sum(m["role"] == "assistant" for m in session.messages)


def test_rebuild_notes_belong_to_the_turn_that_rebuilt(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=8))
    events_of(session, MESSAGES[0])
    session.set_kind("rotating:128")  # rebuilt from the transcript, whole again
    assert session.pending_rebuild is None
    done = events_of(session, MESSAGES[1])[-1]
    assert done.stats.rebuilt is None and done.stats.reused_tokens > 0
    assert session.reset() is True
    assert session.pending_rebuild == "the cache was reset"
    done = events_of(session, MESSAGES[2])[-1]
    assert done.stats.rebuilt == "the cache was reset" and done.stats.reused_tokens == 0
    assert events_of(session, MESSAGES[3])[-1].stats.rebuilt is None
    empty = Session(demo_model, system=SYSTEM)
    assert empty.reset() is False and empty.pending_rebuild is None


def test_bytes_count_the_live_tokens_and_saves_write_only_them(demo_model, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=16))
    for text in MESSAGES[:3]:
        events_of(session, text)
    tokens = session.cache_tokens
    per_token = session.cache_bytes / tokens
    assert session.allocated_bytes > session.cache_bytes  # buffers grow 256 slots at a time
    full = tokens * per_token
    assert session.cache_bytes == full
    session.undo(2)
    assert session.cache_bytes == session.cache_tokens * per_token < full
    assert allocated_bytes(session.cache) > cache_bytes(session.cache)

    save_prompt_cache(str(tmp_path / "c.safetensors"), compacted(session.cache))
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert all(c.keys.shape[-2] == session.cache_tokens for c in loaded)
    assert cache_bytes(loaded) == allocated_bytes(loaded) == session.cache_bytes


def test_ask_streams_each_piece_before_the_turn_ends(demo_model, monkeypatch):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=24))
    order: list[tuple[str, str]] = []

    class Out(io.StringIO):
        def write(self, text):
            order.append(("write", text))
            return super().write(text)

    def watched(events):
        for event in events:
            order.append(("event", type(event).__name__))
            yield event

    out = Out()
    monkeypatch.setattr(sys, "stdout", out)
    done = stream_reply(watched(session.send(MESSAGES[0])), echo=True)
    assert out.getvalue() == printable(done.reply) + "\n"
    first_text = next(i for i, (k, v) in enumerate(order) if k == "write" and v.strip())
    turn_done = order.index(("event", "TurnDone"))
    assert first_text < turn_done


def test_ask_prints_the_reply(demo_model, tmp_path):
    env = {"KVCHAT_HOME": str(tmp_path / "home")}

    def run(*args):
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "from kvchat.cli import main; main()",
                "ask",
                "--max-tokens",
                "16",
                *args,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=120,
        )

    plain = run("--stats", "Hello there.")
    as_json = run("--json", "Hello there.")
    assert plain.returncode == 0 and as_json.returncode == 0, plain.stderr + as_json.stderr
    reply = json.loads(as_json.stdout)["reply"]
    assert reply.strip()
    assert plain.stdout == printable(reply) + "\n"
    assert "prompt tokens" in plain.stderr and "evaluated" in plain.stderr


def test_ctrl_c_during_ask_keeps_the_partial_reply(tmp_path):
    import signal

    from kvchat.engine.models.demo import build_demo

    build_demo("random")  # built here, so the Ctrl-C lands in the reply, not in a build
    env = {**os.environ, "KVCHAT_HOME": str(tmp_path / "home")}
    # the random-weight demo never ends its turn: the reply is still running at the Ctrl-C
    # As from a shell: Ctrl-C raises KeyboardInterrupt, whatever the test process's threads
    # left in the signal mask and dispositions a child inherits (seen: a run where it was
    # blocked, so the reply ran to its end)
    start = (
        "import signal; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from kvchat.cli import main; main()"
    )
    cmd = [
        sys.executable,
        "-c",
        start,
        "ask",
        "--session",
        "s",
        "--model",
        "demo:random",
        "--max-tokens",
        "12000",
        "Tell me everything.",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(40)  # the reply is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"interrupted; saved session s." in err and b"Traceback" not in err
    saved = json.loads((tmp_path / "home" / "sessions" / "s" / "session.json").read_text())
    last = saved["messages"][-1]
    assert last["role"] == "assistant" and last["stopped"] is True
    assert printable(last["content"]).encode().startswith(first)
    again = subprocess.run(
        cmd[:-3] + ["--max-tokens", "4", "--json", "And now?"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reply"]
    saved = json.loads((tmp_path / "home" / "sessions" / "s" / "session.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][1] == last


def test_a_save_writes_only_the_live_tokens(demo_model, tmp_path, monkeypatch):
    from mlx_lm.models.cache import load_prompt_cache

    from kvchat import store

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=16))
    for text in MESSAGES[:3]:
        events_of(session, text)
    session.undo()
    folder = store.save(session, "live")
    loaded = load_prompt_cache(str(folder / store.CACHE_FILE))
    assert {c.keys.shape[-2] for c in loaded} == {session.cache_tokens}
    assert cache_bytes(loaded) == session.cache_bytes < session.allocated_bytes
