"""Session: one conversation, its live prompt cache and the token ledger.

The contract (docs/architecture.md, "The engine contract"): every turn renders the whole
message list with the chat template, keeps the longest common prefix of that
rendering and the **ledger** (the token ids whose keys and values are in the
cache, in order), trims the cache back to it, and evaluates only the rest, so
nothing in the cache ever differs from what a fresh run of the same prompt would
compute: edits, regenerates, templates that rewrite old turns and re-tokenised
replies need no special cases.

A Session is the one public face of its collaborators: ``keeper`` (the cache, the
ledger, the checkpoints: :mod:`.maintenance`), ``history`` (the messages, their
branches, the turns' stats: :mod:`.history`), ``runner`` (one turn at a time:
:mod:`.turn`) and the work between turns (:mod:`.upkeep`); what it shows of them is in
:mod:`.views`. Every change of the transcript is a method here that makes the cache follow.

:meth:`Session.send` returns a generator of events, mlx-lm style: :class:`Prefill`
while the prompt is evaluated, a :class:`Chunk` per piece of text and a final
:class:`TurnDone` with the reply and its stats. The TUI and the CLI read the same stream.
A request's own inputs (its sampling, tools, template variables, logprobs, logits
processors) are a :class:`TurnOptions` passed to the turn; the session keeps only its
own ``settings``, which a turn without options samples with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kvchat.engine.caches.kinds import CacheKind, parse_kind
from kvchat.engine.conversation.branches import Branches
from kvchat.engine.conversation.events import (
    ASK_NOTHING,
    Chunk,
    Event,
    GenerationSettings,
    Prefill,
    SessionBusy,
    SessionError,
    Turn,
    TurnDone,
    TurnOptions,
)
from kvchat.engine.conversation.history import History, Message
from kvchat.engine.conversation.maintenance import CacheKeeper, Progress, common_prefix
from kvchat.engine.conversation.stats import Refilled, TurnStats
from kvchat.engine.conversation.template import Variables, render, turn_ends
from kvchat.engine.conversation.turn import Plan, Runner
from kvchat.engine.conversation.upkeep import Upkeep
from kvchat.engine.conversation.views import SessionViews
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.generation.sampling import Sampler
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
    "TurnOptions",
]


class Session(SessionViews):
    """One conversation with its own prompt cache (one cache object per model layer)."""

    def __init__(
        self,
        lm: LoadedModel,
        *,
        kind: str | CacheKind = "standard",
        system: str | None = None,
        settings: GenerationSettings | None = None,
        messages: list[Message] | None = None,
    ):
        self.lm = lm
        self.settings = settings or GenerationSettings()
        messages = list(messages or [])
        if system and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
        self.history = History(messages)
        self.keeper = CacheKeeper(lm, parse_kind(kind), self._system_tokens)
        self.runner = Runner()  # one turn at a time, and its stop flag

    @classmethod
    def restore(
        cls,
        lm: LoadedModel,
        *,
        messages: list[Message],
        kind: str | CacheKind,
        settings: GenerationSettings | None = None,
        ledger: list[int] | None = None,
        cache: list[Any] | None = None,
        turns: list[TurnStats] | None = None,
        archived: list[Message] | None = None,
        branches: Branches | None = None,
    ) -> Session:
        """A session from saved parts. Without a ``cache`` (or ledger) it starts empty;
        the caller decides whether to :meth:`rebuild` it now. ``branches`` must hold
        ``messages`` as its path (:meth:`Branches.from_record` checks that)."""
        session = cls(lm, kind=kind, settings=settings, messages=messages)
        session.history = History(
            session.messages, turns=turns or (), archived=archived or (), branches=branches
        )
        if cache is not None and ledger is not None:
            session.attach(cache, ledger)
        return session

    def fork_prefix(
        self, messages: list[Message] | None = None, tokens: list[int] | None = None
    ) -> Session:
        """A new session with transcript ``messages`` (by default the system prompt), its cache a
        copy of this one's cut to the common prefix with ``tokens`` (else ``messages`` rendered)
        or a checkpoint before: a new chat skips the system prompt, a request its shared part."""
        messages = list(
            messages if messages is not None else self.messages[:1] if self.system else []
        )
        child = Session(self.lm, kind=self.kind, settings=replace(self.settings), messages=messages)
        wanted = tokens if tokens is not None else child.render(messages, False)
        copied = self.keeper.copy_upto(common_prefix(self.keeper.ledger, wanted))
        if copied is not None:
            child.attach(*copied)
        return child

    # ----------------------------------------------------------------- rendering

    def render(
        self,
        messages: list[Message],
        generation_prompt: bool,
        *,
        tools: list[dict[str, Any]] | None = None,
        variables: Variables = None,
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, offering ``tools``
        (OpenAI's function specs) with the template's ``variables``, as a request asks."""
        return render(self.lm, messages, generation_prompt, tools, variables)

    def turn_ends(
        self,
        messages: list[Message],
        tokens: list[int],
        after: int = 0,
        options: TurnOptions = ASK_NOTHING,
    ) -> frozenset[int]:
        """Where in ``tokens`` (``messages`` rendered, with the ``options``' tools and template
        variables) the turns ending past token ``after`` end (:func:`.template.turn_ends`):
        checkpoints go there; none for a cache that keeps none."""
        if not self.keeper.stateful:
            return frozenset()
        rendered = partial(self.render, tools=options.tools, variables=options.variables)
        return turn_ends(rendered, messages, tokens, after)

    def _system_tokens(self) -> int:
        return len(self.render(self.history.messages[:1], False)) if self.system else 0

    # ----------------------------------------------------------------- turns

    def send(self, text: str | Message, options: TurnOptions = ASK_NOTHING) -> Turn:
        """Add a user message (text, or a message with a ``name``) and stream the reply, as the
        request's ``options`` ask (bad input raises :class:`SessionError` here, before any
        change)."""
        return self._turn(self.history.asking(text), options)

    def complete(self, text: str, options: TurnOptions = ASK_NOTHING) -> Turn:
        """Continue ``text`` as written, without the chat template (so without the ``options``'
        start, tools and template variables). The transcript becomes ``text`` as one user
        message, then the reply; the ledger is ``text``'s own tokens, so a later prompt that
        extends ``text`` reuses the cache."""
        return self._run(lambda: Plan.plain(self.lm, text), options)

    def answer(self, results: Sequence[Message] = (), options: TurnOptions = ASK_NOTHING) -> Turn:
        """Reply to the transcript with ``results`` added, as :meth:`send` does: its last
        message must be a tool's result (the caller ran the tool)."""
        return self._turn(self.history.answering(results), options)

    def edit(self, index: int, text: str, options: TurnOptions = ASK_NOTHING) -> Turn:
        """Replace the user message at ``index`` with ``text`` and stream a new reply; what
        followed it stays as another branch."""
        return self._turn(self.history.edited(index, text), options)

    def regenerate(self, index: int | None = None, options: TurnOptions = ASK_NOTHING) -> Turn:
        """A new version of the reply at ``index`` (the last message by default); the old
        one and what followed it stay as another branch. For the last reply the prompt is
        in the cache already, with its logits: no prefill."""
        return self._turn(self.history.regenerating(index), options)

    def stop(self) -> None:
        """Ask the running turn to stop after its current token (thread-safe)."""
        self.runner.stop()

    def keep_in_step(self, stop: StopFlag, share: Callable[[Sampler], Sampler]) -> None:
        """A sharded run's: ``stop`` (a flag every rank checks together) replaces this
        session's, and each turn samples through ``share(sampler)`` (rank 0's token)."""
        self.runner.keep_in_step(stop, share)

    # ------------------------------------------------------- between turns

    @property
    def _upkeep(self) -> Upkeep:
        flag, step = self.runner.flag, self.settings.prefill_step
        return Upkeep(self.keeper, self.history, self.render, self.turn_ends, step, flag)

    def replace_history(self, messages: Sequence[Message]) -> list[Message]:
        """Make ``messages`` the transcript (a client's copy of the conversation) and return
        the one it replaces (to put back if the request fails). The cache stays: the next
        turn's prefix match keeps what it shares with them and evaluates the rest; the
        branches record them at that turn (an old path stays as another branch)."""
        return self._upkeep.replace(messages)

    def revise_reply(self, message: Message, options: TurnOptions = ASK_NOTHING) -> None:
        """Put ``message`` (the reply a client got: cut at a stop string, or with its tool calls)
        in place of the last reply, on its branch too; the cache follows (the transcript
        rendered with the tools and template variables of the turn's ``options``)."""
        self._upkeep.revise_reply(message, options)

    def sync(self) -> None:
        """Trim the cache to what the transcript renders to now."""
        self._upkeep.sync()

    def set_system(self, text: str | None) -> int:
        """Replace the system prompt (``""`` or None: none) and trim the cache to the tokens
        that still match; return how many it keeps. The next turn evaluates only the rest."""
        return self._upkeep.set_system(text)

    def undo(self, turns: int = 1) -> None:
        """Remove the last ``turns`` exchanges (user message and reply) and trim the cache exactly."""
        self._upkeep.undo(turns)

    def restore_archived(self, index: int) -> None:
        """Put archived exchange ``index`` (of ``archived``, as
        :func:`~kvchat.engine.conversation.history.archived_exchanges` splits it) back at
        the end of the transcript; the next turn evaluates what the cache lacks."""
        self._upkeep.restore_archived(index)

    def trim_history(self, max_tokens: int, progress: Progress | None = None) -> int:
        """Drop the oldest exchanges (to ``archived``) until the transcript fits ``max_tokens``,
        and evaluate the kept ones again; returns the number of messages dropped."""
        return self._upkeep.trim(max_tokens, progress)

    def switch_branch(self, index: int, step: int, progress: Progress | None = None) -> Refilled:
        """Make the version ``step`` away from the message at ``index`` the current path; the
        cache is kept up to where the two paths part and the rest evaluated."""
        return self._upkeep.switch(index, step, progress)

    def delete_pair(self, index: int, progress: Progress | None = None) -> Refilled:
        """Delete the user message at ``index`` and every version of its reply; the cache is
        trimmed to the deletion point and the rest evaluated again."""
        return self._upkeep.delete_pair(index, progress)

    def set_kind(self, kind: str | CacheKind, progress: Progress | None = None) -> str | None:
        """Switch the cache kind: None when the live cache was converted in place, else why
        it was rebuilt. ``CacheKindError`` (before any change) for a kind that cannot apply."""
        return self._upkeep.set_kind(kind, progress)

    def rebuild(
        self, reason: str, progress: Progress | None = None, *, next_turn_counts: bool = False
    ) -> str:
        """Recompute the cache from the transcript. With ``next_turn_counts`` (a rebuild at
        load, which no turn reported) the next turn counts those tokens as evaluated."""
        return self._upkeep.rebuild(reason, progress, next_turn_counts)

    def reset(self) -> bool:
        """Empty the cache and keep the transcript: the next turn prefills it all again.
        Returns False (and changes nothing) when the cache was empty already."""
        return self.keeper.reset()

    def attach(self, cache: list[Any], ledger: list[int]) -> None:
        """Take back a cache holding exactly ``ledger`` (as loaded from disk)."""
        self.keeper.attach(cache, ledger)

    def unload(self) -> None:
        """Let go of the cache's memory (it was saved elsewhere); the transcript stays."""
        self.keeper.unload()

    def close(self) -> None:
        """Let go of the cache and the model for good (its tab was closed): a stale reference
        holds neither. The session cannot run again; its transcript stays readable."""
        self.keeper.close()
        del self.lm

    # ----------------------------------------------------------------- turns, run

    def _turn(self, messages: list[Message], options: TurnOptions) -> Turn:
        return self._run(lambda: Plan.chat(self.lm, messages, options), options)

    def _run(self, plan: Callable[[], Plan], options: TurnOptions) -> Turn:
        core_for(self.lm).expect()  # before the prompt is tokenized: turns sent at once
        settings = options.sampling(self.settings)
        ends = partial(self.turn_ends, options=options)
        return self.runner.start(
            self.lm, self.keeper, self.history, plan(), settings, options, ends
        )
