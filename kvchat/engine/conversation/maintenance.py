"""Cache maintenance for a Session: rewind, rebuild, undo, trim, switch kind.

Kept apart from the turn itself (:mod:`kvchat.engine.conversation.session`); every method
here leaves the ledger equal to what the cache holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from kvchat.engine.caches import checkpoints as checkpoint_bounds
from kvchat.engine.caches.checkpoints import stateful_paths, what_cannot_go_back
from kvchat.engine.caches.kinds import (
    CacheKind,
    after_turn,
    convert_cache,
    group_size,
    make_cache,
    parse_kind,
    settle,
    trim_to,
)
from kvchat.engine.conversation.events import Prefill, SessionError
from kvchat.engine.conversation.stats import CacheChange

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvchat.engine.caches.checkpoints import Checkpoints
    from kvchat.engine.conversation.branches import Branches
    from kvchat.engine.conversation.events import GenerationSettings
    from kvchat.engine.conversation.stats import TurnStats
    from kvchat.engine.generation.sequence import StopFlag
    from kvchat.engine.models.model import LoadedModel

    Progress = Callable[[int, int], None]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CacheMaintenance:
    """The cache-changing operations of :class:`~kvchat.engine.conversation.session.Session` (a mixin:
    it uses the session's ``cache``, ``ledger``, ``messages``, ``kind``, ``settings`` and
    ``checkpoints``)."""

    last_change: CacheChange | None = None  # maintenance since the last turn, if any

    # What the Session this is part of provides.
    lm: LoadedModel
    kind: CacheKind
    settings: GenerationSettings
    messages: list[dict[str, Any]]
    archived: list[dict[str, Any]]
    turns: list[TurnStats]
    branches: Branches
    ledger: list[int]
    cache: list[Any]
    checkpoints: Checkpoints
    _logits: tuple[int, mx.array] | None
    _stop: StopFlag
    _pending_rebuild: str | None  # why the cache was dropped, until it is refilled

    if TYPE_CHECKING:

        @property
        def system(self) -> str | None: ...

        @property
        def cache_tokens(self) -> int: ...

        def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]: ...

        def _system_tokens(self) -> int: ...

        def _keep_turns(self, messages: list[dict[str, Any]]) -> None: ...

        def talk(self) -> list[dict[str, Any]]: ...

        def _record(self) -> None: ...

    def _changed(self, action: str, evaluated: int = 0) -> None:
        """Record maintenance work on the cache (the next turn clears it)."""
        self.last_change = CacheChange(action, self.cache_tokens, evaluated)

    def _prefill(
        self, tokens: list[int], total: int, marks: frozenset[int] = frozenset()
    ) -> Iterator[Prefill]:
        """Evaluate ``tokens`` into the cache in chunks, yielding progress; stops early on stop().

        A checkpoint is kept where the ledger reaches a length in ``marks``.
        """
        step = max(1, self.settings.prefill_step)
        start = len(self.ledger)
        end = start + len(tokens)
        cuts = sorted(
            {*range(start + step, end, step), *(m for m in marks if start < m < end), end}
        )
        yield Prefill(0, total)
        with mx.stream(generation_stream):
            for cut in cuts if tokens else ():
                if self._stop.is_set():
                    return
                chunk = tokens[len(self.ledger) - start : cut - start]
                self.lm.model(mx.array(chunk)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.ledger.extend(chunk)
                if cut in marks:
                    self.checkpoints.keep(self.cache, cut)
                yield Prefill(cut - start, total)
                mx.clear_cache()

    def _rewind(self, n: int) -> tuple[int, str | None]:
        """Make the cache hold ``ledger[:n]``, or failing that the ledger up to the nearest
        checkpoint before ``n``, or failing that nothing (a rebuild).

        Returns how many tokens the cache holds now, and the reason it had to be
        emptied (None when it was not).
        """
        if n >= len(self.ledger):
            return len(self.ledger), None
        kept = n if trim_to(self.cache, n) else self.checkpoints.restore(self.cache, n)
        if kept is not None:
            settle(self.cache)
            self._set_ledger(self.ledger[:kept])
            return kept, None
        reason = f"the {self.kind.name} cache could not be trimmed back to token {n}"
        stateful = what_cannot_go_back(self.cache)
        if stateful:
            reason += f": it holds {stateful}, and no checkpoint is that early"
        self._discard(reason)
        return 0, reason

    def _set_ledger(self, ledger: list[int]) -> None:
        self.ledger = ledger
        self.checkpoints.forget_after(len(ledger))
        if self._logits is not None and self._logits[0] > len(ledger):
            self._logits = None

    def _discard(self, reason: str) -> None:
        """Replace the cache with an empty one; the next turn evaluates everything."""
        self.unload()
        self._pending_rebuild = reason
        self._recomputed = 0

    def unload(self) -> None:
        """Let go of the cache's memory (it was saved elsewhere); the transcript stays."""
        self.cache = make_cache(self.lm.model, self.kind, keep=self._system_tokens())
        self.ledger = []
        self._logits = None
        self.checkpoints.clear()

    def close(self) -> None:
        """Let go of the cache and the model for good (its tab was closed), so a stale
        reference to the session (a finished worker's, say) holds neither in memory.
        The session cannot run again; its transcript stays readable."""
        self.cache, self.ledger, self._logits = [], [], None
        self.checkpoints.clear()
        del self.lm
        mx.clear_cache()

    @property
    def prompt_logprobs(self) -> tuple[int, mx.array] | None:
        """The log-probabilities at the end of the last prompt and its length: with the
        checkpoint there, a regenerate samples from them and evaluates nothing."""
        return self._logits

    @prompt_logprobs.setter
    def prompt_logprobs(self, value: tuple[int, mx.array]) -> None:
        if not 0 < value[0] <= len(self.ledger):
            raise ValueError(f"log-probabilities at token {value[0]} of {len(self.ledger)}")
        self._logits = value

    def attach(self, cache: list[Any], ledger: list[int]) -> None:
        """Take back a cache holding exactly ``ledger`` (as loaded from disk)."""
        self.cache, self.ledger = cache, list(ledger)
        self._logits = None
        self.checkpoints.clear()
        settle(cache)

    def reset(self) -> bool:
        """Empty the cache and keep the transcript: the next turn prefills it all again.

        Returns False (and changes nothing) when the cache was empty already.
        """
        if not self.ledger:
            return False
        self._discard("the cache was reset")
        self._changed("reset")
        return True

    def rebuild(
        self, reason: str, progress: Progress | None = None, *, next_turn_counts: bool = False
    ) -> str:
        """Recompute the cache from the transcript (exact), reporting progress. With
        ``next_turn_counts`` (a rebuild at load, which no turn reported) the next turn
        counts the recomputed tokens as evaluated, not reused."""
        self._discard(reason)
        _, evaluated = self._refill(progress)  # from nothing: the whole transcript
        self._recomputed = evaluated if next_turn_counts else 0
        return reason

    def _turn_ends(
        self, messages: list[dict[str, Any]], tokens: list[int], after: int = 0
    ) -> frozenset[int]:
        """Where in ``tokens`` (the rendering of ``messages``) the prompts and replies that
        end past token ``after`` end, for checkpoints while they are evaluated again; none
        for a model that keeps no checkpoints.

        Only the newest :data:`~kvchat.engine.caches.checkpoints.MAX_CHECKPOINTS`: a prefill
        keeping more would drop the older ones as it kept newer ones. So the transcript
        is rendered up to each reply from the newest back, until that many are found
        or the renderings end before ``after`` (they grow with the transcript): a
        bounded number of renderings, not two per reply (which made a rebuild of a
        long conversation quadratic in its length) — unless a template rewrites every
        earlier turn, so that no rendering up to a reply is a prefix of the whole.
        """
        if not stateful_paths(self.cache):
            return frozenset()
        ends: set[int] = set()
        for i in reversed(range(len(messages))):
            if len(ends) >= checkpoint_bounds.MAX_CHECKPOINTS:
                break
            if messages[i]["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], True)
            for part in (prompt, self.render(messages[: i + 1], False)):
                # a template may rewrite earlier turns: only a prefix of ``tokens`` counts
                if len(part) > after and tokens[: len(part)] == part:
                    ends.add(len(part))
            if len(prompt) <= after:
                break
        return frozenset(sorted(ends)[-checkpoint_bounds.MAX_CHECKPOINTS :])

    def sync(self) -> None:
        """Trim the cache to what the transcript renders to now (after undo or an edit)."""
        tokens = self.render(self.messages, False)
        self._rewind(common_prefix(self.ledger, tokens))

    def set_system(self, text: str | None) -> int:
        """Replace the system prompt (``""`` or None: none) and trim the cache to the tokens
        that still match; return how many it keeps. The next turn evaluates only the rest."""
        rest = self.talk()
        kept_head = self._system_tokens()
        self.messages = ([{"role": "system", "content": text}] if text else []) + rest
        if self.kind.family == "rotating" and self._system_tokens() != kept_head:
            self.unload()  # a rotating cache's never-evicted head is fixed when it is made
        else:
            self.sync()
        self._changed("system prompt")
        return len(self.ledger)

    def undo(self, turns: int = 1) -> None:
        """Remove the last ``turns`` exchanges (user message and reply) and trim the cache exactly."""
        self._record()
        messages = list(self.messages)
        removed = 0
        while removed < turns and any(m["role"] == "user" for m in messages):
            if messages.pop()["role"] == "user":
                removed += 1
        if not removed:
            raise SessionError("Nothing to undo: there is no user message yet.")
        self.messages = messages
        self._keep_turns(messages)
        self.branches.truncate(len(self.talk()))
        self.sync()
        self._changed("undo")

    def trim_history(self, max_tokens: int, progress: Progress | None = None) -> int:
        """Drop the oldest exchanges, keeping the system prompt, until the transcript fits ``max_tokens``.

        Exact semantics: the cache is trimmed back to the system prompt and the
        kept turns are evaluated again, so it equals a fresh run of the
        shortened transcript. Dropped turns move to ``archived``. Returns the
        number of messages dropped.
        """
        self._record()
        keep_system = 1 if self.system else 0
        messages = list(self.messages)
        dropped: list[dict[str, Any]] = []
        while len(self.render(messages, False)) > max_tokens:
            if len(messages) <= keep_system:
                raise SessionError(
                    f"The system prompt alone is over {max_tokens:,} tokens; nothing to trim to."
                )
            first = messages.pop(keep_system)
            dropped.append(first)
            # an exchange goes whole: drop the replies that answered this message too
            while len(messages) > keep_system and messages[keep_system]["role"] != "user":
                dropped.append(messages.pop(keep_system))
        if not dropped:
            return 0
        self.archived.extend(dropped)
        self.messages = messages
        del self.turns[: sum(m["role"] == "assistant" for m in dropped)]
        self.branches.drop_first(len(dropped))
        _, evaluated = self._refill(progress)
        self._changed("trim", evaluated)
        return len(dropped)

    def _refill(self, progress: Progress | None = None) -> tuple[int, int]:
        """Make the cache hold exactly what the transcript renders to now: trim it to the
        common prefix with the ledger and evaluate the rest. Returns (reused, evaluated)."""
        self._stop.clear()
        tokens = self.render(self.messages, False)
        self._rewind(common_prefix(self.ledger, tokens))
        reused = len(self.ledger)
        marks = self._turn_ends(self.messages, tokens, reused)
        for event in self._prefill(tokens[reused:], len(tokens) - reused, marks):
            if progress:
                progress(event.done, event.total)
        after_turn(self.cache)
        self._pending_rebuild = None  # the whole transcript is in the cache again
        return reused, len(tokens) - reused

    def set_kind(self, kind: str | CacheKind, progress: Progress | None = None) -> str | None:
        """Switch the cache kind, converting the live cache where the data allows.

        Returns None when the cache was converted in place, else the reason it
        was rebuilt from the transcript. Raises ``CacheKindError`` for a kind
        that cannot apply to this model, before anything changes.
        """
        new = parse_kind(kind)
        if new == self.kind:
            return None
        make_cache(self.lm.model, new)  # raises if the kind cannot apply to this model
        old, self.kind = self.kind, new
        converted = convert_cache(self.cache, old, new, group_size(self.lm.model, new))
        if converted is not None:
            # Only plain key/value layers changed: the sliding-window and recurrent layers,
            # which are all a checkpoint holds, are the same objects, so the checkpoints stay.
            self.cache, self._logits = converted, None
            settle(converted)
            self._changed("kind change")
            return None
        reason = self.rebuild(f"cache kind changed from {old.name} to {new.name}", progress)
        self._changed("kind change", len(self.ledger))  # all of it evaluated again
        return reason
