"""The batch invariant (kvchat/engine/generation/invariant.py): a sequence's tokens are
its own by identity, and, in debug mode (the suite's), a step after which a cache does
not hold its ledger fails the turn instead of going on."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from kvchat.engine.caches.kinds import make_cache, parse_kind
from kvchat.engine.generation.batch import Merged
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.invariant import debugging
from kvchat.engine.generation.paths.batched import feed_ahead
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import greedy_sampler
from kvchat.engine.generation.sequence import Left, Request, Sequence, State


def _sequence(lm, prompt: list[int], max_tokens: int = 12) -> Sequence:
    request = Request(prompt, greedy_sampler, [], max_tokens, threading.Event())
    return Sequence(request, State(make_cache(lm.model, parse_kind("standard")), []))


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_ledger_that_drifts_from_its_cache_fails_the_turn(demo_model, monkeypatch, fast_path):
    assert debugging()  # tests/conftest.py turns it on for the suite
    monkeypatch.setattr(demo_model.fast_path, "on", fast_path)
    seq = _sequence(demo_model, demo_model.tokenizer.encode("The sea and the ships."))
    messages, posted = [], None
    for message in core_for(demo_model).run(seq):
        messages.append(message)
        if posted is None and isinstance(message, int):
            with GATE.exclusive():  # between two steps: the ledger claims a token not fed
                seq.state.ledger.append(seq.state.ledger[-1])
                posted = len(seq.state.tokens)
    left = messages[-1]
    assert isinstance(left, Left) and isinstance(left.error, RuntimeError)
    assert "cache holds" in str(left.error)
    # the step after the break posted its token, then its check ended the turn
    assert sum(isinstance(m, int) for m in messages) == posted + 1 < seq.request.max_tokens


def test_tokens_fed_ahead_go_to_their_rows_by_identity(demo_model):
    """The batch's rows must be the step's, in the batch's order: otherwise one row's
    token would be fed to another's cache."""
    a, b = (_sequence(demo_model, p) for p in ([5, 6, 7], [8, 9]))
    for seq in (a, b):
        demo_model.model(mx.array([seq.request.prompt]), cache=seq.state.cache)
        seq.state.ledger.extend(seq.request.prompt)
    merged = Merged([a, b])
    with pytest.raises(RuntimeError, match="merged batch"):
        feed_ahead(demo_model.model, merged, [], mx.array([1, 2]), [b, a])
    feed_ahead(demo_model.model, merged, [], mx.array([1, 2]), [a, b])
    assert a.state.ahead is not None and b.state.ahead is not None
