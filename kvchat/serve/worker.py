"""The server's request threads: up to ``decode_concurrency`` requests reply at once.

Each request runs on a thread of its own; the event loop only moves bytes.
Its replies decode together in the model's generation core
(:mod:`kvchat.engine.generation`), one forward pass a step for all of them,
and at most ``prompt_concurrency`` of them evaluate their prompts at a time.
Choosing a request's session (which may load a cache from disk) and saving it
afterwards must have the model to itself: those parts take a
:class:`~kvchat.engine.scheduler.Scheduler` ticket. Requests beyond the
running ones wait; more than ``max_queue`` waiting are refused (429) before
any work. Each job reports back to the event loop through an
:class:`asyncio.Queue`: a :class:`Started`, the reply's text pieces, then a
:class:`Finished` (or an :class:`~kvchat.serve.schema.ApiError`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import count
from typing import TYPE_CHECKING, Any

from kvchat import store
from kvchat.engine.events import Chunk, Prefill, SessionError, TurnDone
from kvchat.engine.scheduler import Scheduler

from .matching import Match, Matcher
from .schema import ApiError, ChatRequest

if TYPE_CHECKING:
    from kvchat.engine.model import LoadedModel
    from kvchat.engine.session import Session
    from kvchat.pool import SessionPool


@dataclass(frozen=True)
class Started:
    """The job has its session and its prompt is about to be evaluated."""

    match: Match


@dataclass(frozen=True)
class Finished:
    """The reply as the client gets it, why it ended, and the turn's figures."""

    text: str
    finish_reason: str
    usage: dict
    kvchat: dict


@dataclass(eq=False)
class Job:
    """One chat completion request on its way through the model thread."""

    request: ChatRequest
    name: str | None
    owner: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: Session | None = None

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Engine:
    """One loaded model behind the HTTP API: its pool, scheduler, matcher and threads.

    ``decode_concurrency`` requests reply at once (``prompt_concurrency`` of them
    evaluating their prompts); ``max_queue`` more may wait; more are refused.
    """

    def __init__(self, lm: LoadedModel, pool: SessionPool, *, kind: str = "standard",
                 max_tokens: int = 512, temp: float = 0.0, max_queue: int = 16,
                 scheduler: Scheduler | None = None, decode_concurrency: int = 32,
                 prompt_concurrency: int = 8):
        self.lm, self.pool = lm, pool
        self.scheduler = scheduler or Scheduler()
        self.matcher = Matcher(pool, lm, kind, busy=self._held)
        self.max_tokens, self.temp, self.max_queue = max_tokens, temp, max_queue
        self.decode_concurrency = max(1, decode_concurrency)
        self._thread = ThreadPoolExecutor(max_workers=self.decode_concurrency,
                                          thread_name_prefix="kvchat-request")
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

    def submit(self, request: ChatRequest, name: str | None) -> Job:
        """Queue ``request`` (call from the event loop); raise 429 when the queue is full."""
        with self._state:
            if self._waiting >= self.max_queue:
                raise ApiError(429, "The server is busy: too many requests are waiting; "
                               "retry later.", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(self.retry_after())})
            self._waiting += 1
            self._active += 1
        job = Job(request, name, f"http-{next(self._owners)}", asyncio.get_running_loop())
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
            job.emit(ApiError(500, f"The turn failed: {type(exc).__name__}: {exc}",
                              type="server_error"))
        finally:
            self._durations.append(time.perf_counter() - started)
            with self._state:
                self._active -= 1

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
                    match = self.matcher.choose(req.history(), req.last_user_text(), job.name)
                except store.StoreError as exc:
                    raise ApiError(500, str(exc), type="server_error") from None
                with self._state:
                    self._in_use.add(match.name)
                return match

    def _turn(self, job: Job) -> Finished:
        try:
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
        text = req.last_user_text()
        session = match.session
        kept_settings = session.settings
        session.settings = replace(
            kept_settings,
            max_tokens=req.token_limit() or self.max_tokens,
            temp=self.temp if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=None if req.seed is None else req.seed % (1 << 64),
        )
        try:
            events = session.send(text)
        except SessionError as exc:  # nothing ran: the session is as it was
            session.settings = kept_settings
            if match.previous is not None:
                session.messages = match.previous
            if not store.exists(match.name):  # created for this request
                self.pool.drop(match.name)
            code = "context_length_exceeded" if "context" in str(exc) else None
            raise ApiError(400, str(exc), param="messages", code=code) from None
        job.session = session
        job.emit(Started(match))
        try:
            done, reply, hit_stop = self._stream(job, session, events, req.stop)
        finally:
            job.session = None
            session.settings = kept_settings
        with self.scheduler.turn(job.owner):
            if hit_stop:  # the transcript keeps what the client got, and the cache follows
                session.messages[-1] = {"role": "assistant", "content": reply}
                session.sync()
            saved, notice = True, match.notice
            try:
                self.pool.save(match.name)
            except store.StoreError as exc:
                saved, notice = False, str(exc)
            self.pool.enforce_budget()
        return self._finished(match, done, reply, hit_stop, saved, notice)

    def _stream(self, job: Job, session: Session, events, stops: list[str]):
        """Forward the reply's text to the client, holding back what could begin a stop
        string; stop the turn when one appears or the client leaves. At most
        ``prompt_concurrency`` requests are evaluating their prompts at a time."""
        hold = max((len(s) for s in stops), default=1) - 1
        reply, sent, hit_stop, done = "", 0, False, None
        prompting = self._prompts.acquire()
        try:
            for event in events:
                if prompting and not isinstance(event, Prefill):
                    self._prompts.release()
                    prompting = False
                if isinstance(event, Chunk) and not hit_stop:
                    reply += event.text
                    cut = min((i for i in (reply.find(s, max(0, sent - hold)) for s in stops)
                               if i >= 0), default=-1)
                    if cut >= 0:
                        reply, hit_stop = reply[:cut], True
                        session.stop()
                    upto = len(reply) if hit_stop else max(sent, len(reply) - hold)
                    if upto > sent:
                        job.emit(reply[sent:upto])
                        sent = upto
                elif isinstance(event, TurnDone):
                    done = event
                if job.cancelled.is_set():
                    session.stop()
        finally:
            if prompting:
                self._prompts.release()
        if sent < len(reply) and not job.cancelled.is_set():
            job.emit(reply[sent:])
        return done, reply, hit_stop

    def _finished(self, match: Match, done: TurnDone, reply: str, hit_stop: bool,
                  saved: bool, notice: str | None) -> Finished:
        s = done.stats
        eos = bool(done.tokens) and done.tokens[-1] in self.lm.tokenizer.eos_token_ids
        reason = "stop" if hit_stop or eos or done.stopped else "length"
        usage = {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
        }
        stats = {"session": match.name, "match": match.how,
                 "resumed_from_disk": match.resumed_from_disk, "saved": saved,
                 "notice": notice, **s.to_dict(),
                 "ledger_tokens": len(match.session.ledger)}
        return Finished(reply, reason, usage, stats)
