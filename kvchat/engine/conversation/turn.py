"""One turn of a session: rewind the cache to what the prompt shares with the ledger,
evaluate the rest and stream the reply through the generation core, then add the reply
and its :class:`~kvchat.engine.conversation.stats.TurnStats` to the history.

The :class:`~kvchat.engine.conversation.session.Session` checks the request (its message
and its :class:`~kvchat.engine.conversation.events.TurnOptions`); its :class:`Runner` holds
it for the turn, which runs on the session's other collaborators, the
:class:`~kvchat.engine.conversation.maintenance.CacheKeeper` and the
:class:`~kvchat.engine.conversation.history.History`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from kvchat.engine.conversation.events import (
    Chunk,
    Prefill,
    SessionBusy,
    SessionError,
    Turn,
    TurnDone,
)
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.stats import TurnStats, memory
from kvchat.engine.conversation.template import (
    Variables,
    encode,
    encode_plain,
    template_text,
)
from kvchat.engine.conversation.text import ReplyText
from kvchat.engine.conversation.thoughts import reevaluated_reply
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import (
    LogitsProcessor,
    Sampler,
    for_settings,
    token_logprobs,
)
from kvchat.engine.generation.sequence import Left, Sequence

if TYPE_CHECKING:
    from kvchat.engine.conversation.events import GenerationSettings, TurnOptions
    from kvchat.engine.conversation.history import History
    from kvchat.engine.conversation.maintenance import CacheKeeper
    from kvchat.engine.generation.sequence import StopFlag
    from kvchat.engine.models.model import LoadedModel

# where in a prompt's tokens the turns it holds end, past a token (checkpoints go there)
TurnEnds = Callable[[list[dict[str, Any]], list[int], int], frozenset[int]]


@dataclass(frozen=True)
class Plan:
    """What a turn answers: the transcript with the new message, its template text (with the
    generation prompt, or ending in ``start``) and that text's tokens; ``start`` is the
    reply's given beginning (a prefill), which the turn continues; ``variables`` the
    template's, as the text was rendered with them."""

    messages: list[dict[str, Any]]
    prompt_text: str
    prompt: list[int]
    start: str = ""
    variables: Variables = None

    @classmethod
    def chat(cls, lm: LoadedModel, messages: list[dict[str, Any]], options: TurnOptions) -> Plan:
        """A turn answering ``messages`` through the chat template, with the request's tools
        and template variables (its thinking switch); a ``start`` is rendered as the reply's
        open beginning, and the turn continues it."""
        start, tools, variables = options.start, options.tools, options.variables
        if not start:
            text = template_text(lm, messages, True, tools, variables=variables)
        else:
            opened = [*messages, {"role": "assistant", "content": start}]
            try:
                text = template_text(lm, opened, False, tools, open_last=True, variables=variables)
            except ValueError as exc:  # transformers: the template drops or rewrites it
                raise SessionError(
                    f"The chat template of {lm.model_id} cannot continue a reply: {exc}"
                ) from None
        plan = cls(messages, text, encode(lm, text), start, variables)
        return plan._fits(lm, "That message makes the conversation")

    @classmethod
    def plain(cls, lm: LoadedModel, text: str) -> Plan:
        """A turn continuing ``text`` as written, without the chat template."""
        if not isinstance(text, str) or not text:
            raise SessionError("Nothing to complete: the prompt is empty.")
        plan = cls([{"role": "user", "content": text}], text, encode_plain(lm, text))
        return plan._fits(lm, "That prompt is")

    def _fits(self, lm: LoadedModel, what: str) -> Plan:
        """This plan, or :class:`SessionError` when the prompt does not fit the context."""
        limit = lm.context_length
        if len(self.prompt) >= limit:
            raise SessionError(
                f"{what} {len(self.prompt):,} tokens, over this model's context of {limit:,}; "
                "trim the history or start a new session."
            )
        return self


@dataclass(frozen=True)
class Decoding:
    """How a turn samples its reply."""

    settings: GenerationSettings
    sampler: Sampler
    processors: list[LogitsProcessor]
    stop: StopFlag
    report_logprobs: int | None  # alternatives a TokenLogprobs event carries, if wanted


class Runner:
    """Runs a session's turns, one at a time: its lock, its stop flag, and in a sharded run
    the wrapper that makes every rank sample rank 0's token."""

    def __init__(self) -> None:
        self.flag: StopFlag = threading.Event()
        self._share: Callable[[Sampler], Sampler] | None = None
        self._busy = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a turn is running."""
        return self._busy.locked()

    def stop(self) -> None:
        self.flag.set()

    def keep_in_step(self, stop: StopFlag, share: Callable[[Sampler], Sampler]) -> None:
        self.flag, self._share = stop, share

    def start(
        self,
        lm: LoadedModel,
        keeper: CacheKeeper,
        history: History,
        plan: Plan,
        settings: GenerationSettings,
        options: TurnOptions,
        turn_ends: TurnEnds,
    ) -> Turn:
        """The turn's events, sampled with ``settings`` and the request's ``options``, run
        as they are read. A :meth:`stop` from now on stops this
        turn, even one that comes before its first event is read."""
        if not self._busy.locked():  # a running turn keeps its own stop request
            self.flag.clear()
            keeper.last_change = None  # from now on the turn's own figures describe it
        return self._events(lm, keeper, history, plan, settings, options, turn_ends)

    def _events(
        self,
        lm: LoadedModel,
        keeper: CacheKeeper,
        history: History,
        plan: Plan,
        settings: GenerationSettings,
        options: TurnOptions,
        turn_ends: TurnEnds,
    ) -> Turn:
        if not self._busy.acquire(blocking=False):
            raise SessionBusy("This session is already answering; wait or stop it first.")
        try:
            # the settings' penalties, then the request's processors (constrained
            # decoding, a logit bias); a sharded run makes every rank take rank 0's token
            sampler, penalties = for_settings(settings)
            if self._share is not None:
                sampler = self._share(sampler)
            processors = [*penalties, *options.logits_processors]
            report = options.report_logprobs
            decoding = Decoding(settings, sampler, processors, self.flag, report)
            yield from run_turn(lm, keeper, history, plan, decoding, turn_ends)
        finally:
            self._busy.release()


def _last_left(seq: Sequence) -> Left:
    """The :class:`Left` a sequence's reader stopped reading before."""
    left = Left(stopped=True)
    while not seq.channel.messages.empty():
        message = seq.channel.messages.get()
        if isinstance(message, Left):
            left = message
    return left


def reusable(keeper: CacheKeeper, prompt: list[int]) -> tuple[int, bool]:
    """How much of ``prompt`` a turn takes from ``keeper``'s cache, and whether it evaluates
    nothing: all of it when the cache holds it with the log-probabilities at its end (a
    regenerate), else the shared prefix but the last prompt token, evaluated for its
    logits. (A cache that cannot be trimmed may go back further, to a checkpoint.)"""
    n = common_prefix(keeper.ledger, prompt)
    if n == len(prompt) and keeper.logprobs_at(n) is not None:
        return n, True
    return min(n, len(prompt) - 1), False


def run_turn(
    lm: LoadedModel,
    keeper: CacheKeeper,
    history: History,
    plan: Plan,
    decoding: Decoding,
    turn_ends: TurnEnds,
) -> Turn:
    """The turn's events (run as they are read): :class:`Prefill` while the prompt is
    evaluated, a :class:`Chunk` per piece of text and the final :class:`TurnDone`."""
    started = time.perf_counter()
    mx.reset_peak_memory()
    messages, prompt = plan.messages, plan.prompt
    history.begin(messages)

    n, zero_prefill = reusable(keeper, prompt)
    logits = keeper.logprobs_at(len(prompt)) if zero_prefill else None
    kept, rebuilt = keeper.rewind(n)
    if kept < n:  # back to a checkpoint, or to nothing
        n, zero_prefill = kept, False
    reused = n
    reevaluated = (
        0
        if rebuilt
        else reevaluated_reply(
            partial(template_text, lm, variables=plan.variables),
            partial(encode, lm),
            messages,
            plan.prompt_text,
            prompt,
            n,
        )
    )

    settings = decoding.settings
    report = decoding.report_logprobs
    seq = keeper.sequence(
        [] if zero_prefill else prompt[n:],
        sampler=decoding.sampler,
        processors=decoding.processors,
        max_tokens=max(1, min(settings.max_tokens, lm.context_length - len(prompt))),
        stop=decoding.stop,
        eos=frozenset(() if settings.ignore_eos else lm.tokenizer.eos_token_ids),
        prefill_step=max(1, settings.prefill_step),
        logprobs=logits if zero_prefill else None,
        # checkpoints at the ends of the turns this prefill passes
        marks=frozenset() if zero_prefill else turn_ends(messages, prompt, n),
        report_logprobs=report is not None,
    )
    text = ReplyText(lm.tokenizer)
    first_at = prompt_eval_s = None
    prefill_started = time.perf_counter()
    stream = core_for(lm).run(seq)
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
                    if message in seq.request.eos:
                        continue
                    if report is not None:
                        yield token_logprobs(
                            message, seq.state.sampled_logprobs[len(tokens) - 1], report
                        )
                    piece = text.add(message)
                    if piece:
                        yield Chunk(piece, len(tokens))
                    # The core may be tokens ahead of this reader: a stop ends the reply
                    # at the token read; the cache may hold a few more (the ledger says
                    # so, and the next turn's prefix match trims them).
                    if decoding.stop.is_set():
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
            yield Chunk(piece, len(tokens))
        reply = plan.start + text.text
    except GeneratorExit:
        # The consumer walked away mid-reply: keep what was said, as stopped.
        text.finish()
        _finish(keeper, history, plan.start + text.text, stopped=True)
        raise
    except KeyboardInterrupt:
        # The reply's sequence has left the core (its cache is whole), but the
        # turn did not end as the user asked: the text said so far is kept, as
        # stopped, and the cache is rebuilt next time to be safe.
        keeper.discard("the previous turn was interrupted")
        text.finish()
        _finish(keeper, history, plan.start + text.text, stopped=True)
        raise
    except BaseException:
        keeper.discard("the previous turn failed before it finished")
        raise

    ended = time.perf_counter()
    decode_s = ended - first_at if first_at is not None else 0.0
    # What this turn put in the cache besides its reply: less than the whole
    # prompt when it was stopped during the prefill.
    evaluated = min(len(keeper.ledger), len(prompt)) - reused
    carried = min(keeper.recomputed, reused)  # recomputed at load: this turn's cost
    keeper.recomputed = 0
    _finish(keeper, history, reply, stopped)
    stats = TurnStats(
        prompt_tokens=len(prompt),
        reused_tokens=reused - carried,
        evaluated_tokens=evaluated + carried,
        prompt_eval_s=prompt_eval_s if prompt_eval_s is not None else ended - prefill_started,
        ttft_s=first_at - started if first_at is not None else 0.0,
        generated_tokens=len(tokens),
        gen_tps=(len(tokens) / decode_s) if decode_s > 0 and tokens else 0.0,
        cache_tokens=keeper.tokens,
        cache_bytes=keeper.nbytes,
        cache_kind=keeper.kind.name,
        active_memory_bytes=memory()[0],
        peak_memory_bytes=memory()[1],
        rebuilt=rebuilt or keeper.pending_rebuild,
        reevaluated_reply_tokens=reevaluated,
        stopped=stopped,
        not_batched=seq.state.not_batched,
        batch_size=seq.state.batch_peak,
    )
    keeper.pending_rebuild = None
    history.add_turn(stats)
    if not stopped:
        keeper.keep_checkpoint()
    yield TurnDone(reply=reply, stats=stats, stopped=stopped, tokens=tuple(tokens))


def prime(lm: LoadedModel, keeper: CacheKeeper, tokens: list[int], step: int) -> tuple[int, int]:
    """Have the cache hold ``tokens`` but the last: what the ledger shares with them is
    kept, the rest evaluated in the generation core beside the replies it decodes (its one
    sampled token is dropped, never fed). Forks of the session made then each evaluate only
    that last token, for its logits, before they sample: one prompt, several replies.
    Returns (tokens kept, tokens evaluated)."""
    kept, _ = keeper.rewind(min(common_prefix(keeper.ledger, tokens), len(tokens) - 1))
    rest = tokens[kept:-1]
    if rest:
        seq = keeper.sequence(
            rest,
            sampler=greedy_sampler,
            processors=[],
            max_tokens=1,
            stop=threading.Event(),
            prefill_step=max(1, step),
        )
        stream = core_for(lm).run(seq)
        try:
            left = next((m for m in stream if isinstance(m, Left)), None) or _last_left(seq)
        finally:
            stream.close()
        if left.error is not None:
            keeper.discard("a prompt's evaluation failed")
            raise left.error
    return kept, len(keeper.ledger) - kept


def _finish(keeper: CacheKeeper, history: History, reply: str, stopped: bool) -> None:
    history.add_reply(reply, stopped)
    keeper.after_turn()
