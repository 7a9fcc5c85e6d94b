"""Sampling inside one batch: rows that sample alike go in one call, as mlx-lm's
``BatchGenerator`` does for a batch sharing its sampler, and every row still gets what
its own settings give it alone (a seed, penalties, filters), on the trained demo model."""

from __future__ import annotations

import threading
from dataclasses import replace

import mlx.core as mx
import pytest

from kvchat.engine.conversation.events import GenerationSettings, TurnDone
from kvchat.engine.conversation.session import Session
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import for_settings
from kvchat.engine.generation.sequence import Request, Sequence, State, sample_rows
from tests.helpers import start_together

SETTINGS = [
    GenerationSettings(temp=0.0),
    GenerationSettings(temp=0.0, repetition_penalty=1.8),
    GenerationSettings(temp=1.2, top_p=0.9, seed=5),
    GenerationSettings(temp=1.2, top_p=0.9, seed=6),
    GenerationSettings(temp=1.5, top_k=1),  # unseeded, but one token left: greedy
    GenerationSettings(temp=1.5, top_k=1),
    GenerationSettings(temp=0.0),
    GenerationSettings(temp=1.2, min_p=0.05, seed=5),
]


def _sequence(settings: GenerationSettings, report: bool = False) -> Sequence:
    sampler, processors = for_settings(settings)
    request = Request([1], sampler, processors, 1, threading.Event(), report_logprobs=report)
    return Sequence(request, State([], [1, 2, 3]))


def test_which_rows_sample_alike():
    keys = [_sequence(s).alike() for s in SETTINGS]
    assert keys[0] == keys[6] == "greedy"
    assert keys[4] == keys[5] == (1.0, 0.0, 1, 1.5)
    assert keys[1] is None  # a penalty looks at its own tokens
    assert keys[2] is keys[3] is keys[7] is None  # a seed draws from its own key
    assert _sequence(SETTINGS[0], report=True).alike() is None


def test_draws_that_differ_in_any_setting_do_not_sample_alike():
    """The key is every field of a draw but its random key: a field added later counts."""
    from dataclasses import fields, replace

    from kvchat.engine.generation.sampling import Draw, alike

    draw = Draw(top_p=0.9, min_p=0.05, top_k=40, temp=0.7)
    assert alike(draw) == alike(replace(draw)) == (0.9, 0.05, 40, 0.7)
    for f in fields(Draw):
        if f.name != "key":
            assert alike(replace(draw, **{f.name: getattr(draw, f.name) * 2})) != alike(draw)


def test_rows_sampled_together_are_each_rows_own_draw(demo_model):
    prompts = [demo_model.tokenizer.encode(f"Row {i} says") for i in range(len(SETTINGS))]
    logits = [demo_model.model(mx.array([p]))[:, -1, :] for p in prompts]
    together = sample_rows([(_sequence(s), row) for s, row in zip(SETTINGS, logits)]).tolist()
    alone = [
        _sequence(s).sample(row).item() for s, row in zip(SETTINGS, logits)
    ]  # each row alone: its own call, its own seeded key from the start
    assert len(together) == len(SETTINGS) and together == alone
    greedy = [int(mx.argmax(row).item()) for row in logits]
    assert [together[i] for i in (0, 4, 5, 6)] == [greedy[i] for i in (0, 4, 5, 6)]


def _reply(lm, settings: GenerationSettings, text: str) -> TurnDone:
    session = Session(lm, settings=settings)
    return next(e for e in session.send(text) if isinstance(e, TurnDone))


@pytest.mark.parametrize("path", ["CPU fast path", "MLX"])
def test_a_batch_of_mixed_settings_gives_each_reply_as_alone(endless, monkeypatch, path):
    if path == "MLX":  # merged batch caches, each step fed ahead: a GPU's path
        monkeypatch.setattr(endless.fast_path, "on", False)
    texts = [f"Tell me about the sea, part {i}." for i in range(len(SETTINGS))]
    settings = [replace(s, max_tokens=20, ignore_eos=True) for s in SETTINGS]
    alone = [_reply(endless, s, t) for s, t in zip(settings, texts)]
    results: list[TurnDone | None] = [None] * len(settings)

    def run(i: int) -> None:
        results[i] = _reply(endless, settings[i], texts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(settings))]
    start_together(core_for(endless), threads)  # every turn submitted before the first step
    for one, many in zip(alone, results):
        assert many is not None and many.stats.batch_size == len(settings)
        assert many.tokens == one.tokens and len(many.tokens) == 20
