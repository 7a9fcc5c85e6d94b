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

from mlx_lm.sample_utils import make_logits_processors

from kvchat import store
from kvchat.engine.conversation.events import (
    GenerationSettings,
    SessionError,
    Turn,
    TurnDone,
)
from kvchat.engine.conversation.template import Variables, encode_plain, renders_names
from kvchat.engine.conversation.turn import Plan
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.engine.generation.threads import MlxThreadPool
from kvchat.settings import GENERATION, apply_overrides

from . import anonymous
from .choices import fork_replies, read_together
from .constrain import Opened, constraint
from .errors import ApiError
from .jobs import Answer, Finished, Job, finished, started, stream_reply, together
from .matching import Match, Matcher
from .schema import ChatRequest, CompletionRequest
from .tools import marker as tool_marker
from .tools import plain, split

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.pool import SessionPool

Request = ChatRequest | CompletionRequest


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
        tools = req.tool_specs() if isinstance(req, ChatRequest) else None
        start = req.start() if isinstance(req, ChatRequest) else ""  # the reply continues it
        variables = req.template_variables(self.lm) if isinstance(req, ChatRequest) else None
        session = match.session
        kept_settings = session.settings
        # the server's settings, then the request's: a field it leaves out is the server's
        session.settings = apply_overrides(replace(kept_settings, **self.sampling), req.sampling())
        session.report_logprobs = req.logprobs_wanted()
        session.tools = tools
        sessions, primed = [session], None
        try:
            new = req.new_messages(renders_names(self.lm)) if isinstance(req, ChatRequest) else []
            prompt = (
                Plan.chat(self.lm, [*session.messages, *new], tools, start, variables).prompt
                if isinstance(req, ChatRequest)
                else encode_plain(self.lm, req.text())
            )
            head = started(match, prompt)
            if req.n > 1:  # one prompt, n replies: evaluated once, then forked
                with self._prompts:
                    forks, *primed = fork_replies(session, prompt, req.n)
                sessions += forks
            for each in sessions:
                each.logits_processors = self._processors(job)
            turns = [self._turn_of(each, req, new, start, variables) for each in sessions]
        except BaseException as exc:  # no reply ran: the session is as it was
            self._unset(session, kept_settings)
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
        calls_wanted = (
            isinstance(req, ChatRequest) and tools is not None and req.tool_choice != "none"
        )
        marker = tool_marker(self.lm) if calls_wanted else None
        stops = cast(list[str], req.stop)  # the schema's validator made it a list

        def read(index: int, one: Session, turn: Turn) -> Answer:
            streamed = stream_reply(job, one, turn, stops, self._prompts, marker, index)
            return self._answer(req, streamed, tools if calls_wanted else None)

        try:
            answers = read_together(sessions, turns, read)
            first = answers[0]
            # the transcript keeps what the client got after the start it gave (rendered
            # with this request's tools and variables), and the cache follows it
            with self.scheduler.turn(job.owner):
                if first.calls:
                    session.revise_reply(
                        {
                            "role": "assistant",
                            "content": start + first.content,
                            "tool_calls": plain(first.calls),
                        },
                        variables,
                    )
                elif first.hit_stop:
                    revised = {"role": "assistant", "content": start + first.reply}
                    session.revise_reply(revised, variables)
        finally:
            job.sessions = []
            self._unset(session, kept_settings)
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

    def _turn_of(
        self, session: Session, req: Request, new: list[dict], start: str, variables: Variables
    ) -> Turn:
        """The turn that answers ``req`` on ``session`` (``new``: the messages it adds;
        ``variables``: the request's for the chat template)."""
        if isinstance(req, CompletionRequest):
            return session.complete(req.text())
        if new[-1]["role"] == "user":
            return session.send(new[-1], start, variables)
        return session.answer(new, start, variables)  # tools' results: the model answers them

    def _processors(self, job: Job) -> list:
        """A reply's logits processors: the request's logit bias, its grammar (each reply's
        own: a constraint follows the tokens of one reply)."""
        biases = job.request.biases(self._vocab())
        return [
            *(make_logits_processors(logit_bias=biases) if biases else []),
            *([constraint(self.lm, job.grammar)] if job.grammar else []),
        ]

    def _answer(
        self,
        req: Request,
        streamed: tuple[TurnDone, str, str | None, list],
        tools: list[dict] | None,
    ) -> Answer:
        """A reply streamed, its tool calls read out of it when ``tools`` are offered."""
        done, reply, hit_stop, logprobs = streamed
        if tools is None or not isinstance(req, ChatRequest):
            return Answer(done, reply, hit_stop, logprobs, reply, reply, [])
        content, calls = split(self.lm, reply, tools)
        calls = calls if req.parallel_tool_calls else calls[:1]
        if req.legacy:  # a legacy result names its call by the function's name
            calls = [{**c, "id": c["function"]["name"]} for c in calls]
        # a call cut short: its unfinished markup (a forced call's: the whole reply) is
        # never content, as it is never streamed
        opened = reply.partition(self.lm.tokenizer.tool_call_start)[0]
        shown = content if calls else ("" if req.forced_tools() else opened)
        return Answer(done, reply, hit_stop, logprobs, content, shown, calls)

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

    @staticmethod
    def _unset(session: Session, settings: GenerationSettings) -> None:
        """Give ``session`` back its own settings, without this request's extras."""
        session.settings, session.report_logprobs, session.logits_processors = settings, None, []
        session.tools = None
