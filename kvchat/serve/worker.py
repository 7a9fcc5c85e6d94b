"""The server's request threads: up to ``decode_concurrency`` requests reply at once.

Each request runs on a thread of its own; the event loop only moves bytes.
Its replies decode together in the model's generation core
(:mod:`kvchat.engine.generation`), one forward pass a step for all of them,
and at most ``prompt_concurrency`` of them evaluate their prompts at a time.
Choosing a request's session (which may load a cache from disk) and saving it
afterwards must have the model to itself: those parts take a
:class:`~kvchat.engine.generation.scheduler.Scheduler` ticket. Requests beyond the
running ones wait; more than ``max_queue`` waiting are refused (429) before
any work. Each job reports back to the event loop through an
:class:`asyncio.Queue`: a :class:`Started`, the reply's text pieces, then a
:class:`Finished` (or an :class:`~kvchat.serve.errors.ApiError`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import count
from typing import TYPE_CHECKING, Any, cast

from mlx_lm.sample_utils import make_logits_processors

from kvchat import store
from kvchat.engine.conversation.events import (
    Chunk,
    Event,
    GenerationSettings,
    Prefill,
    SessionError,
    TokenLogprobs,
    TurnDone,
)
from kvchat.engine.conversation.template import encode_plain
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.settings import GENERATION, apply_overrides

from . import anonymous
from .constrain import JsonConstraint
from .errors import ApiError
from .logprobs import chat_entry, text_of
from .matching import Match, Matcher
from .schema import ChatRequest, CompletionRequest
from .tools import marker as tool_marker
from .tools import plain, split

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.pool import SessionPool


@dataclass(frozen=True)
class Started:
    """The job has its session and its prompt is about to be evaluated."""

    match: Match


@dataclass(frozen=True)
class Piece:
    """A piece of the reply's text, with its tokens' log probabilities when asked for
    (chat-shaped entries, :mod:`kvchat.serve.logprobs`)."""

    text: str
    logprobs: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The reply as the client gets it, why it ended, and the turn's figures;
    ``logprobs`` holds every token's entry when they were asked for, else None."""

    text: str
    finish_reason: str
    usage: dict
    kvchat: dict
    logprobs: list[dict] | None = None
    tool_calls: list[dict] | None = None  # OpenAI's shape: arguments a JSON string


@dataclass(eq=False)
class Job:
    """One chat completion request on its way through the model thread."""

    request: ChatRequest | CompletionRequest
    name: str | None
    owner: str
    loop: asyncio.AbstractEventLoop
    grammar: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: Session | None = None

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Engine:
    """One loaded model behind the HTTP API: its pool, scheduler, matcher and threads.

    ``decode_concurrency`` requests reply at once (``prompt_concurrency`` of them
    evaluating their prompts); ``max_queue`` more may wait; more are refused.
    ``keep_anonymous`` is how many of the sessions it names itself stay saved
    (:mod:`kvchat.serve.anonymous`; 0: all).
    """

    def __init__(
        self,
        lm: LoadedModel,
        pool: SessionPool,
        *,
        kind: str = "standard",
        settings: GenerationSettings | None = None,
        max_queue: int = 16,
        scheduler: Scheduler | None = None,
        keep_anonymous: int = anonymous.DEFAULT_BUDGET,
        decode_concurrency: int = 32,
        prompt_concurrency: int = 8,
    ):
        self.lm, self.pool = lm, pool
        self.keep_anonymous = keep_anonymous
        self.scheduler = scheduler or Scheduler()
        self.matcher = Matcher(pool, lm, kind, busy=self._held)
        # the sampling of a request that gives none (the config's), whatever a session kept
        given = settings or GenerationSettings()
        self.sampling = {s.name: getattr(given, s.name) for s in GENERATION}
        self.max_queue = max_queue
        self.decode_concurrency = max(1, decode_concurrency)
        self._thread = ThreadPoolExecutor(
            max_workers=self.decode_concurrency, thread_name_prefix="kvchat-request"
        )
        self._prompts = threading.BoundedSemaphore(max(1, prompt_concurrency))
        self._owners = count(1)
        self._durations: deque[float] = deque(maxlen=20)
        self._state = threading.Condition()
        self._waiting = 0  # submitted, not replying yet
        self._active = 0  # submitted, not finished
        self._in_use: set[str] = set()  # names of the sessions running requests hold

    @property
    def waiting(self) -> int:
        """Requests that have not started replying yet."""
        with self._state:
            return self._waiting

    @property
    def active(self) -> int:
        """Requests submitted and not finished (waiting or replying)."""
        with self._state:
            return self._active

    def _started(self) -> None:
        with self._state:
            self._waiting -= 1

    def submit(
        self, request: ChatRequest | CompletionRequest, name: str | None, grammar: str | None = None
    ) -> Job:
        """Queue ``request`` (call from the event loop), its reply held to ``grammar`` (an
        llguidance grammar) if given; raise 429 when the queue is full."""
        with self._state:
            if self._waiting >= self.max_queue:
                raise ApiError(
                    429,
                    "The server is busy: too many requests are waiting; retry later.",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(self.retry_after())},
                )
            self._waiting += 1
            self._active += 1
        job = Job(
            request, name, f"http-{next(self._owners)}", asyncio.get_running_loop(), grammar=grammar
        )
        self._thread.submit(self._run, job)
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: withdraw the job, or stop its reply after the current token."""
        job.cancelled.set()
        self.scheduler.cancel(job.owner)
        if job.session is not None:
            job.session.stop()

    def retry_after(self) -> int:
        """Seconds until the queue has probably moved on (recent turns' mean × its length)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (self._waiting // self.decode_concurrency + 1)))

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    def call(self, fn, *args):
        """Run ``fn`` on the model thread once the requests queued before it are done
        (housekeeping such as the pool's expiry); returns a Future."""
        ticket = self.scheduler.request("housekeeping")

        def held():
            self.scheduler.wait(ticket)
            try:
                return fn(*args)
            finally:
                self.scheduler.done(ticket)

        return self._thread.submit(held)

    # --------------------------------------------------------- the model thread

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            if job.cancelled.is_set():
                self._started()
                return
            job.emit(self._turn(job))
        except ApiError as exc:
            job.emit(exc)
        except Exception as exc:  # the session stays consistent; the client hears why
            job.emit(
                ApiError(500, f"The turn failed: {type(exc).__name__}: {exc}", type="server_error")
            )
        finally:
            self._durations.append(time.perf_counter() - started)
            with self._state:
                self._active -= 1

    def _vocab(self) -> int:
        return len(self.lm.tokenizer.get_vocab())

    def _held(self, name: str) -> bool:
        with self._state:
            return name in self._in_use

    def _choose(self, job: Job) -> Match:
        """The request's session, held for it until its turn ends (choosing may load a
        cache from disk: it has the model to itself). A named session another request
        holds is waited for; the matcher passes over the others' sessions."""
        req = job.request
        while True:
            if job.name is not None:
                with self._state:
                    self._state.wait_for(lambda: job.name not in self._in_use)
            with self.scheduler.turn(job.owner):
                if job.name is not None and self._held(job.name):
                    continue  # another request took it first: wait for it again
                self.pool.expire()
                try:
                    if isinstance(req, CompletionRequest):
                        match = self.matcher.choose_completion(encode_plain(self.lm, req.text()))
                    else:
                        match = self.matcher.choose(
                            req.history(), req.new_messages(), job.name, req.tool_specs()
                        )
                except store.StoreError as exc:
                    raise ApiError(500, str(exc), type="server_error") from None
                with self._state:
                    self._in_use.add(match.name)
                return match

    def _turn(self, job: Job) -> Finished:
        try:
            job.request.biases(self._vocab())  # a bad logit_bias is refused before any work
            match = self._choose(job)
        finally:
            self._started()
        try:
            return self._reply(job, match)
        finally:
            with self._state:
                self._in_use.discard(match.name)
                self._state.notify_all()

    def _reply(self, job: Job, match: Match) -> Finished:
        req = job.request
        tools = req.tool_specs() if isinstance(req, ChatRequest) else None
        biases = req.biases(self._vocab())
        session = match.session
        kept_settings = session.settings
        # the server's settings, then the request's: a field it leaves out is the server's
        session.settings = apply_overrides(replace(kept_settings, **self.sampling), req.sampling())
        session.report_logprobs = req.logprobs_wanted()
        session.logits_processors = [
            *(make_logits_processors(logit_bias=biases) if biases else []),
            *([JsonConstraint(self.lm, job.grammar)] if job.grammar else []),
        ]
        session.tools = tools
        try:
            new = [] if isinstance(req, CompletionRequest) else req.new_messages()
            if isinstance(req, CompletionRequest):
                events = session.complete(req.text())
            elif new[-1]["role"] == "user":
                events = session.send(new[-1]["content"])
            else:  # tools' results: the model answers them
                session.messages = [*session.messages, *new]
                events = session.answer()
        except SessionError as exc:  # nothing ran: the session is as it was
            self._unset(session, kept_settings)
            if match.previous is not None:
                session.messages = match.previous
            if not store.exists(match.name):  # created for this request
                self.pool.drop(match.name)
            code = "context_length_exceeded" if "context" in str(exc) else None
            param = "prompt" if isinstance(req, CompletionRequest) else "messages"
            raise ApiError(400, str(exc), param=param, code=code) from None
        job.session = session
        job.emit(Started(match))
        calls_wanted = tools is not None and req.tool_choice != "none"
        try:
            stops = cast(list[str], req.stop)  # the schema's validator made it a list
            done, reply, hit_stop, logprobs = self._stream(
                job, session, events, stops, tool_marker(self.lm) if calls_wanted else None
            )
            calls: list[dict[str, Any]]
            content, calls = reply, []
            if calls_wanted and tools is not None:  # only a chat request offers tools
                content, calls = split(self.lm, reply, tools)
                calls = calls if req.parallel_tool_calls else calls[:1]
            # the transcript keeps what the client got (rendered with this request's
            # tools), and the cache follows it
            with self.scheduler.turn(job.owner):
                if calls:
                    session.messages[-1] = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": plain(calls),
                    }
                    session.sync()
                elif hit_stop:
                    session.messages[-1] = {"role": "assistant", "content": reply}
                    session.sync()
        finally:
            job.session = None
            self._unset(session, kept_settings)
        saved, notice = True, match.notice
        with self.scheduler.turn(job.owner):
            try:
                self.pool.save(match.name)
            except store.SessionChanged:  # another kvchat saved it meanwhile: keep both
                try:
                    self.pool.keep_as_branch(match.name)
                    notice = (
                        f"Session {match.name} was saved by another kvchat while this "
                        "answered; this reply was kept as a branch of it."
                    )
                except store.StoreError as exc:
                    saved, notice = False, str(exc)
            except store.StoreError as exc:
                saved, notice = False, str(exc)
            self.pool.enforce_budget()
            with self._state:
                held = set(self._in_use)  # this request's session and the others'
            anonymous.keep_within(self.pool, self.keep_anonymous, keep=held)
        finished = self._finished(match, done, content if calls else reply, hit_stop, saved, notice)
        wanted = req.logprobs_wanted() is not None
        return replace(
            finished,
            logprobs=logprobs if wanted else None,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else finished.finish_reason,
        )

    @staticmethod
    def _unset(session: Session, settings: GenerationSettings) -> None:
        """Give ``session`` back its own settings, without this request's extras."""
        session.settings, session.report_logprobs, session.logits_processors = settings, None, []
        session.tools = None

    def _stream(
        self,
        job: Job,
        session: Session,
        events: Iterator[Event],
        stops: list[str],
        marker: str | None = None,
    ) -> tuple[TurnDone, str, bool, list[dict[str, Any]]]:
        """Forward the reply's text to the client, holding back what could begin a stop
        string; stop the turn when one appears or the client leaves. Text from ``marker``
        (a tool call's start) on is not sent: the calls are, once parsed. A piece carries
        the log probabilities of the tokens generated since the last piece. At most
        ``prompt_concurrency`` requests are evaluating their prompts at a time."""
        hold = max((len(s) for s in [*stops, *([marker] if marker else [])]), default=1) - 1
        reply, sent, hit_stop = "", 0, False
        done: TurnDone | None = None
        entries: list[dict[str, Any]] = []
        reported = 0  # entries already sent with a piece

        def emit(text: str) -> None:
            nonlocal reported
            job.emit(Piece(text, tuple(entries[reported:])))
            reported = len(entries)

        prompting = self._prompts.acquire()
        try:
            for event in events:
                if prompting and not isinstance(event, Prefill):
                    self._prompts.release()
                    prompting = False
                if isinstance(event, TokenLogprobs) and not hit_stop:
                    entries.append(chat_entry(self.lm.tokenizer, event))
                elif isinstance(event, Chunk) and not hit_stop:
                    if entries:  # the text a token adds is the chunk that follows it
                        text_of(entries[-1], event.text)
                    reply += event.text
                    cut = min(
                        (i for i in (reply.find(s, max(0, sent - hold)) for s in stops) if i >= 0),
                        default=-1,
                    )
                    if cut >= 0:
                        reply, hit_stop = reply[:cut], True
                        session.stop()
                    upto = len(reply) if hit_stop else max(sent, len(reply) - hold)
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
                self._prompts.release()
        if marker is not None and (at := reply.find(marker)) >= 0:
            reply_end = max(sent, at)
        else:
            reply_end = len(reply)
        if (sent < reply_end or reported < len(entries)) and not job.cancelled.is_set():
            emit(reply[sent:reply_end])
        if done is None:  # a turn's last event is its TurnDone, or it raises
            raise RuntimeError("The turn ended without its summary.")
        return done, reply, hit_stop, entries

    def _finished(
        self,
        match: Match,
        done: TurnDone,
        reply: str,
        hit_stop: bool,
        saved: bool,
        notice: str | None,
    ) -> Finished:
        s = done.stats
        eos = bool(done.tokens) and done.tokens[-1] in self.lm.tokenizer.eos_token_ids
        reason = "stop" if hit_stop or eos or done.stopped else "length"
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
        return Finished(reply, reason, usage, stats)
