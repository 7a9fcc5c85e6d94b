"""Batched = alone: conversations decoded together through one generation core, each
reply and each ledger compared with the same conversation run alone.

A reply in a batch must be the reply alone, token for token, whoever decodes
beside it: a token of another conversation in a reply is wrong and leaks. A round
starts its conversations as a server does: each a new session of one pool
(:meth:`~kvchat.runtime.pool.SessionPool.new_session`), started from a copy of another live
session's cache cut to the shared system prompt where there is one; then sends
them at once or one after another while the others decode (joins), some stopped
by their reader, some with penalties, a seed or log probabilities. Alone, each runs
in a fresh session of its own. ``kvchat doctor --batch`` runs it on the user's model;
the suite and ``tests/batch_stress.py`` run it on many families, under load and with
scheduling delays (a ``pause`` hook called between the events a reader reads).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import mlx.core as mx

from kvchat.engine.caches.kinds import make_cache, parse_kind
from kvchat.engine.conversation.events import (
    Chunk,
    GenerationSettings,
    TokenLogprobs,
    TurnDone,
    TurnOptions,
)
from kvchat.engine.conversation.session import Session
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.sampling import Draw, for_settings
from kvchat.engine.generation.sequence import log_probs
from kvchat.engine.generation.threads import clear_mlx_at_thread_end
from kvchat.engine.models import demo
from kvchat.runtime.pool import SessionPool

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

SYSTEM = "You answer questions about the text the user gives, briefly and plainly."
NEAR = 1e-4  # how far a batch's log probabilities may move from one row's (rounding)
TRIES = 48  # draws with the log probabilities moved that far or less, to find a near tie


@dataclass(frozen=True)
class Conversation:
    """One conversation of a round: its message, how it samples, and how it is read."""

    text: str
    settings: GenerationSettings
    delay: float = 0.0  # seconds after the round starts before it is sent (a join)
    stop_after: int | None = None  # reply pieces read before its reader stops it
    logprobs: int | None = None  # alternatives each token's log probabilities carry

    def label(self) -> str:
        """A short description: its length and what is special about it."""
        s = self.settings
        traits = [f"{len(self.text.split())} words"]
        traits += ["seeded draws"] if s.seed is not None else []
        traits += ["penalties"] if s.repetition_penalty != 1.0 or s.presence_penalty else []
        traits += ["log probabilities"] if self.logprobs is not None else []
        traits += [f"joined after {self.delay * 1000:.0f} ms"] if self.delay else []
        traits += [f"stopped after {self.stop_after} pieces"] if self.stop_after else []
        return ", ".join(traits)


@dataclass(frozen=True)
class Reply:
    """What a conversation's turn left: its tokens, its session's ledger and cache."""

    tokens: tuple[int, ...]
    prompt: int  # tokens of the prompt, the first of the ledger
    ledger: tuple[int, ...]
    held: int  # tokens its cache holds after the turn
    stopped: bool
    logprobs: tuple[float, ...] = ()  # each token's, where reported
    batch_size: int = 1  # the most rows of a forward pass that decoded it
    not_batched: str | None = None


def words(n: int, rng: random.Random) -> str:
    """``n`` words of the demo corpus from a random place (any model's tokenizer takes them)."""
    corpus = demo.corpus_parts()[0].split()
    start = rng.randrange(max(1, len(corpus) - n))
    return " ".join(corpus[start : start + n])


def conversations(
    rng: random.Random, count: int, max_tokens: int, long_words: int = 260
) -> list[Conversation]:
    """A round's mix: the first long (about 390 tokens), the rest short; greedy, with
    penalties, seeded draws and log probabilities among them; some sent while the
    others decode, some stopped by their reader."""
    chosen = []
    for i in range(count):
        text = words(long_words if i == 0 else rng.randint(3, 30), rng)
        settings = GenerationSettings(max_tokens=max_tokens, temp=0.0, ignore_eos=True)
        kind = rng.choice(["greedy", "greedy", "penalty", "seeded", "logprobs"])
        if kind == "penalty":
            settings = replace(settings, repetition_penalty=1.3, presence_penalty=0.5)
        elif kind == "seeded":
            settings = replace(settings, temp=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
        chosen.append(
            Conversation(
                text,
                settings,
                delay=0.0 if i < 2 or rng.random() < 0.5 else rng.uniform(0.0, 0.2),
                stop_after=rng.randint(1, max_tokens) if rng.random() < 0.2 else None,
                logprobs=rng.choice([0, 3]) if kind == "logprobs" else None,
            )
        )
    return chosen


def _read(session: Session, conv: Conversation, pause: Callable[[], None]) -> Reply:
    """Run ``conv``'s turn in ``session``, reading its events as a client does."""
    pieces, logprobs = 0, []
    done = None
    for event in session.send(conv.text, TurnOptions(report_logprobs=conv.logprobs)):
        pause()
        if isinstance(event, TokenLogprobs):
            logprobs.append(event.logprob)
        elif isinstance(event, Chunk):
            pieces += 1
            if conv.stop_after is not None and pieces >= conv.stop_after:
                session.stop()
        elif isinstance(event, TurnDone):
            done = event
    if done is None:
        raise RuntimeError("A turn ended without its TurnDone.")
    return Reply(
        done.tokens,
        done.stats.prompt_tokens,
        tuple(session.ledger),
        session.cache_tokens,
        done.stopped,
        tuple(logprobs),
        done.stats.batch_size,
        done.stats.not_batched,
    )


def alone(lm: LoadedModel, conv: Conversation, system: str = SYSTEM) -> Reply:
    """``conv`` in a fresh session of its own, read to its end (never stopped)."""
    session = Session(lm, system=system, settings=conv.settings)
    return _read(session, replace(conv, stop_after=None), lambda: None)


def together(
    lm: LoadedModel,
    convs: list[Conversation],
    pool: SessionPool,
    pause: Callable[[], None] = lambda: None,
    system: str = SYSTEM,
) -> list[Reply]:
    """Run ``convs`` at once, each on its own thread in a new session of ``pool`` (which
    starts from another live session's cache where one shares the system prompt, as a
    server's does), sent after its ``delay``; their replies in order."""
    lock = threading.Lock()  # the pool is called by one thread at a time (a server's ticket)
    out: dict[int, Reply | BaseException] = {}
    names = [f"batch-check-{time.monotonic_ns()}-{i}" for i in range(len(convs))]

    def run(i: int, conv: Conversation) -> None:
        clear_mlx_at_thread_end()  # its session's turn uses MLX on this thread
        try:
            time.sleep(conv.delay)
            with lock:
                session = pool.new_session(lm, "standard", system, conv.settings, name=names[i])
            out[i] = _read(session, conv, pause)
        except BaseException as error:  # noqa: BLE001  raised again on the caller's thread
            out[i] = error

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(convs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in pool.names():  # the next round starts from these, as a server's would
        if name not in names:
            pool.drop(name)
    replies = [out[i] for i in range(len(convs))]
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return [r for r in replies if isinstance(r, Reply)]


def differences(conv: Conversation, got: Reply, want: Reply) -> list[str]:
    """How a reply in a batch differs from the reply alone (nothing when it does not):
    the tokens (a stopped one's are a prefix), the ledger, the cache, log probabilities."""
    n = len(got.tokens)
    problems = []
    if got.tokens != want.tokens[:n] or (not got.stopped and n != len(want.tokens)):
        first = next((i for i, t in enumerate(got.tokens) if t != want.tokens[i]), n)
        problems.append(f"tokens differ from token {first} of {n}")
    # the prompt, then the reply but its last token (which some caches take in too; a
    # stopped reply's recurrent state may hold tokens sampled after the stop was asked)
    prompt = want.prompt
    full = (*want.ledger[:prompt], *want.tokens)
    fed = len(got.ledger) - prompt
    if got.ledger != full[: len(got.ledger)] or fed < n - 1 or (fed > n and not got.stopped):
        at = next((i for i, (x, y) in enumerate(zip(got.ledger, full)) if x != y), None)
        problems.append(
            f"the ledger differs ({len(got.ledger)} tokens for a prompt of {prompt} and "
            f"{n} sampled{'' if at is None else f'; from token {at}'})"
        )
    if got.held != len(got.ledger):
        problems.append(f"the cache holds {got.held} tokens, the ledger {len(got.ledger)}")
    off = [abs(a - b) for a, b in zip(got.logprobs, want.logprobs)]
    if conv.logprobs is not None and (len(got.logprobs) != n or max(off, default=0) > 1e-3):
        problems.append(f"log probabilities differ (by {max(off, default=0):.2g})")
    return problems


def near_tie(lm: LoadedModel, conv: Conversation, want: Reply, k: int, token: int) -> bool:
    """Whether ``token``, drawn in a batch at reply position ``k`` where the reply alone
    drew another from the same context, is what the conversation's own sampler (its
    penalties, its seeded key at that token) draws alone once the log probabilities
    move by rounding (up to :data:`NEAR`; :data:`TRIES` tries): a flip at a near tie, which a batch's
    products (other shapes, other sums) can cause, not another conversation's token."""
    context = [*want.ledger[: want.prompt], *want.tokens[:k]]
    with GATE.exclusive():
        logits = lm.model(mx.array([context]), cache=make_cache(lm.model, parse_kind("standard")))
        logits = logits[:, -1, :]
        sampler, processors = for_settings(conv.settings)
        for processor in processors:
            logits = processor(mx.array(context), logits)
        logprobs = log_probs(logits)
        for _ in range(k):  # a seeded draw splits its key once a token
            sampler(logprobs)
        key = sampler.key if isinstance(sampler, Draw) else None
        for trial in range(TRIES):  # moved by NEAR, and by a tenth and a hundredth of it
            if isinstance(sampler, Draw):
                sampler.key = key
            scale = NEAR / 10 ** (trial % 3)
            noise = scale * mx.random.normal(logprobs.shape, key=mx.random.key(trial))
            if sampler(logprobs + noise).item() == token:
                return True
    return False


@dataclass(frozen=True)
class Outcome:
    """A round's conversation: what it was, what came back, and how it differed (or
    ``flip``: where it parted from the reply alone at a near tie, all equal before)."""

    conv: Conversation
    got: Reply
    problems: tuple[str, ...]
    flip: str | None = None


def outcome(lm: LoadedModel, conv: Conversation, got: Reply) -> Outcome:
    """``got`` against ``conv`` run alone."""
    want = alone(lm, conv)
    problems = differences(conv, got, want)
    k = next((i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b), None)
    if not problems or k is None:
        return Outcome(conv, got, tuple(problems))
    before = replace(got, tokens=got.tokens[:k], ledger=got.ledger[: got.prompt + k - 1])
    before = replace(before, held=len(before.ledger), logprobs=got.logprobs[:k], stopped=True)
    agreed = not differences(conv, before, want) and got.held == len(got.ledger)
    if agreed and near_tie(lm, conv, want, k, got.tokens[k]):
        return Outcome(conv, got, (), flip=f"token {k} of {len(got.tokens)}, a near tie")
    return Outcome(conv, got, tuple(problems))


def check_round(
    lm: LoadedModel,
    convs: list[Conversation],
    pool: SessionPool,
    pause: Callable[[], None] = lambda: None,
) -> list[Outcome]:
    """One round: ``convs`` together, then each alone, compared."""
    got = together(lm, convs, pool, pause)
    return [outcome(lm, conv, reply) for conv, reply in zip(convs, got, strict=True)]


@dataclass(frozen=True)
class PathCheck:
    """The rounds run on one decoding path of a model, and how they came out."""

    path: str  # how its batches decode (kvchat.engine.generation.paths.decoding_path)
    outcomes: tuple[Outcome, ...]

    @property
    def differed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problems]

    def lines(self) -> list[str]:
        """What a user reads: the path, the replies that matched, the widest batch, the
        conversations that decoded alone and why, and each difference."""
        widest = max((o.got.batch_size for o in self.outcomes), default=1)
        matched = len(self.outcomes) - len(self.differed)
        verdict = "all matched" if not self.differed else f"{len(self.differed)} DIFFERED"
        lines = [
            self.path,
            f"  {len(self.outcomes)} replies in batches of up to {widest} rows, each compared "
            f"with the reply alone: {matched} matched, {verdict}",
        ]
        alone_why = sorted({o.got.not_batched for o in self.outcomes if o.got.not_batched})
        lines += [f"  decoded beside the batch, not in it: {why}" for why in alone_why]
        lines += [f"  {o.conv.label()}: {'; '.join(o.problems)}" for o in self.differed]
        flips = [o for o in self.outcomes if o.flip]
        if flips:
            lines.append(
                f"  {len(flips)} of the matched parted from the reply alone at a near tie "
                "(rounding: every token before was the same, and alone, log probabilities "
                f"moved by {NEAR:g} draw the batch's token)"
            )
        return lines


def check_paths(
    lm: LoadedModel, rounds: int = 2, count: int = 4, max_tokens: int = 24, seed: int = 0
) -> list[PathCheck]:
    """``rounds`` rounds of ``count`` conversations on each path ``lm``'s batches can take
    here: the CPU fast path's numpy rows, where it decodes, and MLX's own (merged into
    mlx-lm's batch caches, or a forward pass a row where the model cannot merge)."""
    from kvchat.engine.generation.paths import NumpyRows, choose, decoding_path

    fast = lm.fast_path
    switches: list[bool | None] = [True, False] if choose(True, fast) is NumpyRows else [None]
    checks = []
    for on in switches:
        if on is not None:
            fast.on = on
        try:
            rng, pool, outcomes = random.Random(seed), SessionPool(None, None), []
            for _ in range(rounds):
                convs = conversations(rng, count, max_tokens)
                outcomes += check_round(lm, convs, pool)
            checks.append(PathCheck(decoding_path(lm), tuple(outcomes)))
        finally:
            if on is not None:
                fast.on = True
    return checks
