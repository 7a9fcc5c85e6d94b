"""Checkpoints are dropped only when what they describe changed: a kind switch that converts
only the plain key/value layers keeps them, and a turn whose prefill starts far back keeps
one at each turn end it passes. Counted in evaluated tokens, on tiny random models of
sliding-window and recurrent architectures (tests/arch_models.py)."""

from __future__ import annotations

import pytest

from kvchat.engine.conversation.events import GenerationSettings, TurnDone
from kvchat.engine.conversation.session import Session
from tests.helpers import turn

GREEDY = GenerationSettings(max_tokens=6, temp=0.0)
FIRST = "The quick brown fox jumps over the lazy dog near the river bank today."
SECOND = "Tell me another story about the fox and the dog, please, a long one."
THIRD = "What colour is the fox?"
FOURTH = "Where does the dog sleep at night?"


@pytest.mark.quantized_attention
@pytest.mark.parametrize("name", ["gemma3_text", "lfm2"])
def test_a_switch_to_a_quantized_kind_keeps_the_checkpoints(arch, name):
    session = Session(arch(name), settings=GREEDY)
    turn(session, FIRST)
    after_first = len(session.ledger)
    turn(session, SECOND)
    kept = [c.tokens for c in session.checkpoints.kept]
    assert after_first in kept

    assert session.set_kind("quantized:8") is None  # converted in place
    assert [c.tokens for c in session.checkpoints.kept] == kept
    # The log-probabilities came from full-precision keys: the prompt's end is evaluated
    # again, from a checkpoint, not from nothing.
    again = [e for e in session.regenerate() if isinstance(e, TurnDone)][0]
    assert again.stats.rebuilt is None
    assert again.stats.reused_tokens in kept and again.stats.reused_tokens >= after_first
    assert again.stats.evaluated_tokens == again.stats.prompt_tokens - again.stats.reused_tokens

    session.undo()
    first_exchange = session.render(session.messages, False)
    assert session.ledger == first_exchange  # back to a checkpoint, not to nothing
    third = turn(session, THIRD)
    assert third.stats.rebuilt is None
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens - len(first_exchange)


@pytest.mark.parametrize("name", ["gemma3_text", "mamba", "falcon_h1"])
def test_a_turn_that_prefills_from_far_back_keeps_checkpoints_at_the_turn_ends_it_passes(
    arch, name
):
    session = Session(arch(name), settings=GREEDY)
    turn(session, FIRST)
    turn(session, SECOND)
    session.reset()  # the next turn evaluates the whole transcript again
    third = turn(session, THIRD)
    assert third.stats.evaluated_tokens == third.stats.prompt_tokens
    two_exchanges = session.render(session.messages[:4], False)
    assert session.ledger[: len(two_exchanges)] == two_exchanges
    assert len(two_exchanges) in [c.tokens for c in session.checkpoints.kept]

    session.undo()
    assert session.ledger == two_exchanges  # back to a checkpoint, not to nothing
    fourth = turn(session, FOURTH)
    assert fourth.stats.rebuilt is None
    assert fourth.stats.evaluated_tokens == fourth.stats.prompt_tokens - len(two_exchanges)
    fresh = Session(arch(name), settings=GREEDY, messages=session.messages[:-2])
    assert turn(fresh, FOURTH).reply == fourth.reply
