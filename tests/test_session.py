"""The engine contract on the real demo model and real mlx-lm caches."""

from __future__ import annotations

import pytest

from kvchat.engine.caches.kinds import CacheKindError, cache_offset
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import (
    Chunk,
    GenerationSettings,
    Prefill,
    Session,
    SessionBusy,
    SessionError,
    TurnDone,
)

SETTINGS = GenerationSettings(max_tokens=12)
SYSTEM = "You are a terse assistant. Answer in one short line."
MESSAGES = [
    "Hello! What is a key-value cache?",
    "Why does it make follow-up questions cheap?",
    "And what happens when I edit an earlier message?",
    "Thanks. One last question: what is trimming?",
]


def finish(events) -> TurnDone:
    """Run a turn to its end and return the final event."""
    done = [e for e in events if isinstance(e, TurnDone)]
    assert len(done) == 1
    return done[0]


def fresh_reply(lm, messages: list[dict], settings: GenerationSettings = SETTINGS) -> str:
    """The reply to ``messages`` (ending with a user message) from an empty cache."""
    *history, last = messages
    assert last["role"] == "user"
    session = Session(lm, settings=settings, messages=[dict(m) for m in history])
    return finish(session.send(last["content"])).reply


def assert_consistent(session: Session) -> None:
    """The ledger is exactly what the cache holds."""
    assert cache_offset(session.cache) == len(session.ledger)


def converse(session: Session, messages=MESSAGES) -> list[TurnDone]:
    out = []
    for text in messages:
        out.append(finish(session.send(text)))
        assert_consistent(session)
    return out


@pytest.mark.parametrize("kind", ["standard", "concatenate"])
def test_cached_replies_equal_uncached(demo_model, kind):
    session = Session(demo_model, kind=kind, system=SYSTEM, settings=SETTINGS)
    for text in MESSAGES:
        expected = fresh_reply(demo_model, [*session.messages, {"role": "user", "content": text}])
        done = finish(session.send(text))
        assert done.reply == expected
        assert_consistent(session)


@pytest.mark.parametrize(
    "kind", ["standard", "concatenate", "quantized:8", "rotating:1024", "chunked:1024"]
)
def test_follow_up_evaluates_only_the_new_message(demo_model, kind):
    session = Session(demo_model, kind=kind, system=SYSTEM, settings=SETTINGS)
    first = finish(session.send(MESSAGES[0]))
    assert first.stats.reused_tokens == 0
    assert first.stats.evaluated_tokens == first.stats.prompt_tokens
    previous = first
    for text in MESSAGES[1:]:
        before = list(session.ledger)
        history = session.render(session.messages, False)
        prompt = session.render([*session.messages, {"role": "user", "content": text}], True)
        done = finish(session.send(text))
        s = done.stats
        assert s.prompt_tokens == len(prompt)
        assert s.reused_tokens + s.evaluated_tokens == s.prompt_tokens
        # Everything the ledger shares with the new prompt is reused, nothing more.
        assert s.reused_tokens == min(common_prefix(before, prompt), len(prompt) - 1)
        # When the last reply re-tokenises to the tokens generated, that is the whole
        # history but for the end-of-turn tokens (<|im_end|>, newline) that a reply cut off
        # at max_tokens never generated and the reply's last token, which the CPU fast
        # path samples but never feeds: only the new message and its template remain.
        # (A sampled token split that BPE would not make re-renders differently; from
        # there on the history is evaluated again.)
        reply_tokens = [t for t in previous.tokens if t not in demo_model.tokenizer.eos_token_ids]
        if demo_model.tokenizer.encode(previous.reply, add_special_tokens=False) == reply_tokens:
            new_part = len(prompt) - len(history)
            assert s.evaluated_tokens <= new_part + 3
            assert s.reused_tokens >= len(history) - 3
        assert s.cache_kind == kind and s.rebuilt is None
        assert_consistent(session)
        previous = done


@pytest.mark.parametrize("kind", ["quantized:8", "quantized:4"])
def test_quantized_agreement_is_measured(demo_model, kind, record_property):
    standard = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    quantized = Session(demo_model, kind=kind, system=SYSTEM, settings=SETTINGS)
    a = [t.reply for t in converse(standard)]
    b = [t.reply for t in converse(quantized)]
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    record_property(f"{kind}_reply_agreement", agree)
    print(f"{kind}: {agree:.0%} of replies equal to standard")
    # the quantized cache is smaller per token than full precision
    assert quantized.cache_bytes < standard.cache_bytes


def test_regenerate_needs_no_prefill(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:2])
    before = session.messages[-1]["content"]
    done = finish(session.regenerate())
    assert done.stats.evaluated_tokens == 0
    assert done.stats.reused_tokens == done.stats.prompt_tokens
    assert done.reply == before  # greedy: the same reply again
    assert len([m for m in session.messages if m["role"] == "assistant"]) == 2
    assert_consistent(session)
    # and the conversation goes on correctly
    after = finish(session.send(MESSAGES[2]))
    assert after.reply == fresh_reply(demo_model, [*session.messages[:-1]])


def test_regenerate_without_a_reply_is_an_error(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    with pytest.raises(SessionError, match="regenerate"):
        session.regenerate()


def test_undo_trims_exactly(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:3])
    session.undo()
    remaining = session.render(session.messages, False)
    assert len(session.messages) == 5
    assert session.ledger == remaining[: len(session.ledger)]
    assert len(session.ledger) >= len(remaining) - 1
    assert_consistent(session)
    done = finish(session.send(MESSAGES[3]))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])
    assert done.stats.evaluated_tokens < done.stats.prompt_tokens / 2


def test_edit_of_the_last_message(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:2])
    session.undo()
    done = finish(session.send("Something else entirely, please."))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])
    assert done.stats.reused_tokens > 0
    assert_consistent(session)


def test_stop_mid_reply_keeps_the_session_consistent(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=40))
    chunks = 0
    done = None
    for event in session.send(MESSAGES[0]):
        if isinstance(event, Chunk):
            chunks += 1
            if chunks == 3:
                session.stop()
        if isinstance(event, TurnDone):
            done = event
    assert done.stopped and done.stats.generated_tokens <= 4
    assert session.messages[-1] == {"role": "assistant", "content": done.reply, "stopped": True}
    assert_consistent(session)
    nxt = finish(session.send(MESSAGES[1]))
    assert nxt.reply == fresh_reply(demo_model, session.messages[:-1], session.settings)
    assert nxt.stats.reused_tokens > 0


def test_consumer_walking_away_counts_as_stop(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=40))
    events = session.send(MESSAGES[0])
    for event in events:
        if isinstance(event, Chunk):
            break
    events.close()
    assert session.messages[-1]["stopped"] is True
    assert_consistent(session)
    assert finish(session.send(MESSAGES[1])).reply


def test_stop_during_prefill(demo_model):
    settings = GenerationSettings(max_tokens=8, prefill_step=16)
    session = Session(demo_model, system=SYSTEM, settings=settings)
    long_message = " ".join(MESSAGES * 6)
    done = None
    for event in session.send(long_message):
        if isinstance(event, Prefill) and event.done > 0:
            session.stop()
        if isinstance(event, TurnDone):
            done = event
    assert done.stopped and done.reply == "" and done.stats.generated_tokens == 0
    assert 0 < len(session.ledger) < done.stats.prompt_tokens
    assert_consistent(session)
    nxt = finish(session.send(MESSAGES[1]))
    assert nxt.reply == fresh_reply(demo_model, session.messages[:-1], session.settings)


def test_stop_before_the_first_event_is_read_stops_that_turn(demo_model):
    """A stop that comes between send() and the worker reading its first event (Ctrl+Q
    right after Enter) stops the turn; a stale stop does not stop the next one."""
    session = Session(demo_model, system=SYSTEM, settings=GenerationSettings(max_tokens=40))
    events = session.send(MESSAGES[0])
    session.stop()
    done = finish(events)
    assert done.stopped and done.reply == "" and done.stats.generated_tokens == 0
    assert session.messages[-2]["content"] == MESSAGES[0]
    assert session.messages[-1] == {"role": "assistant", "content": "", "stopped": True}
    assert_consistent(session)
    session.stop()  # nothing running: forgotten by the next send
    nxt = finish(session.send(MESSAGES[1]))
    assert not nxt.stopped and nxt.stats.generated_tokens > 0 and nxt.reply
    assert nxt.reply == fresh_reply(demo_model, session.messages[:-1], session.settings)


def test_reset_then_continue(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:2])
    session.reset()
    assert session.cache_tokens == 0 and session.ledger == []
    done = finish(session.send(MESSAGES[2]))
    assert done.stats.reused_tokens == 0
    assert done.stats.evaluated_tokens == done.stats.prompt_tokens
    assert done.stats.rebuilt == "the cache was reset"
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])


def test_rotating_keeps_working_past_its_size_with_bounded_bytes(demo_model):
    session = Session(demo_model, kind="rotating:128", system=SYSTEM, settings=SETTINGS)
    sizes = []
    for text in MESSAGES * 2:
        done = finish(session.send(text))
        assert done.reply
        sizes.append(done.stats.cache_bytes)
        assert done.stats.cache_tokens <= 128
    assert len(session.ledger) > 2 * 128
    assert max(sizes[2:]) == min(sizes[2:])  # full and no longer growing


def test_chunked_memory_is_bounded(demo_model):
    session = Session(demo_model, kind="chunked:128", system=SYSTEM, settings=SETTINGS)
    for text in MESSAGES * 2:
        done = finish(session.send(text))
        assert done.stats.cache_tokens <= 128
    assert len(session.ledger) > 2 * 128


@pytest.mark.parametrize(
    "new_kind, converted",
    [("quantized:8", True), ("concatenate", True), ("rotating:1024", False)],
)
def test_switch_kind_mid_conversation(demo_model, new_kind, converted):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:2])
    tokens = len(session.ledger)
    reason = session.set_kind(new_kind)
    assert (reason is None) == converted
    assert session.kind.name == new_kind and len(session.messages) == 5
    assert session.ledger[: tokens - 2] == session.render(session.messages, False)[: tokens - 2]
    assert_consistent(session)
    done = finish(session.send(MESSAGES[2]))
    assert done.reply and done.stats.reused_tokens > 0
    if new_kind != "quantized:8":  # full precision either way: exactly the uncached reply
        assert done.reply == fresh_reply(demo_model, session.messages[:-1])


@pytest.mark.quantized_attention
def test_switch_back_from_quantized_rebuilds_exactly(demo_model):
    session = Session(demo_model, kind="quantized:4", system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:2])
    reason = session.set_kind("standard")
    assert reason == "cache kind changed from quantized:4 to standard"
    assert_consistent(session)
    done = finish(session.send(MESSAGES[2]))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])


def test_trim_history_keeps_the_system_prompt_and_is_exact(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session)
    full = len(session.render(session.messages, False))
    dropped = session.trim_history(full // 2)
    assert dropped >= 2 and dropped % 2 == 0
    assert session.messages[0]["role"] == "system"
    assert session.messages[1]["role"] == "user"
    assert len(session.render(session.messages, False)) <= full // 2
    assert len(session.archived) == dropped
    assert_consistent(session)
    done = finish(session.send("What did we talk about?"))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1])
    assert done.stats.reused_tokens > 0


def test_fork_prefix_skips_the_system_prompt(demo_model):
    first = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(first, MESSAGES[:1])
    second = first.fork_prefix()
    system_tokens = len(second.render(second.messages, False))
    assert second.ledger == first.ledger[:system_tokens]
    done = finish(second.send(MESSAGES[1]))
    assert done.stats.reused_tokens == system_tokens
    assert done.reply == fresh_reply(demo_model, second.messages[:-1])
    # the original is untouched by the copy
    assert_consistent(first)
    assert finish(first.send(MESSAGES[2])).reply == fresh_reply(demo_model, first.messages[:-1])


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_message_is_refused_and_changes_nothing(demo_model, text):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    with pytest.raises(SessionError, match="empty"):
        session.send(text)
    assert len(session.messages) == 1


def test_huge_message_is_refused_and_changes_nothing(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    converse(session, MESSAGES[:1])
    messages, ledger = list(session.messages), list(session.ledger)
    with pytest.raises(SessionError, match="context"):
        session.send("word " * 40_000)  # 200,000 characters
    assert session.messages == messages and session.ledger == ledger
    assert finish(session.send(MESSAGES[1])).stats.reused_tokens > 0


def test_unknown_cache_kind(demo_model):
    with pytest.raises(CacheKindError, match="Unknown cache kind"):
        Session(demo_model, kind="bogus")
    session = Session(demo_model, settings=SETTINGS)
    with pytest.raises(CacheKindError):
        session.set_kind("quantized:3")
    assert session.kind.name == "standard"


def test_a_second_turn_while_one_runs_is_refused(demo_model):
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    running = session.send(MESSAGES[0])
    next(running)
    with pytest.raises(SessionBusy):
        next(session.send(MESSAGES[1]))
    finish(running)
    assert_consistent(session)


def in_thread(fn):
    """Run ``fn`` on a new thread (as the TUI's workers do) and return its result."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize("kind", ["quantized:8", "concatenate"])
def test_each_operation_may_run_on_its_own_thread(demo_model, kind):
    """MLX streams belong to threads: nothing lazy may be left in the cache between calls."""
    session = Session(demo_model, system=SYSTEM, settings=SETTINGS)
    in_thread(lambda: finish(session.send(MESSAGES[0])))
    in_thread(lambda: session.set_kind(kind))
    in_thread(lambda: session.undo())
    fork = in_thread(lambda: session.fork_prefix())
    done = in_thread(lambda: finish(session.send(MESSAGES[1])))
    assert done.reply and done.stats.reused_tokens > 0
    assert in_thread(lambda: finish(fork.send(MESSAGES[2]))).stats.reused_tokens > 0
    again = in_thread(lambda: finish(session.regenerate()))  # from the logits kept by a turn
    assert again.stats.evaluated_tokens == 0 and again.reply == done.reply


def test_a_new_system_prompt_is_the_head_a_rotating_cache_keeps(demo_model):
    session = Session(demo_model, kind="rotating:256", settings=SETTINGS)
    finish(session.send(MESSAGES[0]))
    assert {c.keep for c in session.cache} == {0}
    assert session.set_system(SYSTEM) == 0  # made again: its head is the new system prompt
    head = len(session.render(session.messages[:1], False))
    assert {c.keep for c in session.cache} == {head} != {0}
    done = finish(session.send(MESSAGES[1]))
    assert done.reply == fresh_reply(demo_model, session.messages[:-1], session.settings)
    assert_consistent(session)
