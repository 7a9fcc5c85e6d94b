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
:class:`asyncio.Queue`: a :class:`~kvchat.serve.jobs.Started`, the reply's text pieces,
then a :class:`~kvchat.serve.jobs.Finished` (or an :class:`~kvchat.serve.errors.ApiError`);
:mod:`kvchat.serve.jobs` streams the reply and sums it up.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import replace
from itertools import count
from typing import TYPE_CHECKING, cast

from kvchat import store
from kvchat.engine.conversation.events import GenerationSettings, SessionError, Turn
from kvchat.engine.conversation.template import encode_plain, renders_names
from kvchat.engine.conversation.turn import Plan
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.engine.generation.threads import MlxThreadPool
from kvchat.settings import GENERATION

from . import anonymous
from .choices import fork_replies, read_together, reply_options
from .constrain import Opened
from .errors import ApiError
from .jobs import Answer, Finished, Job, finished, started, stream_reply, together
from .matching import Match, Matcher
from .schema import ChatRequest, CompletionRequest
from .tools import marker as tool_marker
from .tools import plain
from .turns import Request, answer, processors, turn_of, turn_options

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.runtime.pool import SessionPool


class Engine:
    """One loaded model behind the HTTP API: its pool, scheduler, matcher and threads.

    ``decode_concurrency`` requests reply at once (``prompt_concurrency`` of them
    evaluating their prompts); ``max_queue`` more may wait (by default twice the decode
    concurrency, so a burst as large as a batch queues); more are refused.
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
        max_queue: int | None = None,
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
        self.decode_concurrency = max(1, decode_concurrency)
        # a burst as large as a batch queues rather than fails: twice it may wait by default
        self.max_queue = 2 * self.decode_concurrency if max_queue is None else max_queue
        self._thread = MlxThreadPool(self.decode_concurrency, name="kvchat-request")
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
        self, request: Request, name: str | None, grammar: str | Opened | None = None
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
        for session in job.sessions:
            session.stop()

    def retry_after(self) -> int:
        """Seconds until the queue has probably moved on (recent turns' mean × its length)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (self._waiting // self.decode_concurrency + 1)))

    def shutdown(self) -> None:
        """Stop: the turns running end, those queued are dropped, and every session the
        pool has open is let go of (closed, for other kvchats, at once)."""
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.pool.let_go_all()

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
                        names = renders_names(self.lm)
                        match = self.matcher.choose(
                            req.history(names),
                            req.new_messages(names),
                            job.name,
                            req.tool_specs(),
                            req.template_variables(self.lm),
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
        session = match.session
        # the server's settings over the session's, then the request's
        options = turn_options(self.lm, req, replace(session.settings, **self.sampling))
        sessions, primed = [session], None
        try:
            new = req.new_messages(renders_names(self.lm)) if isinstance(req, ChatRequest) else []
            prompt = (
                Plan.chat(self.lm, [*session.messages, *new], options).prompt
                if isinstance(req, ChatRequest)
                else encode_plain(self.lm, req.text())
            )
            head = started(match, prompt)
            if req.n > 1:  # one prompt, n replies: evaluated once, then forked
                with self._prompts:
                    forks, *primed = fork_replies(session, prompt, req.n, options)
                sessions += forks
            # each reply's own seed and processors (a constraint follows one reply's tokens)
            asked = [
                replace(each, logits_processors=processors(self.lm, req, job.grammar))
                for each in reply_options(options, len(sessions))
            ]
            turns = [turn_of(*each, req, new) for each in zip(sessions, asked, strict=True)]
        except BaseException as exc:  # no reply ran: the session is as it was
            for fork in sessions[1:]:
                fork.close()
            if not isinstance(exc, SessionError):
                raise
            if match.previous is not None:
                session.replace_history(match.previous)
            if not store.exists(match.name):  # created for this request
                self.pool.drop(match.name)
            code = "context_length_exceeded" if "context" in str(exc) else None
            param = "prompt" if isinstance(req, CompletionRequest) else "messages"
            raise ApiError(400, str(exc), param=param, code=code) from None
        job.sessions = sessions
        job.emit(head)
        tools = options.tools
        calls_wanted = (
            isinstance(req, ChatRequest) and tools is not None and req.tool_choice != "none"
        )
        marker = tool_marker(self.lm) if calls_wanted else None
        stops = cast(list[str], req.stop)  # the schema's validator made it a list

        def read(index: int, one: Session, turn: Turn) -> Answer:
            streamed = stream_reply(job, one, turn, stops, self._prompts, marker, index)
            return answer(self.lm, req, streamed, tools if calls_wanted else None)

        try:
            answers = read_together(sessions, turns, read)
            first = answers[0]
            # the transcript keeps what the client got after the start it gave (rendered
            # with this request's tools and variables), and the cache follows it
            start = options.start
            with self.scheduler.turn(job.owner):
                if first.calls:
                    session.revise_reply(
                        {
                            "role": "assistant",
                            "content": start + first.content,
                            "tool_calls": plain(first.calls),
                        },
                        options,
                    )
                elif first.hit_stop:
                    revised = {"role": "assistant", "content": start + first.reply}
                    session.revise_reply(revised, options)
        finally:
            job.sessions = []
            for fork in sessions[1:]:
                fork.close()
        saved, notice = self._save(job, match)
        wanted = req.logprobs_wanted() is not None
        summaries = []
        for i, a in enumerate(answers):
            summary = finished(match, a.done, a.shown, a.hit_stop, saved, notice)
            summaries.append(
                replace(
                    summary,
                    logprobs=a.logprobs if wanted else None,
                    tool_calls=a.calls or None,
                    finish_reason="tool_calls" if a.calls else summary.finish_reason,
                    index=i,
                )
            )
        return together(summaries, primed)

    def _save(self, job: Job, match: Match) -> tuple[bool, str | None]:
        """Save the request's session (whether it was saved, and what to tell the client)."""
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
        return saved, notice
