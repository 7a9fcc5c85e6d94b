"""The work on a session between its turns: each change of its history (undo, trim, a
branch switch, a new system prompt, a transcript set by a server), then its cache made
to hold what the history renders to now, reusing what still matches.

An :class:`Upkeep` is made for each call from the session's parts (its cache keeper,
its history, its rendering), so it holds nothing of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.engine.caches.kinds import CacheKind, parse_kind
from kvchat.engine.conversation.events import ASK_NOTHING
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.stats import Refilled

if TYPE_CHECKING:
    from kvchat.engine.conversation.events import TurnOptions
    from kvchat.engine.conversation.history import History, Message
    from kvchat.engine.conversation.maintenance import CacheKeeper, Progress
    from kvchat.engine.conversation.template import Render
    from kvchat.engine.conversation.turn import TurnEnds
    from kvchat.engine.generation.sequence import StopFlag


@dataclass(frozen=True)
class Upkeep:
    """``render(messages, generation_prompt)`` is the session's chat template (a request's
    tools and variables by keyword); ``turn_ends``
    where a refill keeps checkpoints; ``step`` the prefill's chunk; ``stop`` the
    session's stop flag (a refill ends early once it is set)."""

    keeper: CacheKeeper
    history: History
    render: Render
    turn_ends: TurnEnds
    step: int
    stop: StopFlag

    def sync(self, options: TurnOptions = ASK_NOTHING) -> None:
        """Trim the cache to what the transcript renders to now (with the tools and template
        variables of the turn's ``options``, as the turn that filled it rendered it)."""
        messages = self.history.messages
        tokens = self.render(messages, False, tools=options.tools, variables=options.variables)
        self.keeper.rewind(common_prefix(self.keeper.ledger, tokens))

    def refill(self, progress: Progress | None = None) -> Refilled:
        """Make the cache hold exactly what the transcript renders to now: trim it to the
        common prefix with the ledger and evaluate the rest."""
        self.stop.clear()
        messages = self.history.messages
        tokens = self.render(messages, False)
        self.keeper.rewind(common_prefix(self.keeper.ledger, tokens))
        reused = len(self.keeper.ledger)
        marks = self.turn_ends(messages, tokens, reused)
        evaluated = self.keeper.fill(
            tokens, step=self.step, stop=self.stop, marks=marks, progress=progress
        )
        return Refilled(reused, evaluated)

    def rebuild(self, reason: str, progress: Progress | None, next_turn_counts: bool) -> str:
        """Recompute the cache from nothing; with ``next_turn_counts`` the next turn counts
        the recomputed tokens as evaluated."""
        self.keeper.discard(reason)
        evaluated = self.refill(progress).evaluated
        self.keeper.recomputed = evaluated if next_turn_counts else 0
        return reason

    def replace(self, messages: Sequence[Message]) -> list[Message]:
        """Make ``messages`` the transcript (the next turn's prefix match keeps what the
        cache still shares with it); returns the one it replaces."""
        head = self.keeper.head
        previous = self.history.replace(messages)
        self._follow_head(head)
        return previous

    def set_system(self, text: str | None) -> int:
        """Replace the system prompt and trim the cache to what still matches; returns the
        tokens it keeps."""
        head = self.keeper.head
        self.history.set_system(text)
        if not self._follow_head(head):
            self.sync()
        self.keeper.changed("system prompt")
        return len(self.keeper.ledger)

    def _follow_head(self, head: int) -> bool:
        """A rotating cache's never-evicted head is fixed when it is made: let the cache go
        when the system prompt's length changed from ``head``. True if it went."""
        if self.keeper.kind.family != "rotating" or self.keeper.head == head:
            return False
        self.keeper.unload()
        return True

    def revise_reply(self, message: Message, options: TurnOptions) -> None:
        """Put ``message`` in place of the last reply and trim the cache to match (the
        transcript rendered as the turn's ``options`` asked)."""
        self.history.revise_reply(message)
        self.sync(options)

    def undo(self, turns: int) -> None:
        self.history.undo(turns)
        self.sync()
        self.keeper.changed("undo")

    def restore_archived(self, index: int) -> None:
        """Put archived exchange ``index`` back at the end of the transcript; the cache
        keeps what still matches, and the next turn's prefix match evaluates the rest."""
        self.history.restore_archived(index)
        self.sync()
        self.keeper.changed("restore")

    def trim(self, max_tokens: int, progress: Progress | None) -> int:
        """Drop the oldest exchanges until the transcript fits ``max_tokens``, then refill."""
        dropped = self.history.trim(
            lambda messages: len(self.render(messages, False)) > max_tokens, max_tokens
        )
        if dropped:
            self.keeper.changed("trim", self.refill(progress).evaluated)
        return dropped

    def switch(self, index: int, step: int, progress: Progress | None) -> Refilled:
        self.history.switch(index, step)
        return self._refilled(progress, "branch switch")

    def delete_pair(self, index: int, progress: Progress | None) -> Refilled:
        self.history.remove_pair(index)
        return self._refilled(progress, "delete exchange")

    def _refilled(self, progress: Progress | None, action: str) -> Refilled:
        refilled = self.refill(progress)
        self.keeper.changed(action, refilled.evaluated)
        return refilled

    def set_kind(self, kind: str | CacheKind, progress: Progress | None) -> str | None:
        """Switch the cache kind: None when the cache was converted in place, else why it
        was rebuilt from the transcript."""
        new = parse_kind(kind)
        if new == self.keeper.kind:
            return None
        reason = self.keeper.set_kind(new)
        if reason is not None:
            self.refill(progress)
        # converted: nothing evaluated; rebuilt: all of it evaluated again
        self.keeper.changed("kind change", 0 if reason is None else len(self.keeper.ledger))
        return reason
