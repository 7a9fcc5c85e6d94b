"""The branch operations of a Session: edit an earlier message, regenerate any reply,
switch branch, delete a message pair.

A mixin of :class:`~kvchat.engine.conversation.session.Session` (it uses the session's
``messages``, ``branches``, ``turns``, ``_turn`` and ``_refill``). Edits and
regenerates are ordinary turns on a shortened transcript, so the engine's prefix
match trims the cache to the edit point by itself; switching and deleting make
the cache hold the new path at once, reusing it up to where the paths part.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvchat.engine.conversation.branches import Branches, talk
from kvchat.engine.conversation.events import SessionError, Turn
from kvchat.engine.conversation.stats import TurnStats

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Refilled:
    """What a switch or a deletion did to the cache: tokens kept, tokens evaluated."""

    reused: int
    evaluated: int


class BranchOps:
    """Edit, regenerate, switch and delete, keeping every other branch in ``branches``."""

    # What the Session this is part of provides (see the module).
    branches: Branches
    messages: list[dict[str, Any]]
    turns: list[TurnStats]

    if TYPE_CHECKING:

        @property
        def system(self) -> str | None: ...

        def _fitting_prompt(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]: ...

        def _turn(
            self, messages: list[dict[str, Any]], prompt_text: str, prompt: list[int]
        ) -> Turn: ...

        def _refill(self, progress: Progress | None = None) -> tuple[int, int]: ...

        def _changed(self, action: str, evaluated: int = 0) -> None: ...

    def talk(self) -> list[dict[str, Any]]:
        """The messages without the system prompt: what the branches are made of."""
        return talk(self.messages)

    def _offset(self) -> int:
        return 1 if self.system is not None else 0

    def _record(self) -> None:
        self.branches.record(self.talk())

    def branch_record(self) -> dict[str, Any] | None:
        """The branches as saved in ``session.json``; None while there is only one path.
        Changes nothing (a save may read it while another thread holds the session)."""
        tree, talk = self.branches, self.talk()
        if not tree.holds(talk):  # messages set from outside (the server) since the last turn
            tree = copy.deepcopy(tree)
            tree.record(talk)
        return tree.to_record() if tree.forked else None

    def branch_positions(self) -> list[tuple[int, int]]:
        """(k, n) for each message of ``messages``: it is version k of n (1 of 1 for the
        system prompt, and for all while the tree has not caught up with the messages)."""
        if not self.branches.holds(self.talk()):
            return [(1, 1)] * len(self.messages)
        return [(1, 1)] * self._offset() + self.branches.positions()

    def branch_position(self, index: int) -> tuple[int, int]:
        """(k, n): the message at ``index`` of ``messages`` is version k of n."""
        return self.branch_positions()[index]

    def _message(self, index: int, role: str, what: str) -> None:
        if not self._offset() <= index < len(self.messages) or self.messages[index]["role"] != role:
            raise SessionError(f"Message {index} is not {what}.")

    def edit(self, index: int, text: str) -> Turn:
        """Replace the user message at ``index`` with ``text`` and stream a new reply; what
        followed it stays as another branch."""
        self._message(index, "user", "a user message")
        if not isinstance(text, str) or not text.strip():
            raise SessionError("An edited message cannot be empty; it was left as it was.")
        self._record()
        messages = [*self.messages[:index], {"role": "user", "content": text}]
        return self._turn(messages, *self._fitting_prompt(messages))

    def regenerate(self, index: int | None = None) -> Turn:
        """A new version of the reply at ``index`` (the last message by default); the old
        one and what followed it stay as another branch. For the last reply the prompt is
        in the cache already, with its logits: no prefill."""
        if index is None:
            index = len(self.messages) - 1
            if index < 0 or self.messages[index]["role"] != "assistant":
                raise SessionError("Nothing to regenerate: the last message is not a reply.")
        self._message(index, "assistant", "a reply")
        self._record()
        messages = self.messages[:index]
        return self._turn(messages, *self._fitting_prompt(messages))

    def switch_branch(self, index: int, step: int, progress: Progress | None = None) -> Refilled:
        """Make the version ``step`` away from the message at ``index`` the current path
        (down that branch as it was last left); the cache is kept up to where the two
        paths part and the rest of the new path is evaluated."""
        self._record()
        if not self._offset() <= index < len(self.messages) or not self.branches.switch(
            index - self._offset(), step
        ):
            raise SessionError("There is no other version of that message that way.")
        return self._adopt(progress, "branch switch")

    def delete_pair(self, index: int, progress: Progress | None = None) -> Refilled:
        """Delete the user message at ``index`` and its reply (every version of it); the
        messages after them stay, and the cache is trimmed to the deletion point and the
        rest evaluated again."""
        self._message(index, "user", "a user message")
        self._record()
        self.branches.remove_pair(index - self._offset())
        return self._adopt(progress, "delete exchange")

    def _adopt(self, progress: Progress | None, action: str) -> Refilled:
        """The tree's path is now the transcript: take its messages and stats, fill the cache."""
        self.messages = self.messages[: self._offset()] + self.branches.messages()
        self.turns = self.branches.path_turns()
        reused, evaluated = self._refill(progress)
        self._changed(action, evaluated)
        return Refilled(reused, evaluated)
