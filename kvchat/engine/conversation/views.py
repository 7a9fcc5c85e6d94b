"""What a session shows of itself: the transcript, the ledger, the cache's figures, the
branches. Read-only views of the session's parts (the
:class:`~kvchat.engine.conversation.maintenance.CacheKeeper` and the
:class:`~kvchat.engine.conversation.history.History`), apart from what
:class:`~kvchat.engine.conversation.session.Session` does: each change goes through one
of its methods, so that the cache follows the transcript.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat.engine.conversation.stats import CacheFigures

if TYPE_CHECKING:
    import mlx.core as mx

    from kvchat.engine.caches.checkpoints import Checkpoints
    from kvchat.engine.caches.kinds import CacheKind
    from kvchat.engine.conversation.branches import Branches
    from kvchat.engine.conversation.history import History, Message
    from kvchat.engine.conversation.maintenance import CacheKeeper
    from kvchat.engine.conversation.stats import CacheChange, TurnStats
    from kvchat.engine.conversation.turn import Runner


class SessionViews:
    """The views of a :class:`~kvchat.engine.conversation.session.Session`, which sets
    its ``keeper``, ``history`` and ``runner``. Lists are copies."""

    keeper: CacheKeeper
    history: History
    runner: Runner

    @property
    def messages(self) -> list[Message]:
        """The transcript (a copy: it changes through the session's methods only)."""
        return [dict(m) for m in self.history.messages]

    @property
    def ledger(self) -> list[int]:
        """The tokens the cache holds, in order (a copy)."""
        return list(self.keeper.ledger)

    @property
    def kind(self) -> CacheKind:
        return self.keeper.kind

    @property
    def cache(self) -> list[Any]:
        return self.keeper.cache

    @property
    def checkpoints(self) -> Checkpoints:
        return self.keeper.checkpoints

    @property
    def turns(self) -> list[TurnStats]:
        """One entry per reply on the current path, oldest first (a copy)."""
        return list(self.history.turns)

    @property
    def archived(self) -> list[Message]:
        """Exchanges ``trim_history`` and ``undo`` dropped, kept for the record and for
        ``restore_archived`` (a copy)."""
        return list(self.history.archived)

    @property
    def branches(self) -> Branches:
        """Every path the messages have taken."""
        return self.history.branches

    @property
    def system(self) -> str | None:
        return self.history.system

    @property
    def answering(self) -> bool:
        """Whether a turn of this session is running (its cache and ledger are the
        turn's until it ends: views read :meth:`figures` taken before)."""
        return self.runner.busy

    @property
    def cache_tokens(self) -> int:
        """Tokens whose keys and values the cache holds now."""
        return self.keeper.tokens

    @property
    def cache_bytes(self) -> int:
        """Bytes the held tokens take (what a save writes)."""
        return self.keeper.nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes the cache's buffers hold in memory, free slots included."""
        return self.keeper.allocated

    @property
    def pending_rebuild(self) -> str | None:
        """Why the cache was emptied since the last turn (reset, failed turn, ...), if it was."""
        return self.keeper.pending_rebuild

    @property
    def last_change(self) -> CacheChange | None:
        """Maintenance work on the cache since the last turn (undo, trim...), if any."""
        return self.keeper.last_change

    @property
    def last_stats(self) -> TurnStats | None:
        turns = self.history.turns
        return turns[-1] if turns else None

    @property
    def prompt_logprobs(self) -> tuple[int, mx.array] | None:
        """The log-probabilities at the end of the last prompt and its length: with the
        checkpoint there, a regenerate samples from them and evaluates nothing (the store
        puts saved ones back)."""
        return self.keeper.prompt_logprobs

    @prompt_logprobs.setter
    def prompt_logprobs(self, value: tuple[int, mx.array]) -> None:
        self.keeper.prompt_logprobs = value

    def figures(self) -> CacheFigures:
        """What the views show of this session, as of now (call it between turns)."""
        keeper, history = self.keeper, self.history
        turns = history.turns
        return CacheFigures(
            cache_tokens=keeper.tokens,
            cache_bytes=keeper.nbytes,
            checkpoints=(len(keeper.checkpoints), keeper.checkpoints.nbytes),
            user_turns=sum(1 for m in history.messages if m["role"] == "user"),
            last=turns[-1] if turns else None,
            prompt_eval_history=tuple(t.prompt_eval_s for t in turns),
            pending_rebuild=keeper.pending_rebuild,
        )

    def talk(self) -> list[Message]:
        """The messages without the system prompt: what the branches are made of."""
        return self.history.talk()

    def branch_record(self) -> dict[str, Any] | None:
        """The branches as saved in ``session.json``; None while there is only one path.
        Changes nothing (a save may read it while another thread holds the session)."""
        return self.history.branch_record()

    def branch_positions(self) -> list[tuple[int, int]]:
        """(k, n) for each message of ``messages``: it is version k of n (1 of 1 for the
        system prompt, and for all while the tree has not caught up with the messages)."""
        return self.history.positions()

    def branch_position(self, index: int) -> tuple[int, int]:
        """(k, n): the message at ``index`` of ``messages`` is version k of n."""
        return self.history.positions()[index]
