"""The generation core: sequences decoding together give what each gives alone, and
every ledger lists exactly what its cache holds, whoever joins, leaves or is cancelled."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from kvchat.engine.caches.kinds import held_tokens, make_cache, parse_kind
from kvchat.engine.conversation.events import GenerationSettings, TurnDone
from kvchat.engine.conversation.session import Session
from kvchat.engine.generation.core import GenerationCore
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import for_settings
from kvchat.engine.generation.sequence import Left, Request, Sequence, State
from tests.helpers import run_all, start_together

QUESTIONS = [
    "What is a cache?",
    "Tell me about the sea.",
    "Why is the sky blue?",
    "Name three colours.",
    "How do birds fly?",
    "What is a number?",
    "Say something kind.",
    "Where do rivers go?",
]


def _reply(session: Session, text: str) -> TurnDone:
    done = None
    for event in session.send(text):
        if isinstance(event, TurnDone):
            done = event
    return done


def _together(sessions: list[Session], texts: list[str]) -> list[TurnDone]:
    """Send ``texts`` at once, one thread a session, all submitted before any step runs."""
    core = core_for(sessions[0].lm)
    results: list[TurnDone | None] = [None] * len(sessions)

    def run(i: int) -> None:
        results[i] = _reply(sessions[i], texts[i])

    start_together(core, [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))])
    return results


def _session(lm, max_tokens: int = 24) -> Session:
    return Session(
        lm,
        system="You are terse.",
        settings=GenerationSettings(max_tokens=max_tokens, ignore_eos=True),
    )


def test_eight_greedy_replies_in_a_batch_equal_each_alone(demo_model):
    alone = [_reply(_session(demo_model), q) for q in QUESTIONS]
    sessions = [_session(demo_model) for _ in QUESTIONS]
    batched = _together(sessions, QUESTIONS)
    for one, many, session in zip(alone, batched, sessions):
        assert many.tokens == one.tokens and many.reply == one.reply
        assert many.stats.batch_size == len(QUESTIONS) and one.stats.batch_size == 1
        # the contract: the cache holds the prompt and the reply but its last token
        assert held_tokens(session.cache) == len(session.ledger)
        assert session.ledger[-len(many.tokens) + 1 :] == list(many.tokens[:-1])
    # and a second turn of each, together again, matches its second turn alone
    again = _together(sessions, ["And then?"] * len(sessions))
    singles = [_session(demo_model) for _ in QUESTIONS]
    for s, q in zip(singles, QUESTIONS):
        _reply(s, q)
    for s, many in zip(singles, again):
        one = _reply(s, "And then?")
        assert many.tokens == one.tokens
        assert many.stats.reused_tokens == one.stats.reused_tokens > 0


class Recorder:
    """A logits processor that keeps what it is given (the row of this sequence)."""

    def __init__(self) -> None:
        self.rows: list[mx.array] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        row = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(row)  # on the core's thread, whose stream it was made on
        self.rows.append(row)
        return logits


def _sequence(lm, prompt: list[int], max_tokens: int, stop=None, processors=(), step=64):
    sampler, _ = for_settings(GenerationSettings(temp=0.0))
    request = Request(
        prompt=prompt,
        sampler=sampler,
        processors=list(processors),
        max_tokens=max_tokens,
        stop=stop or threading.Event(),
        prefill_step=step,
    )
    return Sequence(request, State(make_cache(lm.model, parse_kind("standard")), []))


def _prompts(lm, n: int) -> list[list[int]]:
    return [lm.tokenizer.encode(f"{q} " * (i + 1)) for i, q in enumerate(QUESTIONS[:n])]


@pytest.mark.parametrize("family", ["phi3", "lfm2", "mamba", "gemma2"])
def test_batched_log_probabilities_agree_with_alone(arch, family):
    lm = arch(family)
    core = core_for(lm)
    prompts = _prompts(lm, 4)
    alone = []
    for p in prompts:
        rec = Recorder()
        list(core.run(_sequence(lm, p, 6, processors=[rec])))
        alone.append(rec)
    recs = [Recorder() for _ in prompts]
    seqs = [_sequence(lm, p, 6, processors=[r]) for p, r in zip(prompts, recs)]
    run_all(core, seqs)
    if family == "gemma2":  # its attention does not take a batch cache's mask: rows apart
        assert [(s.state.batch_peak, s.state.not_batched) for s in seqs] == [
            (1, "model gemma2")
        ] * 4
    else:
        assert [(s.state.batch_peak, s.state.not_batched) for s in seqs] == [
            (len(prompts), None)
        ] * 4
    for one, many in zip(alone, recs):
        assert len(one.rows) == len(many.rows) == 6
        for a, b in zip(one.rows, many.rows):
            assert mx.abs(a - b).max().item() < 1e-4


@pytest.mark.parametrize("path", ["CPU fast path", "MLX"])
def test_join_leave_cancel_and_abandon_leave_the_others_as_alone(demo_model, monkeypatch, path):
    """On MLX's path (a GPU's) the batch merges, each step is fed ahead and its tokens
    sampled ahead: a newcomer joins a step whose rows' tokens were drawn before it."""
    if path == "MLX":
        monkeypatch.setattr(demo_model.fast_path, "on", False)
    lm = demo_model
    core = core_for(lm)
    prompts = _prompts(lm, 5)
    # Long enough that a stop or a consumer walking away at its second token takes effect
    # before the limit even when the consumer's thread lags the core by many tokens (a
    # loaded machine): the core decodes ahead of what its consumers have read.
    limit = 64
    alone = []
    for p in prompts:
        seq = _sequence(lm, p, limit)
        list(core.run(seq))
        alone.append(seq.state.tokens)
    stop = threading.Event()
    seqs = [
        _sequence(lm, p, limit if i != 1 else 4, stop=stop if i == 2 else None)
        for i, p in enumerate(prompts[:4])
    ]
    late = _sequence(lm, prompts[4], limit)
    joined = threading.Event()

    def on_token(seq, got):
        tokens = [m for m in got if isinstance(m, int)]
        if seq is seqs[0] and len(tokens) == 3 and not joined.is_set():
            joined.set()  # a newcomer joins the running batch
            threading.Thread(target=lambda: list(core.run(late))).start()
        if seq is seqs[2] and len(tokens) == 2:
            stop.set()  # a stop: it leaves after its next token
        return seq is seqs[3] and len(tokens) == 2  # a consumer that walks away

    out = run_all(core, seqs, on_token)
    late.channel.left.wait(60)
    assert seqs[0].state.tokens == alone[0] and late.state.tokens == alone[4]
    assert seqs[1].state.tokens == alone[1][:4]  # it left early (its length limit)
    for seq, row in ((seqs[2], alone[2]), (seqs[3], alone[3])):  # stopped, walked away
        assert seq.state.tokens == row[: len(seq.state.tokens)] and len(seq.state.tokens) < limit
    lefts = [m for m in out[id(seqs[2])] if isinstance(m, Left)]
    assert lefts == [Left(stopped=True)]
    for seq, prompt in zip([*seqs, late], prompts):
        assert seq.channel.left.is_set()
        assert seq.state.ledger == [*prompt, *seq.state.tokens[:-1]]
        assert held_tokens(seq.state.cache) == len(seq.state.ledger)


def test_a_sequence_its_reader_leaves_on_the_callers_thread_runs_no_further_step(demo_model):
    """A sharded model's core runs on the caller's thread; a reader that fails (there, a
    collective after a rank was lost) closes it between two steps, and no forward pass
    runs after that (a sharded one would wait forever on the lost rank)."""
    lm = demo_model
    prompt = _prompts(lm, 1)[0]
    alone = _sequence(lm, prompt, 12)
    list(core_for(lm).run(alone))
    seq = _sequence(lm, prompt, 12)
    read = []
    with pytest.raises(RuntimeError, match="the reader failed"):
        for message in GenerationCore(lm.model, threaded=False).run(seq):
            read += [message] if isinstance(message, int) else []
            if len(read) == 3:
                raise RuntimeError("the reader failed")
    assert seq.channel.left.is_set() and seq.state.tokens == read == alone.state.tokens[:3]
    assert seq.state.ledger == [*prompt, *read[:-1]]  # the last sampled token never fed
    assert held_tokens(seq.state.cache) == len(seq.state.ledger)


def _drain(core: GenerationCore, seq: Sequence, out: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.extend(core.run(seq)))
    thread.start()
    return thread


def test_a_first_step_waits_for_announced_turns_and_not_for_ever(demo_model, monkeypatch):
    """Turns announced with expect (a session announces its turn before tokenizing it)
    start in one step however far apart they are submitted, within GATHER_MAX_S; one
    announced and never submitted only delays the first step until that bound."""
    from kvchat.engine.generation import core as core_module

    core = GenerationCore(demo_model.model, fast_path=demo_model.fast_path)
    joining_at_steps: list[int] = []
    real_step = core._step
    monkeypatch.setattr(
        core, "_step", lambda: joining_at_steps.append(len(core._joining)) or real_step()
    )

    monkeypatch.setattr(core_module, "GATHER_MAX_S", 30.0)
    core.expect()
    core.expect()
    got_a, got_b = [], []
    a = _drain(core, _sequence(demo_model, [5, 6, 7], max_tokens=3), got_a)
    a.join(0.3)  # far longer than GATHER_S: unannounced, the first step would have run
    assert joining_at_steps == [] and not got_a
    b = _drain(core, _sequence(demo_model, [8, 9], max_tokens=3), got_b)
    a.join(60)
    b.join(60)
    assert joining_at_steps[0] == 2  # both in the first step
    assert isinstance(got_a[-1], Left) and isinstance(got_b[-1], Left)
    assert core._expected == []

    monkeypatch.setattr(core_module, "GATHER_MAX_S", 0.2)
    joining_at_steps.clear()
    core.expect()
    core.expect()  # never submitted
    got = []
    _drain(core, _sequence(demo_model, [5, 6, 7], max_tokens=3), got).join(60)
    assert joining_at_steps[0] == 1 and [m for m in got if isinstance(m, int)]
    assert isinstance(got[-1], Left) and got[-1].error is None


def test_a_sessions_turn_announces_itself_before_it_is_submitted(demo_model, monkeypatch):
    session = _session(demo_model, max_tokens=2)
    core = core_for(demo_model)
    events = []
    real_expect, real_run = core.expect, core.run
    monkeypatch.setattr(core, "expect", lambda: events.append("expect") or real_expect())
    monkeypatch.setattr(core, "run", lambda seq: events.append("run") or real_run(seq))
    done = _reply(session, "Hello there.")
    assert done is not None and len(done.tokens) == 2
    assert events == ["expect", "run"]
    with core._cond:
        assert not core._awaited()  # the announcement was consumed by the submission


def test_warm_up_runs_the_merge_probe_so_that_the_first_turn_does_not(kvchat_dirs, monkeypatch):
    """Whether rows merge is found out once per model by a probe of a few forward passes;
    ``warm_up`` (the TUI's loading worker, serve's start) runs it, and the first turn
    after it runs none. Without it, the first turn pays for it."""
    from kvchat.engine.generation import batch
    from kvchat.engine.generation.per_model import warm_up
    from kvchat.engine.models.model import load_model

    probed = []
    probe = batch._probe
    monkeypatch.setattr(batch, "_probe", lambda model: probed.append(model) or probe(model))
    warmed, cold = load_model("demo"), load_model("demo")  # fresh models: none probed yet
    warm_up(warmed)
    assert probed == [warmed.model]
    assert _reply(Session(warmed), "What is a cache?").stats.evaluated_tokens > 1
    assert probed == [warmed.model]
    assert _reply(Session(cold), "What is a cache?").stats.evaluated_tokens > 1
    assert probed == [warmed.model, cold.model]


def test_the_loop_threads_end_at_interpreter_exit(kvchat_dirs):
    """A core's loop thread idles up to 30 s after its last step; at interpreter exit it is
    ended first, so that no thread holds MLX's state as the process exits (that aborted a
    test run once, after every test passed: ml-explore/mlx#3126)."""
    import subprocess
    import sys

    script = (
        "import atexit, threading\n"  # registered first: runs after kvchat's own handlers
        "atexit.register(lambda: print(sorted(t.name for t in threading.enumerate())))\n"
        "from kvchat.engine.models.model import load_model\n"
        "from kvchat.engine.conversation.session import Session\n"
        "session = Session(load_model('demo'))\n"
        "list(session.send('Hello there.'))\n"
        "print([t.name for t in threading.enumerate() if t.name == 'kvchat-generation'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    during, after = done.stdout.splitlines()[-2:]
    assert during == "['kvchat-generation']"  # idle, alive, after the turn
    assert after == "['MainThread']"
