"""Decoding a step ahead on MLX's own path: the core feeds the token it just sampled
before reading it, and samples the token after it in the same graph, so the next step
computes while this one's token is read and posted (as mlx-lm's ``generate_step``
does). The replies are mlx-lm's own, token for token, and whenever a sequence leaves
(its length, an end token, a stop, a consumer gone) its cache holds exactly its
ledger: the token it ended on, fed ahead, is trimmed again.

The demo model's CPU fast path is switched off here (its numpy step computes as it goes
and decodes nothing ahead); on a GPU that is the path every model takes."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvchat.engine.caches.kinds import held_tokens, make_cache, parse_kind
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import for_settings
from kvchat.engine.generation.sequence import Request, Sequence, State
from tests.helpers import run_all

PROMPT_TEXT = "Tell me about the sea and the ships on it."


@pytest.fixture
def mlx_path(demo_model, monkeypatch):
    monkeypatch.setattr(demo_model.fast_path, "on", False)
    return demo_model


def _sequence(lm, prompt, max_tokens, eos=frozenset(), stop=None, **asked) -> Sequence:
    """A greedy sequence on a fresh cache; ``asked``: the request's other fields."""
    asked = {"sampler": for_settings(GenerationSettings(temp=0.0))[0], "processors": []} | asked
    request = Request(
        list(prompt), max_tokens=max_tokens, stop=stop or threading.Event(), eos=eos, **asked
    )
    return Sequence(request, State(make_cache(lm.model, parse_kind("standard")), []))


def _mlx_lm_tokens(lm, prompt, n: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt), lm.model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


def _contract(seq: Sequence, prompt: list[int]) -> None:
    assert seq.channel.left.is_set() and seq.state.ahead is None
    assert seq.state.ledger == [*prompt, *seq.state.tokens[:-1]]  # the token it ended on is not fed
    assert held_tokens(seq.state.cache) == len(seq.state.ledger)


def test_replies_are_mlx_lms_and_the_cache_holds_one_token_more_between_steps(mlx_path):
    prompt = mlx_path.tokenizer.encode(PROMPT_TEXT)
    reference = _mlx_lm_tokens(mlx_path, prompt, 24)
    seq = _sequence(mlx_path, prompt, 24)
    tokens, between = [], None
    for message in core_for(mlx_path).run(seq):
        if isinstance(message, int):
            tokens.append(message)
            if len(tokens) == 3:
                with GATE.exclusive():  # the core is between two steps
                    between = (
                        held_tokens(seq.state.cache),
                        len(seq.state.ledger),
                        seq.state.ahead,
                        seq.state.drawn,
                    )
                    between += (len(seq.state.tokens),)
    assert tokens == seq.state.tokens == reference
    held, ledger, ahead, drawn, read = between
    assert ahead is not None and held == ledger + 1  # the last token read, fed before it was
    # and the token after it sampled in the same graph: the step after reads it at once
    assert drawn is not None and drawn.item() == reference[read]
    _contract(seq, prompt)


@pytest.mark.parametrize("ending", ["length", "end token", "stop", "consumer gone"])
def test_a_sequence_that_leaves_has_the_token_fed_ahead_trimmed(mlx_path, ending):
    prompt = mlx_path.tokenizer.encode(PROMPT_TEXT)
    reference = _mlx_lm_tokens(mlx_path, prompt, 20)
    stop = threading.Event()
    seq = _sequence(
        mlx_path,
        prompt,
        max_tokens=9 if ending == "length" else 20,
        eos=frozenset({reference[6]}) if ending == "end token" else frozenset(),
        stop=stop,
    )
    stream = core_for(mlx_path).run(seq)
    for message in stream:
        if isinstance(message, int) and len(seq.state.tokens) >= 4:
            if ending == "stop":
                stop.set()
            elif ending == "consumer gone":
                stream.close()  # cancels, and returns once the sequence has left
                break
    assert seq.state.tokens == reference[: len(seq.state.tokens)]
    expected = {"length": 9, "end token": reference.index(reference[6]) + 1}
    if ending in expected:
        assert len(seq.state.tokens) == expected[ending]
    else:
        assert 4 <= len(seq.state.tokens) < 20
    _contract(seq, prompt)


def test_rows_merged_and_fed_ahead_leave_one_by_one_each_as_alone(mlx_path):
    prompts = [mlx_path.tokenizer.encode(f"{PROMPT_TEXT} " * (i + 1)) for i in range(3)]
    lengths = [5, 11, 16]
    alone = [_mlx_lm_tokens(mlx_path, p, n) for p, n in zip(prompts, lengths)]
    seqs = [_sequence(mlx_path, p, n) for p, n in zip(prompts, lengths)]
    core = core_for(mlx_path)
    run_all(core, seqs)  # all three submitted before the first step
    for seq, prompt, tokens in zip(seqs, prompts, alone):
        assert seq.state.tokens == tokens and seq.state.batch_peak == len(seqs)
        _contract(seq, prompt)
    # the caches given back are each sequence's own: a next turn continues from them
    again = _sequence(mlx_path, [*prompts[2], *seqs[2].state.tokens], 4)
    held = seqs[2].state
    again.state = State(held.cache, list(held.ledger), fed=len(held.ledger))
    list(core.run(again))
    fresh = _mlx_lm_tokens(mlx_path, [*prompts[2], *seqs[2].state.tokens], 4)
    assert again.state.tokens == fresh


def test_a_sequence_with_penalties_is_fed_ahead_but_samples_once_its_token_is_known(mlx_path):
    """A penalty looks at the tokens so far, the one fed ahead included: that row is not
    sampled ahead, and its reply is mlx-lm's with the same processors."""
    prompt = mlx_path.tokenizer.encode(PROMPT_TEXT)
    settings = GenerationSettings(temp=0.0, repetition_penalty=1.8, repetition_context_size=8)
    sampler, processors = for_settings(settings)
    reference = [
        int(token)
        for token, _ in generate_step(
            mx.array(prompt),
            mlx_path.model,
            max_tokens=24,
            sampler=lambda x: mx.argmax(x, axis=-1),
            logits_processors=for_settings(settings)[1],
        )
    ]
    assert reference != _mlx_lm_tokens(mlx_path, prompt, 24)  # the penalty does change it
    seq = _sequence(mlx_path, prompt, 24, sampler=sampler, processors=processors)
    seen = []
    for message in core_for(mlx_path).run(seq):
        if isinstance(message, int) and len(seq.state.tokens) == 3:
            with GATE.exclusive():
                seen.append((seq.state.ahead is not None, seq.state.drawn))
    assert seq.state.tokens == reference
    assert seen == [(True, None)]
    _contract(seq, prompt)


def test_a_row_reporting_log_probabilities_beside_rows_drawn_ahead(mlx_path):
    """A row that reports each token's log probabilities samples when its step reads it;
    the rows merged with it draw ahead; each reply is still mlx-lm's alone."""
    prompts = [mlx_path.tokenizer.encode(f"{PROMPT_TEXT} " * (i + 1)) for i in range(3)]
    alone = [_mlx_lm_tokens(mlx_path, p, 12) for p in prompts]
    seqs = [_sequence(mlx_path, p, 12, report_logprobs=i == 1) for i, p in enumerate(prompts)]
    run_all(core_for(mlx_path), seqs)
    for seq, prompt, tokens in zip(seqs, prompts, alone):
        assert seq.state.tokens == tokens and seq.state.batch_peak == len(seqs)
        _contract(seq, prompt)
    reported = seqs[1].state.sampled_logprobs
    assert len(reported) == 12
    assert [int(mx.argmax(row).item()) for row in reported] == seqs[1].state.tokens
    assert all(abs(mx.logsumexp(row).item()) < 1e-4 for row in reported)
    assert seqs[0].state.sampled_logprobs == seqs[2].state.sampled_logprobs == []
