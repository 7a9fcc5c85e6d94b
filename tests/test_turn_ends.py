"""Where a refill keeps checkpoints: the turn ends found from the newest back, in a bounded
number of renderings, are the newest of those that rendering every prefix finds."""

from __future__ import annotations

import pytest

from kvchat.engine.caches import checkpoints
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.conversation.session import Session
from tests.conftest import DROPPING_TEMPLATE
from tests.helpers import turn

TURNS = 20


def every_turn_end(session: Session, messages: list[dict], tokens: list[int]) -> set[int]:
    """The straightforward way: each prompt's and each reply's rendering, every one that is
    a prefix of ``tokens``."""
    ends = set()
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt, reply = messages[:i], messages[: i + 1]
            for part in (session.render(prompt, True), session.render(reply, False)):
                if tokens[: len(part)] == part:
                    ends.add(len(part))
    return ends


def transcript() -> list[dict]:
    messages = []
    for i in range(TURNS):
        messages += [
            {"role": "user", "content": f"Question {i} about the fox and the dog?"},
            {
                "role": "assistant",
                "content": f"<think>\nThe fox, {i}.\n</think>\nAnswer {i}: the dog sleeps.",
            },
        ]
    return messages


@pytest.mark.parametrize("limit", [3, checkpoints.MAX_CHECKPOINTS])
@pytest.mark.parametrize("template", ["own", "drops-earlier-thoughts"])
@pytest.mark.parametrize("name", ["mamba", "gemma3_text"])
def test_turn_ends_are_the_newest_of_every_prefixes_in_few_renderings(
    arch, monkeypatch, name, template, limit
):
    lm = arch(name)
    if template != "own":  # the replies' earlier renderings are not prefixes of the whole
        monkeypatch.setattr(lm.tokenizer._tokenizer, "chat_template", DROPPING_TEMPLATE)
    monkeypatch.setattr(checkpoints, "MAX_CHECKPOINTS", limit)
    session = Session(lm, messages=transcript())
    messages, tokens = session.messages, session.render(session.messages, False)
    every = sorted(every_turn_end(session, messages, tokens))
    assert len(every) > limit and (len(every) == 2 * TURNS) == (template == "own")

    rendered = []
    render = session.render
    monkeypatch.setattr(
        session, "render", lambda m, g, **kw: rendered.append(len(m)) or render(m, g, **kw)
    )
    for after in (0, every[len(every) // 2], every[-2], every[-1]):
        rendered.clear()
        want = [e for e in every if e > after][-limit:]
        assert session.turn_ends(messages, tokens, after) == frozenset(want), after
        assert len(rendered) <= 2 * limit  # at most `limit` replies looked at, newest first


def test_a_rebuild_keeps_the_checkpoints_that_every_prefix_would_give(arch, monkeypatch):
    lm = arch("mamba")
    session = Session(lm, settings=GenerationSettings(max_tokens=3, temp=0.0))
    for i in range(TURNS):  # more turn ends than checkpoints are kept
        turn(session, f"Question {i} about the fox?")
    reference = Session(lm, settings=session.settings, messages=list(session.messages))
    monkeypatch.setattr(
        reference,
        "turn_ends",
        lambda m, t, after=0, **_: frozenset(every_turn_end(reference, m, t)),
    )
    for s in (session, reference):
        s.rebuild("a test")
    every = every_turn_end(session, session.messages, session.ledger)
    assert len(every) > checkpoints.MAX_CHECKPOINTS
    kept = [c.tokens for c in session.checkpoints.kept]
    assert kept == [c.tokens for c in reference.checkpoints.kept]
    assert len(kept) == checkpoints.MAX_CHECKPOINTS and session.ledger == reference.ledger
    assert turn(session, "And now?").reply == turn(reference, "And now?").reply
