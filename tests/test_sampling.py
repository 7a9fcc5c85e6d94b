"""Sampling settings on the trained demo model: each one changes the reply as it should."""

from __future__ import annotations

import pytest

from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.engine.generation.sampling import for_settings


def reply(lm, text: str = "Tell me about the cache.", **settings) -> str:
    session = Session(lm, settings=GenerationSettings(**settings))
    return next(e for e in session.send(text) if isinstance(e, TurnDone)).reply


@pytest.fixture(params=["eager", "generate_step"])
def decoding(request, endless):
    """Both decoding loops: the CPU fast path's eager one and mlx-lm's ``generate_step``."""
    fast = endless.fast_path
    if fast is None and request.param == "eager":
        pytest.skip("the eager loop is the CPU fast path's; this model has none here")
    was = fast.on if fast else None
    if fast:
        fast.on = request.param == "eager"
    yield endless
    if fast:
        fast.on = was


@pytest.fixture
def ask(decoding):
    """Replies of 24 tokens whatever the model says (an end token does not cut them)."""
    return lambda **settings: reply(decoding, max_tokens=24, **settings)


def test_top_k_1_at_a_high_temperature_is_greedy(ask):
    greedy = ask(temp=0.0)
    assert ask(temp=1.5, top_k=1) == greedy
    assert ask(temp=1.5, top_k=1, seed=3) == greedy  # the seeded path too
    assert ask(temp=1.5, seed=3) != greedy  # without top_k it does sample


def test_a_seed_reproduces_a_sampled_reply(ask):
    first = ask(temp=1.2, top_p=0.95, min_p=0.02, seed=42)
    assert ask(temp=1.2, top_p=0.95, min_p=0.02, seed=42) == first
    assert ask(temp=1.2, top_p=0.95, min_p=0.02, seed=43) != first


def test_penalties_change_a_reply_that_repeats(decoding):
    endless, asked = decoding, "What is a hash table?"
    plain = reply(endless, asked, max_tokens=60)
    words = plain.split()
    assert len(words) > len(set(words))  # the greedy reply repeats itself
    penalised = reply(endless, asked, max_tokens=60, repetition_penalty=1.8)
    assert penalised != plain
    assert len(set(penalised.split())) / len(penalised.split()) > len(set(words)) / len(words)
    assert reply(endless, asked, max_tokens=60, frequency_penalty=2.0) != plain
    assert reply(endless, asked, max_tokens=60, presence_penalty=2.0) != plain


def test_no_processor_is_made_for_settings_that_are_off():
    sampler, processors = for_settings(GenerationSettings())
    assert processors == [] and sampler.__name__ == "greedy_sampler"
    _, processors = for_settings(GenerationSettings(repetition_penalty=1.3, presence_penalty=0.5))
    assert len(processors) == 2
