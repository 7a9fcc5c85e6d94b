"""Reasoning models' <think> blocks: splitting a reply, and the turn after a reply with
thoughts under a template that drops them (as Qwen3's and DeepSeek-R1's do), on a real
demo model whose tokenizer_config.json carries such a template."""

from __future__ import annotations

import pytest

from kvchat.engine.conversation import template, turn
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.engine.conversation.thoughts import Thoughts, reevaluated_note, split_thoughts

THOUGHTFUL = (
    "<think>\nThe user greets me. I should greet back, briefly.\n</think>\n\nHello there, friend."
)
ANSWER = "Hello there, friend."


@pytest.mark.parametrize(
    "text, expected",
    [
        ("plain answer", Thoughts("", "plain answer")),
        ("<think>hmm</think>\n\nYes.", Thoughts("hmm", "Yes.")),
        (
            "Before. <think> a </think> middle <think> b </think> end",
            Thoughts("a\n\nb", "Before.  middle  end"),
        ),
        ("<think>still going", Thoughts("still going", "", thinking=True)),
        ("Sure. <think>", Thoughts("", "Sure. ", thinking=True)),
        ("opened by the prompt</think>The answer", Thoughts("opened by the prompt", "The answer")),
        ("<think></think>Only an answer", Thoughts("", "Only an answer")),
    ],
)
def test_split_thoughts(text, expected):
    assert split_thoughts(text) == expected


def _restored(lm, reply: str) -> Session:
    """A session whose cache holds a first exchange with ``reply`` as the template
    renders it when it is the last message (thoughts and all), as after a turn."""
    session = Session(
        lm,
        settings=GenerationSettings(max_tokens=6),
        messages=[{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": reply}],
    )
    session.rebuild("test")
    return session


def _turn(session: Session, text: str):
    before = list(session.ledger)
    done = [e for e in session.send(text) if isinstance(e, TurnDone)][0]
    return before, done.stats


@pytest.mark.parametrize("reply", [THOUGHTFUL, "<think>\n\n</think>\n\n" + ANSWER])
def test_the_turn_after_dropped_thoughts_counts_the_reevaluated_reply(dropping_model, reply):
    lm = dropping_model
    session = _restored(lm, reply)
    assert "</think>" in lm.tokenizer.decode(session.ledger)
    ledger, stats = _turn(session, "And how are you?")

    messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And how are you?"},
    ]
    prompt = session.render(messages, True)
    assert "think>" not in lm.tokenizer.decode(prompt)  # the template dropped them
    reused = common_prefix(ledger, prompt)
    assert reused == len(session.render(messages[:1], True))  # up to the reply's start
    # the reply as the template renders it now: its answer and its end
    answer_only = session.render([messages[0], {"role": "assistant", "content": ANSWER}], False)
    im_end = len(lm.tokenizer.encode("<|im_end|>\n", add_special_tokens=False))
    assert stats.reused_tokens == reused
    assert stats.reevaluated_reply_tokens == len(answer_only) - im_end - reused > 0
    assert stats.evaluated_tokens == len(prompt) - reused
    assert stats.to_dict()["reevaluated_reply_tokens"] == stats.reevaluated_reply_tokens
    assert reevaluated_note(stats.reevaluated_reply_tokens) == (
        f"the template drops earlier thoughts, so {stats.reevaluated_reply_tokens} tokens "
        "of the last reply were evaluated again"
    )

    # the cache is what a fresh run computes, and the next turn reuses it all again
    assert session.ledger[: len(prompt)] == prompt
    _, after = _turn(session, "Fine.")
    assert after.reevaluated_reply_tokens == 0


def test_the_turn_renders_its_prompt_once(dropping_model, monkeypatch):
    session = _restored(dropping_model, THOUGHTFUL)
    rendered = []
    real = template.template_text

    def counted(lm, messages, generation_prompt, *tools, **variables):
        rendered.append((len(messages), generation_prompt))
        return real(lm, messages, generation_prompt, *tools, **variables)

    monkeypatch.setattr(template, "template_text", counted)
    monkeypatch.setattr(turn, "template_text", counted)
    _, stats = _turn(session, "And how are you?")
    assert stats.reevaluated_reply_tokens > 0  # the reply was looked at
    assert rendered.count((3, True)) == 1  # the prompt, once; its text serves the count too


def test_a_reply_without_thoughts_is_reused_whole(dropping_model):
    session = _restored(dropping_model, ANSWER)
    ledger, stats = _turn(session, "And how are you?")
    assert stats.reevaluated_reply_tokens == 0
    assert stats.reused_tokens == len(ledger)


def test_a_template_that_keeps_thoughts_reevaluates_nothing(demo_model):
    session = _restored(demo_model, THOUGHTFUL)
    ledger, stats = _turn(session, "And how are you?")
    assert stats.reevaluated_reply_tokens == 0
    assert stats.reused_tokens == len(ledger)  # thoughts and all
    assert reevaluated_note(0) is None


def test_an_edit_before_the_reply_is_not_blamed_on_the_template(dropping_model):
    session = _restored(dropping_model, THOUGHTFUL)
    # an edit upstream
    session.replace_history([{"role": "user", "content": "Hello!"}, *session.messages[1:]])
    _, stats = _turn(session, "And how are you?")
    assert stats.reevaluated_reply_tokens == 0


def test_the_cli_stats_line_says_so(dropping_model):
    from kvchat.cli.ask import _stats_line

    session = _restored(dropping_model, THOUGHTFUL)
    done = [e for e in session.send("And how are you?") if isinstance(e, TurnDone)][0]
    n = done.stats.reevaluated_reply_tokens
    assert _stats_line(done).endswith(
        f"; the template drops earlier thoughts, so {n} tokens of the last reply were "
        "evaluated again"
    )
