"""Session: one conversation, its live prompt cache and the token ledger.

The contract (docs/architecture.md, "The engine contract"): every turn renders the whole
message list with the chat template, keeps the longest common prefix of that
rendering and the **ledger** (the token ids whose keys and values are in the
cache, in order), trims the cache back to it, and evaluates only the rest.
Nothing in the cache ever differs from what a fresh run of the same prompt
would compute, so edits, regenerates, templates that rewrite old turns and
re-tokenised replies need no special cases.

:meth:`Session.send` returns a generator of small events, mlx-lm style:
:class:`Prefill` while the prompt is evaluated, :class:`Chunk` for each
piece of streamed text and a final :class:`TurnDone` carrying the reply and
its :class:`~kvchat.engine.conversation.stats.TurnStats`. The TUI and the CLI consume the
same stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvchat.engine.caches.checkpoints import Checkpoints
from kvchat.engine.caches.kinds import (
    CacheKind,
    after_turn,
    allocated_bytes,
    cache_bytes,
    copy_cache,
    held_tokens,
    make_cache,
    parse_kind,
    trim_to,
)
from kvchat.engine.conversation.branch_ops import BranchOps
from kvchat.engine.conversation.branches import Branches
from kvchat.engine.conversation.events import (
    Chunk,
    Event,
    GenerationSettings,
    Prefill,
    SessionBusy,
    SessionError,
    Turn,
    TurnDone,
)
from kvchat.engine.conversation.maintenance import CacheMaintenance, common_prefix
from kvchat.engine.conversation.stats import CacheFigures, TurnStats, memory
from kvchat.engine.conversation.template import encode, encode_plain, render, template_text
from kvchat.engine.conversation.text import ReplyText
from kvchat.engine.conversation.thoughts import reevaluated_reply
from kvchat.engine.generation import Left, Sequence, core_for
from kvchat.engine.generation.sampling import LogitsProcessor, Sampler, for_settings, token_logprobs
from kvchat.engine.generation.sequence import StopFlag

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

# a turn's events and errors are passed on from here with the Session that yields them
__all__ = [
    "Chunk",
    "Event",
    "GenerationSettings",
    "Prefill",
    "Session",
    "SessionBusy",
    "SessionError",
    "TurnDone",
]

Progress = Callable[[int, int], None]


def _last_left(seq: Sequence) -> Left:
    """The :class:`Left` a sequence's reader stopped reading before."""
    left = Left(stopped=True)
    while not seq.messages.empty():
        message = seq.messages.get()
        if isinstance(message, Left):
            left = message
    return left


class Session(CacheMaintenance, BranchOps):
    """One conversation with its own prompt cache (one cache object per model layer)."""

    def __init__(
        self,
        lm: LoadedModel,
        *,
        kind: str | CacheKind = "standard",
        system: str | None = None,
        settings: GenerationSettings | None = None,
        messages: list[dict[str, Any]] | None = None,
    ):
        self.lm = lm
        self.kind = parse_kind(kind)
        self.settings = settings or GenerationSettings()
        self.messages: list[dict[str, Any]] = list(messages or [])
        # the tools (OpenAI function specs) the chat template offers the model, if any
        self.tools: list[dict[str, Any]] | None = None
        if system and not (self.messages and self.messages[0]["role"] == "system"):
            self.messages.insert(0, {"role": "system", "content": system})
        self.turns: list[TurnStats] = []
        self.archived: list[
            dict[str, Any]
        ] = []  # turns dropped by trim_history, kept for the record
        self.branches = Branches.linear(self.talk())  # every path the messages have taken
        self.ledger: list[int] = []
        self.cache: list[Any] = make_cache(lm.model, self.kind, keep=self._system_tokens())
        self.checkpoints = Checkpoints()  # of sliding-window and recurrent layers, by turn
        self._logits: tuple[int, mx.array] | None = None
        # set to a count to have turns yield TokenLogprobs with that many alternatives
        self.report_logprobs: int | None = None
        # mlx-lm logits processors every sampled token goes through (constrained decoding)
        self.logits_processors: list[Callable[[mx.array, mx.array], mx.array]] = []
        self._stop: StopFlag = threading.Event()
        self._share: Callable[[Sampler], Sampler] | None = None  # see keep_in_step
        self._busy = threading.Lock()

    @classmethod
    def restore(
        cls,
        lm: LoadedModel,
        *,
        messages: list[dict[str, Any]],
        kind: str | CacheKind,
        settings: GenerationSettings | None = None,
        ledger: list[int] | None = None,
        cache: list[Any] | None = None,
        turns: list[TurnStats] | None = None,
        archived: list[dict[str, Any]] | None = None,
        branches: Branches | None = None,
    ) -> "Session":
        """A session from saved parts. Without a ``cache`` (or ledger) it starts empty;
        the caller decides whether to :meth:`rebuild` it now. ``branches`` must hold
        ``messages`` as its path (:meth:`Branches.from_record` checks that)."""
        session = cls(lm, kind=kind, settings=settings, messages=messages)
        session.turns = list(turns or [])
        session.archived = list(archived or [])
        session.branches = branches or Branches.linear(session.talk(), session.turns)
        if cache is not None and ledger is not None:
            session.attach(cache, ledger)
        return session

    def fork_prefix(
        self, messages: list[dict[str, Any]] | None = None, tokens: list[int] | None = None
    ) -> "Session":
        """A new session whose cache starts as a copy of this one's, cut to the
        common prefix with ``tokens`` or else with ``messages`` rendered (by default
        this session's system prompt); the new session's transcript is ``messages``.

        This is how a new conversation with the same model, kind and system
        prompt skips evaluating the system prompt again (and a server's request
        its whole prompt, given as ``tokens``). A cache that cannot be cut that
        far starts from this one's nearest checkpoint before it, if any.
        """
        messages = list(
            messages if messages is not None else self.messages[:1] if self.system else []
        )
        child = Session(self.lm, kind=self.kind, settings=replace(self.settings), messages=messages)
        wanted = tokens if tokens is not None else child.render(messages, False)
        n = common_prefix(self.ledger, wanted)
        copied = copy_cache(self.cache)
        kept = n if n and trim_to(copied, n) else self.checkpoints.restore(copied, n)
        if kept and held_tokens(copied) == kept:
            child.attach(copied, self.ledger[:kept])
        return child

    # ----------------------------------------------------------------- views

    @property
    def system(self) -> str | None:
        if self.messages and self.messages[0]["role"] == "system":
            content: str = self.messages[0]["content"]
            return content
        return None

    @property
    def answering(self) -> bool:
        """Whether a turn of this session is running (its cache and ledger are the
        turn's until it ends: views read :meth:`figures` taken before)."""
        return self._busy.locked()

    @property
    def cache_tokens(self) -> int:
        """Tokens whose keys and values the cache holds now."""
        return held_tokens(self.cache, len(self.ledger))

    @property
    def cache_bytes(self) -> int:
        """Bytes the held tokens take (what a save writes)."""
        return cache_bytes(self.cache)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the cache's buffers hold in memory, free slots included."""
        return allocated_bytes(self.cache)

    @property
    def pending_rebuild(self) -> str | None:
        """Why the cache was emptied since the last turn (reset, failed turn, ...), if it was."""
        return self._pending_rebuild

    @property
    def last_stats(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def figures(self) -> CacheFigures:
        """What the views show of this session, as of now (call it between turns)."""
        return CacheFigures(
            cache_tokens=self.cache_tokens,
            cache_bytes=self.cache_bytes,
            checkpoints=(len(self.checkpoints), self.checkpoints.nbytes),
            user_turns=sum(1 for m in self.messages if m["role"] == "user"),
            last=self.last_stats,
            prompt_eval_history=tuple(t.prompt_eval_s for t in self.turns),
            pending_rebuild=self._pending_rebuild,
        )

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        """Token ids of ``messages`` through the model's chat template (offering ``tools``)."""
        return render(self.lm, messages, generation_prompt, self.tools)

    def _system_tokens(self) -> int:
        return len(self.render(self.messages[:1], False)) if self.system else 0

    # ----------------------------------------------------------------- turns

    def send(self, text: str) -> Turn:
        """Add a user message and stream the reply.

        Bad input raises :class:`SessionError` here, before anything changes.
        """
        if not isinstance(text, str) or not text.strip():
            raise SessionError("Nothing to send: the message is empty.")
        messages = [*self.messages, {"role": "user", "content": text}]
        return self._turn(messages, *self._fitting_prompt(messages))

    def complete(self, text: str) -> Turn:
        """Continue ``text`` as written, without the chat template (a plain completion).

        The transcript becomes ``text`` as one user message, then the reply, so
        the session saves and loads like any other; its ledger is ``text``'s own
        tokens, so a later prompt that extends ``text`` reuses the cache.
        """
        if not isinstance(text, str) or not text:
            raise SessionError("Nothing to complete: the prompt is empty.")
        prompt = encode_plain(self.lm, text)
        self._check_fits(prompt, "That prompt is")
        return self._turn([{"role": "user", "content": text}], text, prompt)

    def answer(self) -> Turn:
        """Reply to the transcript as it stands: its last message is a tool's result (the
        model called a tool, the caller ran it and added what it returned)."""
        if not self.messages or self.messages[-1]["role"] != "tool":
            raise SessionError("Nothing to answer: the last message is not a tool's result.")
        messages = list(self.messages)
        return self._turn(messages, *self._fitting_prompt(messages))

    def stop(self) -> None:
        """Ask the running turn to stop after its current token (thread-safe)."""
        self._stop.set()

    def keep_in_step(self, stop: StopFlag, share: Callable[[Sampler], Sampler]) -> None:
        """A sharded run's: ``stop`` (a flag every rank checks together) replaces this
        session's, and each turn samples through ``share(sampler)`` (rank 0's token)."""
        self._stop, self._share = stop, share

    def _fitting_prompt(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The template's text of ``messages`` with the generation prompt, and its tokens."""
        text = template_text(self.lm, messages, True, self.tools)
        prompt = encode(self.lm, text)
        self._check_fits(prompt, "That message makes the conversation")
        return text, prompt

    def _check_fits(self, prompt: list[int], what: str) -> None:
        limit = self.lm.context_length
        if len(prompt) >= limit:
            raise SessionError(
                f"{what} {len(prompt):,} tokens, over this model's context of {limit:,}; "
                "trim the history or start a new session."
            )

    def _turn(self, messages: list[dict[str, Any]], prompt_text: str, prompt: list[int]) -> Turn:
        """The turn's events, run as they are read. A :meth:`stop` from now on stops this
        turn, even one that comes before its first event is read."""
        if not self._busy.locked():  # a running turn keeps its own stop request
            self._stop.clear()
            self.last_change = None  # from now on the turn's own figures describe the cache
        return self._events(messages, prompt_text, prompt)

    def _events(self, messages: list[dict[str, Any]], prompt_text: str, prompt: list[int]) -> Turn:
        if not self._busy.acquire(blocking=False):
            raise SessionBusy("This session is already answering; wait or stop it first.")
        try:
            yield from self._run_turn(messages, prompt_text, prompt)
        finally:
            self._busy.release()

    def _run_turn(
        self, messages: list[dict[str, Any]], prompt_text: str, prompt: list[int]
    ) -> Turn:
        started = time.perf_counter()
        mx.reset_peak_memory()
        self.messages = messages
        self._record()

        n = common_prefix(self.ledger, prompt)
        zero_prefill = (
            n == len(prompt) and self._logits is not None and self._logits[0] == len(prompt)
        )
        if not zero_prefill:
            n = min(n, len(prompt) - 1)  # the last prompt token is evaluated for its logits
        kept, rebuilt = self._rewind(n)
        if kept < n:  # back to a checkpoint, or to nothing
            n, zero_prefill = kept, False
        reused, evaluated = n, len(prompt) - n
        reevaluated = (
            0
            if rebuilt
            else reevaluated_reply(
                partial(template_text, self.lm),
                partial(encode, self.lm),
                messages,
                prompt_text,
                prompt,
                n,
            )
        )
        self._keep_turns(messages)

        max_new = max(1, min(self.settings.max_tokens, self.lm.context_length - len(prompt)))
        sampler, processors = self._sampler()
        seq = Sequence(
            prompt=[] if zero_prefill else prompt[n:],
            cache=self.cache,
            ledger=self.ledger,
            sampler=sampler,
            processors=processors,
            max_tokens=max_new,
            stop=self._stop,
            eos=frozenset(() if self.settings.ignore_eos else self.lm.tokenizer.eos_token_ids),
            prefill_step=max(1, self.settings.prefill_step),
            kind=self.kind.name,
            logprobs=self._logits[1] if zero_prefill and self._logits is not None else None,
            on_prompt=self._prompt_done,
            # checkpoints at the ends of the turns this prefill passes
            marks=frozenset() if zero_prefill else self._turn_ends(messages, prompt, n),
            on_mark=partial(self.checkpoints.keep, self.cache),
            report_logprobs=self.report_logprobs is not None,
        )
        report = self.report_logprobs
        text = ReplyText(self.lm.tokenizer)
        first_at = prompt_eval_s = None
        prefill_started = time.perf_counter()
        stream = core_for(self.lm).run(seq)
        tokens: list[int] = []  # as this consumer read them
        left: Left | None = None
        stopped = False
        try:
            try:
                for message in stream:
                    if isinstance(message, Prefill):
                        yield message
                    elif isinstance(message, Left):
                        left = message
                    else:
                        if first_at is None:
                            first_at = time.perf_counter()
                            prompt_eval_s = first_at - prefill_started
                        tokens.append(message)
                        if message in seq.eos:
                            continue
                        if report is not None:
                            yield token_logprobs(
                                message, seq.sampled_logprobs[len(tokens) - 1], report
                            )
                        piece = text.add(message)
                        if piece:
                            yield Chunk(piece)
                        # The core may be tokens ahead of this reader: a stop ends the reply
                        # at the token read; the cache may hold a few more (the ledger says
                        # so, and the next turn's prefix match trims them).
                        if self._stop.is_set():
                            stopped = True
                            break
            finally:
                stream.close()  # a consumer gone: the sequence leaves before we go on
            left = left or _last_left(seq)
            if left.error is not None:
                raise left.error
            stopped = stopped or left.stopped
            piece = text.finish()
            if piece:
                yield Chunk(piece)
            reply = text.text
        except GeneratorExit:
            # The consumer walked away mid-reply: keep what was said, as stopped.
            text.finish()
            self._finish(text.text, stopped=True)
            raise
        except KeyboardInterrupt:
            # The reply's sequence has left the core (its cache is whole), but the
            # turn did not end as the user asked: the text said so far is kept, as
            # stopped, and the cache is rebuilt next time to be safe.
            self._discard("the previous turn was interrupted")
            text.finish()
            self._finish(text.text, stopped=True)
            raise
        except BaseException:
            self._discard("the previous turn failed before it finished")
            raise

        ended = time.perf_counter()
        decode_s = ended - first_at if first_at is not None else 0.0
        # What this turn put in the cache besides its reply: less than the whole
        # prompt when it was stopped during the prefill.
        evaluated = min(len(self.ledger), len(prompt)) - reused
        carried = min(self._recomputed, reused)  # recomputed at load: this turn's cost
        self._recomputed = 0
        self._finish(reply, stopped)
        stats = TurnStats(
            prompt_tokens=len(prompt),
            reused_tokens=reused - carried,
            evaluated_tokens=evaluated + carried,
            prompt_eval_s=prompt_eval_s if prompt_eval_s is not None else ended - prefill_started,
            ttft_s=first_at - started if first_at is not None else 0.0,
            generated_tokens=len(tokens),
            gen_tps=(len(tokens) / decode_s) if decode_s > 0 and tokens else 0.0,
            cache_tokens=self.cache_tokens,
            cache_bytes=self.cache_bytes,
            cache_kind=self.kind.name,
            active_memory_bytes=memory()[0],
            peak_memory_bytes=memory()[1],
            rebuilt=rebuilt or self._pending_rebuild,
            reevaluated_reply_tokens=reevaluated,
            stopped=stopped,
            not_batched=seq.not_batched,
            batch_size=seq.batch_peak,
        )
        self._pending_rebuild = None
        self.turns.append(stats)
        self.branches.set_turn(stats)
        if not stopped:
            self.checkpoints.keep(self.cache, len(self.ledger))
        yield TurnDone(reply=reply, stats=stats, stopped=stopped, tokens=tuple(tokens))

    _pending_rebuild: str | None = None
    _recomputed = 0  # tokens a load-time rebuild put in the cache, not yet counted by a turn

    def _sampler(self) -> tuple[Sampler, list[LogitsProcessor]]:
        """This turn's sampler and logits processors: the settings' penalties, then the
        session's own ``logits_processors`` (constrained decoding, a logit bias). A sharded
        run makes every rank take rank 0's token."""
        sampler, processors = for_settings(self.settings)
        if self._share is not None:
            sampler = self._share(sampler)
        return sampler, [*processors, *self.logits_processors]

    def _prompt_done(self, logprobs: mx.array) -> None:
        """The core's call once the prompt is in the cache: keep a checkpoint there (for a
        regenerate or an edit of this turn) and the log probabilities at its end."""
        self.checkpoints.keep(self.cache, len(self.ledger))
        self._logits = (len(self.ledger), logprobs)

    def _keep_turns(self, messages: list[dict[str, Any]]) -> None:
        """Keep one stats entry per reply in ``messages``: an undone or replaced
        reply takes its turn's stats with it."""
        del self.turns[sum(m["role"] == "assistant" for m in messages) :]

    def _finish(self, reply: str, stopped: bool) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": reply}
        if stopped:
            message["stopped"] = True
        self.messages.append(message)
        self._record()
        after_turn(self.cache)
