"""Joining prompts: which chunks a step evaluates, and several sequences' chunks in one
forward pass leave each cache as its own pass would."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from kvchat.engine.caches.kinds import held_tokens, make_cache, parse_kind
from kvchat.engine.conversation.events import GenerationSettings, Prefill
from kvchat.engine.generation import prefill
from kvchat.engine.generation.core import GenerationCore
from kvchat.engine.generation.pace import FLOOR, Pace
from kvchat.engine.generation.paths import numpy_rows
from kvchat.engine.generation.prefill import feed, plan
from kvchat.engine.generation.sampling import for_settings
from kvchat.engine.generation.sequence import Left, Request, Sequence, State
from tests.helpers import run_all


def _sequence(lm, prompt: list[int], step: int = 512, history: list[int] = (), **asked) -> Sequence:
    """A greedy sequence of 4 tokens on a cache holding ``history``; ``asked``: the
    request's other fields."""
    sampler, _ = for_settings(GenerationSettings(temp=0.0))
    cache = make_cache(lm.model, parse_kind("standard"))
    if history:
        lm.model(mx.array(list(history))[None], cache=cache)
        mx.eval([c.state for c in cache])
    asked = {"max_tokens": 4} | asked
    request = Request(prompt, sampler, [], stop=threading.Event(), prefill_step=step, **asked)
    return Sequence(request, State(cache, list(history)))


def test_short_prompts_go_together_and_a_long_one_goes_on_beside_them(demo_model):
    paste = _sequence(demo_model, list(range(1, 2001)))
    shorts = [_sequence(demo_model, list(range(10, 10 + n))) for n in (21, 9, 13)]
    chunks = plan([paste, *shorts], budget=512)
    # in line order; every chunk but the paste's is its whole body (the last token waits)
    assert [(s, len(t)) for s, t in chunks] == [
        (paste, 20),
        *((s, len(s.request.prompt) - 1) for s in shorts),
    ]
    assert chunks[0][1] == paste.request.prompt[:20]
    # alone, the paste gets a chunk of its prefill step
    assert [len(t) for _, t in plan([paste], budget=512)] == [512]
    # what the budget does not hold, padded to the widest, waits for the next step (the
    # paste here); the first in line goes on all the same, cut to the width
    got = [(s, len(t)) for s, t in plan([*shorts, paste], budget=40)]
    assert got == [(shorts[0], 12), (shorts[1], 8), (shorts[2], 12)]
    # a short follow-up is not padded to the width of longer prompts beside it
    longer = [_sequence(demo_model, list(range(100, 251))) for _ in range(2)]
    assert [(s, len(t)) for s, t in plan([shorts[1], *longer], budget=512)] == [(shorts[1], 8)]
    assert [len(t) for _, t in plan(longer, budget=512)] == [150, 150]


def test_chunks_fed_together_equal_chunks_fed_apart(demo_model):
    lm = demo_model
    specs = [([5, 6, 7, 8, 9, 10], list(range(30, 47))), ([], list(range(50, 55))), ([3], [61, 62])]
    runs = {}
    for together in (False, True):
        marked: list[tuple[int, int]] = []
        seqs: list[Sequence] = []

        def on_mark(n: int, out=marked, seqs=seqs) -> None:
            out.append((n, held_tokens(seqs[0].state.cache)))

        # a checkpoint mark inside the first chunk
        (history, prompt), *others = specs
        seqs.append(_sequence(lm, prompt, history=history, marks=frozenset({15}), on_mark=on_mark))
        seqs += [_sequence(lm, prompt, history=history) for history, prompt in others]
        while any(s.state.fed < len(s.request.prompt) - 1 for s in seqs):
            feed(lm.model, plan(seqs, budget=512), together)
        runs[together] = seqs, marked
    (apart, marked_apart), (joined, marked_joined) = runs[False], runs[True]
    assert marked_apart == marked_joined == [(15, 15)]
    for a, b, (history, prompt) in zip(apart, joined, specs):
        assert a.state.ledger == b.state.ledger == [*history, *prompt[:-1]]
        assert held_tokens(b.state.cache) == len(b.state.ledger) == b.state.cache[0].offset
        for x, y in zip(a.state.cache, b.state.cache):
            assert mx.abs(x.keys[..., : x.offset, :] - y.keys[..., : y.offset, :]).max() < 1e-5
            assert mx.abs(x.values[..., : x.offset, :] - y.values[..., : y.offset, :]).max() < 1e-5
        got = []
        while not b.channel.messages.empty():
            got.append(b.channel.messages.get())
        assert got[0] == Prefill(0, len(prompt)) and got[-1] == Prefill(
            len(prompt) - 1, len(prompt)
        )
        # the next token decodes as it does after the prefill apart
        la = lm.model(mx.array([[prompt[-1]]]), cache=a.state.cache)
        lb = lm.model(mx.array([[prompt[-1]]]), cache=b.state.cache)
        assert mx.abs(la - lb).max() < 1e-4


@pytest.mark.cpu_only  # the CPU fast path's numpy step
def test_short_prompts_go_whole_into_the_numpy_decode_step(demo_model, monkeypatch):
    """On the CPU fast path a short prompt gets no prefill pass: its tokens are rows of the
    decode step, beside a long paste's chunks; the replies are those of the separate
    prefill, and each ledger lists what its cache holds."""
    assert demo_model.fast_path.decodes
    history = demo_model.tokenizer.encode("The sea is wide and the sky is blue.")
    specs = [([], list(range(3, 203))), (history, list(range(40, 52))), ([], list(range(7, 27)))]
    fed, rows = [], []
    real_feed, real_step = prefill.feed, numpy_rows.decode_batch
    monkeypatch.setattr(prefill, "feed", lambda m, c, t: fed.extend(c) or real_feed(m, c, t))

    def step(model, tokens, caches):
        rows.append(tokens)
        return real_step(model, tokens, caches)

    monkeypatch.setattr(numpy_rows, "decode_batch", step)
    runs = {}
    for fast in (None, demo_model.fast_path):  # the separate prefill, then the folded one
        seqs = [_sequence(demo_model, p, step=64, history=h) for h, p in specs]
        got = run_all(GenerationCore(demo_model.model, fast_path=fast), seqs)
        runs[fast] = seqs, [got[id(s)] for s in seqs]
    (apart, _), (folded, messages) = runs[None], runs[demo_model.fast_path]
    assert {id(s) for s, _ in fed if s in folded} == {id(folded[0])}  # the paste alone
    short = sorted([specs[1][1], specs[2][1]])  # in whichever order their threads joined
    assert short in [sorted(r for r in step if len(r) > 1) for step in rows]
    for a, b, got, (h, p) in zip(apart, folded, messages, specs):
        assert b.state.tokens == a.state.tokens and len(b.state.tokens) == 4
        assert b.state.ledger == [*h, *p, *b.state.tokens[:-1]] == a.state.ledger
        assert held_tokens(b.state.cache) == len(b.state.ledger)
        assert got[0] == Prefill(0, len(p)) and got[-5:] == [*b.state.tokens, Left(stopped=False)]
    assert not any(isinstance(m, Prefill) for m in messages[2][1:])


def test_a_step_takes_a_paced_share_of_prompt_while_others_decode():
    pace = Pace(seconds=0.5)
    assert pace.budget(512, others_decoding=False) == 512  # nobody waits: the whole step
    assert pace.budget(512, others_decoding=True) == FLOOR  # no rate measured yet
    with pace.timed(100):
        time.sleep(0.2)
    assert 0 < pace.rate <= 100 / 0.2  # 100 tokens over at least 0.2 s
    assert pace.budget(512, others_decoding=True) == max(FLOOR, int(pace.rate * 0.5))
    assert pace.budget(512, others_decoding=False) == 512
    pace.rate = 10_000.0  # a fast device: the prefill step is the limit
    assert pace.budget(512, others_decoding=True) == 512
    pace.rate = 1.0  # a slow pass: never fewer than the floor
    assert pace.budget(512, others_decoding=True) == FLOOR
    assert pace.budget(8, others_decoding=True) == 8  # nor more than the prefill step
    # the budget caps the first in line's chunk too
    assert [len(t) for _, t in plan([_long_sequence()], budget=FLOOR)] == [FLOOR]


def _long_sequence() -> Sequence:
    sampler, _ = for_settings(GenerationSettings(temp=0.0))
    return Sequence(Request(list(range(3, 303)), sampler, [], 4, threading.Event()), State([], []))


def test_a_long_prompt_goes_in_beside_a_streaming_reply_not_before_it(demo_model):
    """While one sequence decodes, a joining paste gets a paced chunk a step, so the
    decoding one keeps getting tokens between the paste's chunks; both replies are
    those they get alone, and each ledger lists what its cache holds."""
    lm = demo_model
    paste = list(range(3, 303))
    alone = _sequence(lm, paste, step=512)
    run_all(GenerationCore(lm.model), [alone])
    core = GenerationCore(lm.model)
    core.pace = Pace(seconds=1e-9)  # every paced step: the floor
    streaming = _sequence(lm, list(range(40, 52)), max_tokens=60)
    second = _sequence(lm, paste, step=512)
    order: list[tuple[str, object]] = []
    reading = threading.Event()

    def stream() -> None:
        for message in core.run(streaming):
            order.append(("streaming", message))
            reading.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert reading.wait(60)
    order.extend(("paste", m) for m in core.run(second))
    thread.join(120)
    progress = [m.done for who, m in order if who == "paste" and isinstance(m, Prefill)]
    assert progress[0] == 0 and progress[-1] == len(paste) - 1  # the last: the decode step's
    assert max(b - a for a, b in zip(progress, progress[1:])) <= FLOOR
    assert len(progress) >= (len(paste) - 1) // FLOOR
    # the streaming reply got tokens between the paste's chunks, not only after them
    between = [
        sum(1 for who, m in order[i:j] if who == "streaming" and isinstance(m, int))
        for i, j in _gaps(order, "paste", Prefill)
    ]
    assert sum(1 for n in between if n) >= len(between) // 2, between
    assert second.state.tokens == alone.state.tokens and len(second.state.tokens) == 4
    for seq in (second, streaming):
        assert held_tokens(seq.state.cache) == len(seq.state.ledger)
    assert second.state.ledger == [*paste, *second.state.tokens[:-1]]


def _gaps(order: list[tuple[str, object]], who: str, kind: type) -> list[tuple[int, int]]:
    """The index spans between consecutive ``kind`` messages of ``who`` in ``order``."""
    at = [i for i, (w, m) in enumerate(order) if w == who and isinstance(m, kind)]
    return list(zip(at, at[1:]))


@pytest.mark.parametrize("threaded", [True, False])
def test_a_sharded_cores_chunks_are_not_paced_by_its_own_clock(demo_model, threaded):
    """Every rank of a sharded model must cut the same chunks, so its core (not threaded)
    takes the whole prefill step even while another sequence decodes."""
    core = GenerationCore(demo_model.model, threaded=threaded)
    core.pace = Pace(seconds=1e-9)
    paste = _sequence(demo_model, list(range(3, 303)), step=128)
    core.path.apart.append(_sequence(demo_model, [5, 6]))  # a row decoding meanwhile
    assert core.path.prefill(demo_model.model, [paste], core.pace) == ([], [])
    assert paste.state.fed == len(paste.state.ledger) == (FLOOR if threaded else 128)
    assert held_tokens(paste.state.cache) == paste.state.fed
