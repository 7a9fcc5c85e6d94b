"""A request's job and what it reports back to the event loop: a :class:`Started`, the
reply's text as :class:`Piece` s (held back where a stop string could begin), then a
:class:`Finished` with the turn's figures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvchat.engine.conversation.events import Chunk, Event, Prefill, TokenLogprobs, TurnDone
from kvchat.engine.conversation.turn import reusable

from .constrain import Opened
from .logprobs import chat_entry, text_of
from .matching import Match
from .schema import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session


@dataclass(frozen=True)
class Started:
    """The job has its session and its prompt is about to be evaluated: ``prompt_tokens``
    long, ``cached_tokens`` of it in the session's cache (what the turn reuses, unless a
    cache that cannot be trimmed goes back further)."""

    match: Match
    prompt_tokens: int = 0
    cached_tokens: int = 0


def started(match: Match, prompt: list[int]) -> Started:
    """``match``'s job about to evaluate ``prompt``, reusing what its session's cache holds
    of it (as the turn will: :func:`~kvchat.engine.conversation.turn.reusable`)."""
    held, _ = reusable(match.session.keeper, prompt)
    return Started(match, len(prompt), held)


@dataclass(frozen=True)
class Piece:
    """A piece of the reply's text, with its tokens' log probabilities when asked for
    (chat-shaped entries, :mod:`kvchat.serve.logprobs`)."""

    text: str
    logprobs: tuple[dict, ...] = ()
    index: int = 0  # the reply's (``n`` > 1: which of them)


@dataclass(frozen=True)
class Finished:
    """The reply as the client gets it, why it ended, and the turn's figures;
    ``logprobs`` holds every token's entry when they were asked for, else None. With
    ``n`` > 1 this is reply 0, the request's usage and figures, and ``others`` the
    other replies."""

    text: str
    finish_reason: str
    usage: dict
    kvchat: dict
    logprobs: list[dict] | None = None
    tool_calls: list[dict] | None = None  # OpenAI's shape: arguments a JSON string
    stop_sequence: str | None = None  # the stop string that ended the reply
    index: int = 0
    others: tuple[Finished, ...] = ()

    @property
    def replies(self) -> tuple[Finished, ...]:
        """Every reply, by index."""
        return (self, *self.others)


@dataclass(frozen=True)
class Answer:
    """One reply as streamed (its turn's summary, text, the stop string that cut it, its
    tokens' log probabilities), and as read: ``content`` outside tool calls, ``shown``
    to the client, ``calls`` in OpenAI's shape."""

    done: TurnDone
    reply: str
    hit_stop: str | None
    logprobs: list[dict[str, Any]]
    content: str
    shown: str
    calls: list[dict[str, Any]]


@dataclass(eq=False)
class Job:
    """One chat completion request on its way through the model thread."""

    request: ChatRequest | CompletionRequest
    name: str | None
    owner: str
    loop: asyncio.AbstractEventLoop
    grammar: str | Opened | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sessions: list[Session] = field(default_factory=list)  # replying now: stopped on cancel

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def stream_reply(
    job: Job,
    session: Session,
    events: Iterator[Event],
    stops: list[str],
    prompts: threading.Semaphore,
    marker: str | None = None,
    index: int = 0,
) -> tuple[TurnDone, str, str | None, list[dict[str, Any]]]:
    """Forward the reply's text to the client, holding back what could begin a stop
    string; stop the turn when one appears (it is returned) or the client leaves. Text from ``marker``
    (a tool call's start) on is not sent: the calls are, once parsed. A piece carries
    the log probabilities of the tokens generated since the last piece. At most
    as many requests as ``prompts`` lets in are evaluating their prompts at a time. The
    pieces carry the reply's ``index``."""
    hold = max((len(s) for s in [*stops, *([marker] if marker else [])]), default=1) - 1
    reply, sent = "", 0
    hit_stop: str | None = None
    done: TurnDone | None = None
    entries: list[dict[str, Any]] = []
    reported = 0  # entries already sent with a piece

    def emit(text: str) -> None:
        nonlocal reported
        job.emit(Piece(text, tuple(entries[reported:]), index))
        reported = len(entries)

    prompting = prompts.acquire()
    try:
        for event in events:
            if prompting and not isinstance(event, Prefill):
                prompts.release()
                prompting = False
            if isinstance(event, TokenLogprobs) and hit_stop is None:
                entries.append(chat_entry(session.lm.tokenizer, event))
            elif isinstance(event, Chunk) and hit_stop is None:
                if entries:  # the text a token adds is the chunk that follows it
                    text_of(entries[-1], event.text)
                reply += event.text
                found = [(i, s) for s in stops if (i := reply.find(s, max(0, sent - hold))) >= 0]
                if found:
                    cut, hit_stop = min(found)
                    reply = reply[:cut]
                    session.stop()
                upto = len(reply) if hit_stop is not None else max(sent, len(reply) - hold)
                if marker is not None and (at := reply.find(marker)) >= 0:
                    upto = min(upto, at)
                if upto > sent:
                    emit(reply[sent:upto])
                    sent = upto
            elif isinstance(event, TurnDone):
                done = event
            if job.cancelled.is_set():
                session.stop()
    finally:
        if prompting:
            prompts.release()
    if marker is not None and (at := reply.find(marker)) >= 0:
        reply_end = max(sent, at)
    else:
        reply_end = len(reply)
    if (sent < reply_end or reported < len(entries)) and not job.cancelled.is_set():
        emit(reply[sent:reply_end])
    if done is None:  # a turn's last event is its TurnDone, or it raises
        raise RuntimeError("The turn ended without its summary.")
    return done, reply, hit_stop, entries


def finished(
    match: Match,
    done: TurnDone,
    reply: str,
    hit_stop: str | None,
    saved: bool,
    notice: str | None,
) -> Finished:
    s = done.stats
    eos = bool(done.tokens) and done.tokens[-1] in match.session.lm.tokenizer.eos_token_ids
    reason = "stop" if hit_stop is not None or eos or done.stopped else "length"
    usage = {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
    }
    stats = {
        "session": match.name,
        "match": match.how,
        "resumed_from_disk": match.resumed_from_disk,
        "saved": saved,
        "notice": notice,
        **s.to_dict(),
        "ledger_tokens": len(match.session.ledger),
    }
    return Finished(reply, reason, usage, stats, stop_sequence=hit_stop)


def together(replies: list[Finished], primed: list[int] | None) -> Finished:
    """The request's summary: reply 0 with the others; with several, the prompt counted
    once and every reply's tokens, and ``primed`` (the prompt tokens the cache held, and
    those evaluated before the replies forked) in the figures."""
    first, others = replies[0], tuple(replies[1:])
    if not others or primed is None:
        return first
    reused, evaluated = primed
    generated = sum(r.usage["completion_tokens"] for r in replies)
    prompt = first.usage["prompt_tokens"]
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": reused},
    }
    # each reply evaluated the prompt's last token itself, for its logits
    stats = {
        **first.kvchat,
        "reused_tokens": reused,
        "evaluated_tokens": evaluated + len(replies),
        "generated_tokens": generated,
        "replies": len(replies),
    }
    return replace(first, usage=usage, kvchat=stats, others=others)
