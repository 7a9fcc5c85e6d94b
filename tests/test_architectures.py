"""kvchat on tiny random-weight models of other mlx-lm architectures:
the ``arch`` fixture builds them from mlx-lm's own model classes (tests/arch_models.py)."""

from __future__ import annotations

import json
import re

import pytest
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine.caches import checkpoints
from kvchat.engine.caches.kinds import OFFERED_KINDS, CacheKindError, applicable_kinds
from kvchat.engine.conversation.events import GenerationSettings, TurnDone
from kvchat.engine.conversation.session import Session
from tests.arch_models import SHAPES
from tests.helpers import turn

GREEDY = GenerationSettings(max_tokens=6, temp=0.0)
FIRST = "The quick brown fox jumps over the lazy dog near the river bank today."
SECOND = "Tell me another story about the fox and the dog, please, a long one."
THIRD = "What colour is the fox?"


@pytest.mark.quantized_attention
def test_phi3_head_size_96_quantizes_in_groups_of_32(arch):
    lm = arch("phi3")
    quantized = Session(lm, kind="quantized:8", settings=GREEDY)
    assert {(type(c), c.group_size) for c in quantized.cache} == {(QuantizedKVCache, 32)}
    first = turn(quantized, "hello there")
    assert first.stats.evaluated_tokens == first.stats.prompt_tokens

    session = Session(lm, settings=GREEDY)
    turn(session, "hello there")
    assert session.set_kind("quantized:4") is None  # converted in place, no rebuild
    assert {c.group_size for c in session.cache} == {32}
    second = turn(session, "and again")
    assert second.stats.rebuilt is None and second.stats.reused_tokens > 0


UNROTATED = [k for k in OFFERED_KINDS if not k.startswith("rotated")]
FITTING = {  # docs/architecture.md's table: rotated:N needs kvchat's attention (llama models)
    "gemma2": ["standard", "rotating:4096", "concatenate"],
    "mamba": ["standard"],
    "falcon_h1": ["standard"],
    "phi3": UNROTATED,
    "gemma3_text": UNROTATED,
    "lfm2": UNROTATED,
}


@pytest.mark.quantized_attention
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_family_takes_the_kinds_the_docs_list(arch, name):
    lm = arch(name)
    fitting = applicable_kinds(lm.model, list(OFFERED_KINDS))
    assert fitting == FITTING.get(name, list(OFFERED_KINDS))
    for kind in fitting:
        session = Session(lm, kind=kind, settings=GREEDY)
        turn(session, FIRST)
        after = turn(session, SECOND)
        assert after.stats.rebuilt is None and after.stats.reused_tokens > 0


@pytest.mark.quantized_attention
def test_gemma2_refuses_quantized_kinds_and_keeps_the_session(arch):
    lm = arch("gemma2")
    with pytest.raises(CacheKindError, match="attention cannot read a quantized cache"):
        Session(lm, kind="quantized:8")
    with pytest.raises(CacheKindError, match="attention cannot read a chunked cache"):
        Session(lm, kind="chunked:2048")  # its own mask does not fit a chunked cache
    assert applicable_kinds(lm.model, list(OFFERED_KINDS)) == [
        "standard",
        "rotating:4096",
        "concatenate",
    ]

    session = Session(lm, settings=GREEDY)
    turn(session, "hello there")
    cache, ledger, messages = session.cache, list(session.ledger), list(session.messages)
    with pytest.raises(
        CacheKindError, match=r"^Cache kind 'quantized:4' cannot apply to this model"
    ):
        session.set_kind("quantized:4")
    assert session.kind.name == "standard"
    assert session.cache is cache and session.ledger == ledger and session.messages == messages
    after = turn(session, "and again")
    assert after.stats.rebuilt is None and after.stats.reused_tokens >= len(ledger) - 1


@pytest.mark.quantized_attention
@pytest.mark.parametrize("command, code", [("ask", 1), ("replay", 2)])
def test_cli_refuses_a_quantized_kind_in_one_sentence(arch, tmp_path, home, command, code):
    lm = arch("gemma2")
    if command == "ask":
        args = ["ask", "--model", str(lm.path), "--cache", "quantized:8", "hello"]
    else:
        script = tmp_path / "script.json"
        script.write_text('{"turns": ["hello"]}', encoding="utf-8")
        args = ["replay", str(script), "--model", str(lm.path), "--cache", "quantized:8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code
    out = result.output.strip()
    assert "Cache kind 'quantized:8' cannot apply to this model: its attention cannot read" in out
    assert "Traceback" not in out and len(out.splitlines()) == 1


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_saved_sessions_resume_from_disk(arch, home, name):
    lm = arch(name)
    session = Session(lm, settings=GREEDY)
    turn(session, "hello there")
    turn(session, "and again")
    folder = store.save(session, "chat")
    kept = [c.tokens for c in session.checkpoints.kept]  # none for a model that needs none
    assert bool(kept) == (name in {"gemma3_text", "lfm2", "mamba", "falcon_h1"})
    assert (folder / store.CHECKPOINTS_FILE).exists() == bool(kept)

    loaded = store.load("chat", lm)
    assert loaded.resumed_from_disk and loaded.notice is None
    assert loaded.session.ledger == session.ledger
    assert [c.tokens for c in loaded.session.checkpoints.kept] == kept
    resumed, live = turn(loaded.session, "one more"), turn(session, "one more")
    assert resumed.reply == live.reply
    assert resumed.stats.rebuilt is None
    assert resumed.stats.reused_tokens == live.stats.reused_tokens > 0
    assert resumed.stats.evaluated_tokens == live.stats.evaluated_tokens


def test_recurrent_state_whose_count_disagrees_is_rebuilt(arch, home):
    lm = arch("mamba")
    session = Session(lm, settings=GREEDY)
    turn(session, "hello there")
    folder = store.save(session, "chat")
    data = json.loads((folder / "session.json").read_text(encoding="utf-8"))
    data["ledger"] = data["ledger"][:-1]  # a transcript one token short of the saved state
    (folder / "session.json").write_text(json.dumps(data), encoding="utf-8")

    loaded = store.load("chat", lm)
    assert not loaded.resumed_from_disk
    assert "does not belong with session.json" in loaded.notice
    assert loaded.session.ledger == session.render(session.messages, False)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_cached_replies_equal_uncached_ones(arch, name):
    lm = arch(name)
    session = Session(lm, settings=GREEDY)
    turn(session, FIRST)
    cached = turn(session, SECOND)
    assert cached.stats.reused_tokens > 0
    fresh = Session(lm, settings=GREEDY, messages=session.messages[:-2])
    uncached = turn(fresh, SECOND)
    assert uncached.stats.reused_tokens == 0
    assert cached.reply == uncached.reply and cached.tokens == uncached.tokens


@pytest.mark.parametrize("name", ["gemma3_text", "mamba", "falcon_h1", "lfm2"])
def test_checkpoints_make_regenerate_and_undo_cheap(arch, name):
    lm = arch(name)
    session = Session(lm, settings=GREEDY)
    turn(session, FIRST)
    after_first = len(session.ledger)
    second = turn(session, SECOND)
    assert not all(c.is_trimmable() for c in session.cache)  # a wrapped window, a state
    assert second.stats.reused_tokens == after_first and second.stats.rebuilt is None

    again = [e for e in session.regenerate() if isinstance(e, TurnDone)][0]
    assert again.stats.evaluated_tokens == 0 and again.stats.rebuilt is None
    assert again.reply == second.reply  # greedy: the same reply from the same state

    session.undo()
    first_exchange = session.render(session.messages, False)
    assert session.ledger == first_exchange  # back to the checkpoint after the first reply
    third = turn(session, THIRD)
    assert third.stats.rebuilt is None
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens - len(first_exchange)
    fresh = Session(lm, settings=GREEDY, messages=session.messages[:-2])
    assert turn(fresh, THIRD).reply == third.reply


def test_checkpoints_are_bounded_and_a_rebuild_names_the_window(arch, monkeypatch):
    monkeypatch.setattr(checkpoints, "MAX_CHECKPOINTS", 2)
    session = Session(arch("gemma3_text"), settings=GREEDY)
    turn(session, FIRST)
    after_first = len(session.ledger)
    turn(session, SECOND)
    kept = session.checkpoints.kept
    assert len(kept) == 2 and kept[-1].tokens == len(session.ledger)
    assert session.checkpoints.nbytes == sum(c.nbytes for c in kept) > 0
    assert all(c.tokens > after_first for c in kept)  # the first turn's were dropped

    session.undo()
    assert session.ledger == [] and len(session.checkpoints) == 0
    third = turn(session, THIRD)
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens
    assert re.fullmatch(
        r"the standard cache could not be trimmed back to token \d+: it holds a "
        r"sliding window, and no checkpoint is that early",
        third.stats.rebuilt,
    )


def test_checkpoints_stay_within_their_memory_budget(arch, monkeypatch):
    session = Session(arch("mamba"), settings=GREEDY)  # its state is the same size at every token
    turn(session, FIRST)
    one = session.checkpoints.kept[-1].nbytes
    monkeypatch.setattr(checkpoints, "CHECKPOINT_BUDGET", one)
    turn(session, SECOND)
    assert [c.tokens for c in session.checkpoints.kept] == [len(session.ledger)]
    assert session.checkpoints.nbytes == one

    monkeypatch.setattr(checkpoints, "CHECKPOINT_BUDGET", one - 1)
    session.checkpoints.clear()
    turn(session, THIRD)
    assert len(session.checkpoints) == 0 and session.checkpoints.nbytes == 0


def test_a_rebuild_keeps_checkpoints_at_each_turn_end(arch):
    session = Session(arch("gemma3_text"), settings=GREEDY)
    for text in (FIRST, SECOND):
        turn(session, text)
    session.rebuild("a test")  # as a load from disk or a kind switch can
    first_exchange = session.render(session.messages[:2], False)
    assert first_exchange == session.ledger[: len(first_exchange)]
    assert len(first_exchange) in [c.tokens for c in session.checkpoints.kept]

    session.undo()
    assert session.ledger == first_exchange  # back to a checkpoint, not rebuilt
    third = turn(session, THIRD)
    assert third.stats.rebuilt is None
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens - len(first_exchange)


@pytest.mark.parametrize("name", ["gemma3_text", "falcon_h1"])
def test_a_fork_starts_from_a_checkpoint(arch, name):
    session = Session(arch(name), settings=GREEDY)
    for text in (FIRST, SECOND):
        turn(session, text)
    first_end = len(session.render(session.messages[:2], False))  # the first exchange's end
    assert first_end in [c.tokens for c in session.checkpoints.kept]
    child = session.fork_prefix(session.messages[:2])
    assert child.ledger == session.ledger[:first_end]
    forked = turn(child, THIRD)
    assert forked.stats.reused_tokens == first_end and forked.stats.rebuilt is None
    fresh = Session(session.lm, settings=GREEDY, messages=session.messages[:2])
    assert turn(fresh, THIRD).reply == forked.reply


def _conversed(lm) -> tuple[Session, int]:
    """A session of two turns on ``lm``; and the ledger length after the first."""
    session = Session(lm, settings=GREEDY)
    turn(session, FIRST)
    after_first = len(session.ledger)
    turn(session, SECOND)
    return session, after_first


@pytest.mark.parametrize("name", ["gemma3_text", "mamba"])
def test_checkpoints_are_saved_with_the_session(arch, home, name):
    lm = arch(name)
    session, after_first = _conversed(lm)
    kept = [c.tokens for c in session.checkpoints.kept]
    assert after_first in kept and kept[-1] == len(session.ledger)
    folder = store.save(session, "chat")
    record = json.loads((folder / "session.json").read_text(encoding="utf-8"))["checkpoints"]
    assert record["tokens"] == kept and record["file"] == store.CHECKPOINTS_FILE
    assert record["bytes"] == (folder / store.CHECKPOINTS_FILE).stat().st_size > 0

    loaded = store.load("chat", lm)
    assert loaded.resumed_from_disk and loaded.notice is None
    resumed = loaded.session
    assert [c.tokens for c in resumed.checkpoints.kept] == kept
    assert resumed.checkpoints.nbytes == session.checkpoints.nbytes
    again = [e for e in resumed.regenerate() if isinstance(e, TurnDone)][0]
    assert again.stats.evaluated_tokens == 0 and again.stats.rebuilt is None
    assert again.reply == session.messages[-1]["content"]

    resumed.undo()
    first_exchange = resumed.render(resumed.messages, False)
    assert resumed.ledger == first_exchange  # back to a checkpoint, not to nothing
    third = turn(resumed, THIRD)
    assert third.stats.rebuilt is None
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens - len(first_exchange)
    fresh = Session(lm, settings=GREEDY, messages=resumed.messages[:-2])
    assert turn(fresh, THIRD).reply == third.reply


def test_a_resume_with_saved_log_probabilities_runs_the_model_once(arch, home, monkeypatch):
    """The cache and the log-probabilities are both checked against one model step."""
    lm = arch("gemma3_text")
    session, _ = _conversed(lm)
    store.save(session, "chat")
    steps = []
    real = type(lm.model).__call__

    def counted(model, inputs, *args, **kwargs):
        steps.append(inputs.shape)
        return real(model, inputs, *args, **kwargs)

    monkeypatch.setattr(type(lm.model), "__call__", counted)
    loaded = store.load("chat", lm)
    assert steps == [(1, 1)]
    assert loaded.resumed_from_disk and loaded.notice is None
    at, logprobs = loaded.session.prompt_logprobs  # checked, and taken
    saved_at, saved = session.prompt_logprobs
    assert at == saved_at and (logprobs == saved).all().item()


def _forge(session: Session, damage: str) -> None:
    """Cut the last axis of one array of the newest checkpoint, or of the log-probabilities
    at the last prompt's end (a shape the model never makes)."""
    if damage == "logprobs":
        at, logprobs = session.prompt_logprobs
        session.prompt_logprobs = (at, logprobs[:-1])
        return
    layer = next(iter(session.checkpoints.kept[-1].layers.values()))
    if isinstance(layer, ArraysCache):
        layer.cache[0] = layer.cache[0][..., :1]
    else:
        layer.keys = layer.keys[..., :1]


@pytest.mark.parametrize(
    "name, damage, why",
    [
        ("gemma3_text", "flipped", r"checkpoints.safetensors is damaged \(its checksum differs"),
        (
            "gemma3_text",
            "forged",
            r"does not fit the cache: at token \d+, its RotatingKVCache has "
            r"keys of shape \(1, 1, n, 1\), the model makes \(1, 1, n, 32\)",
        ),
        ("mamba", "forged", r"does not fit the cache: at token \d+, its ArraysCache has state"),
        ("gemma3_text", "logprobs", r"does not fit the cache: its log-probabilities are not the "),
        ("mamba", "reordered", r"does not fit the cache: it holds checkpoints at tokens"),
        ("mamba", "missing", r"checkpoints.safetensors is missing"),
    ],
)
def test_bad_checkpoints_are_left_out_and_the_cache_resumes(arch, home, name, damage, why):
    lm = arch(name)
    session, after_first = _conversed(lm)
    if damage in ("forged", "logprobs"):  # saved for real: session.json has the checksum
        _forge(session, damage)
    folder = store.save(session, "chat")
    path, json_path = folder / store.CHECKPOINTS_FILE, folder / "session.json"
    if damage == "flipped":
        raw = bytearray(path.read_bytes())
        raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])
        path.write_bytes(bytes(raw))
    elif damage == "reordered":
        data = json.loads(json_path.read_text(encoding="utf-8"))
        data["checkpoints"]["tokens"].reverse()
        json_path.write_text(json.dumps(data), encoding="utf-8")
    elif damage == "missing":
        path.unlink()

    loaded = store.load("chat", lm)
    assert loaded.resumed_from_disk and loaded.session.ledger == session.ledger
    assert len(loaded.session.checkpoints) == 0
    assert re.search(why, loaded.notice), loaded.notice
    assert loaded.notice.startswith("The saved checkpoints were not used (")
    assert loaded.notice.endswith("until new ones are kept.") and loaded.notice.count(". ") == 0

    loaded.session.undo()  # no checkpoint: back to nothing, rebuilt by the next turn
    third = turn(loaded.session, THIRD)
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens and third.stats.rebuilt
    fresh = Session(lm, settings=GREEDY, messages=session.messages[:2])
    assert turn(fresh, THIRD).reply == third.reply


def test_ask_says_why_saved_checkpoints_were_left_out(arch, home):
    lm = arch("mamba")
    ask = ["ask", "--model", str(lm.path), "--session", "chat", "--max-tokens", "4"]
    assert CliRunner().invoke(app, [*ask, FIRST]).exit_code == 0
    path = store.session_dir("chat") / store.CHECKPOINTS_FILE
    path.write_bytes(path.read_bytes()[:-4])  # cut short: its checksum no longer matches
    result = CliRunner().invoke(app, [*ask, SECOND])
    assert result.exit_code == 0
    assert (
        f"kvchat: The saved checkpoints were not used ({path} is damaged (its checksum "
        "differs from the one in session.json)); the cache was"
    ) in result.output
    assert "rebuilt" not in result.output


def test_a_save_writes_only_the_newest_checkpoints_that_fit_its_budget(arch, home, monkeypatch):
    from kvchat.store import checkpoint_file

    lm = arch("mamba")
    session, _ = _conversed(lm)
    kept = session.checkpoints.kept
    assert len(kept) > 2
    monkeypatch.setattr(checkpoint_file, "SAVED_BYTES", kept[-1].nbytes + kept[-2].nbytes)
    store.save(session, "chat")
    loaded = store.load("chat", lm)
    assert loaded.resumed_from_disk and loaded.notice is None
    assert [c.tokens for c in loaded.session.checkpoints.kept] == [c.tokens for c in kept[-2:]]
    again = [e for e in loaded.session.regenerate() if isinstance(e, TurnDone)][0]
    assert again.stats.evaluated_tokens == 0 and again.stats.rebuilt is None
