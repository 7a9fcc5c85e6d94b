"""A session's history: its messages, the tree of every path they have taken, the stats of
each reply on the path and the exchanges trimmed away.

It knows nothing of the cache: each change says what the transcript is now, and the
:class:`~kvchat.engine.conversation.session.Session` makes its cache keeper follow
(:mod:`kvchat.engine.conversation.maintenance`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from kvchat.engine.conversation.branches import Branches, talk
from kvchat.engine.conversation.events import SessionError
from kvchat.engine.conversation.stats import TurnStats

Message = dict[str, Any]


class History:
    """The messages (the system prompt first, if there is one), ``branches`` (every path,
    with the current one), ``turns`` (one :class:`TurnStats` per reply, oldest first, as
    far back as they are known) and ``archived`` (exchanges :meth:`trim` and :meth:`undo`
    dropped, which :meth:`restore_archived` brings back).

    ``messages`` may run ahead of ``branches``: a transcript :meth:`replace` set is
    recorded as a path at the next :meth:`record` (a turn's start), so a request that
    fails leaves the tree as it was.
    """

    def __init__(
        self,
        messages: Sequence[Message],
        *,
        turns: Sequence[TurnStats] = (),
        archived: Sequence[Message] = (),
        branches: Branches | None = None,
    ):
        self._messages = list(messages)
        self._turns = list(turns)
        self._archived = list(archived)
        self._branches = branches or Branches.linear(self.talk(), self._turns)

    # ----------------------------------------------------------------- reading

    @property
    def messages(self) -> list[Message]:
        """The transcript itself (the session hands out copies)."""
        return self._messages

    @property
    def turns(self) -> list[TurnStats]:
        return self._turns

    @property
    def archived(self) -> list[Message]:
        return self._archived

    @property
    def branches(self) -> Branches:
        return self._branches

    @property
    def system(self) -> str | None:
        if self._messages and self._messages[0]["role"] == "system":
            content: str = self._messages[0]["content"]
            return content
        return None

    @property
    def offset(self) -> int:
        """Where the conversation starts in ``messages``: 1 after a system prompt, else 0."""
        return 1 if self.system is not None else 0

    def talk(self) -> list[Message]:
        """The messages without the system prompt: what the branches are made of."""
        return talk(self._messages)

    def positions(self) -> list[tuple[int, int]]:
        """(k, n) for each message: it is version k of n (1 of 1 for the system prompt, and
        for all while the tree has not caught up with the messages)."""
        if not self._branches.holds(self.talk()):
            return [(1, 1)] * len(self._messages)
        return [(1, 1)] * self.offset + self._branches.positions()

    def branch_record(self) -> dict[str, Any] | None:
        """The branches as saved; None while there is only one path. Changes nothing."""
        tree, path = self._branches, self.talk()
        if not tree.holds(path):  # a transcript replaced since the last record
            tree = copy.deepcopy(tree)
            tree.record(path)
        return tree.to_record() if tree.forked else None

    def check(self, index: int, role: str, what: str) -> None:
        """Raise :class:`SessionError` unless the message at ``index`` (past the system
        prompt) has ``role``: an edit's or a regenerate's target."""
        if not self.offset <= index < len(self._messages) or self._messages[index]["role"] != role:
            raise SessionError(f"Message {index} is not {what}.")

    # ------------------------------------------------- what a turn answers

    def asking(self, text: str | Message) -> list[Message]:
        """The messages with a user's ``text`` added (or a user's message: its text with a
        participant's ``name``); :class:`SessionError` if it is empty."""
        given = text if isinstance(text, dict) else {"content": text}
        message = {"role": "user", "content": given.get("content")}
        if given.get("name"):
            message["name"] = given["name"]
        if not isinstance(message["content"], str) or not message["content"].strip():
            raise SessionError("Nothing to send: the message is empty.")
        return [*self._messages, message]

    def answering(self, results: Sequence[Message]) -> list[Message]:
        """The messages with ``results`` added, ending with a tool's result."""
        messages = [*self._messages, *results]
        if not messages or messages[-1]["role"] != "tool":
            raise SessionError("Nothing to answer: the last message is not a tool's result.")
        return messages

    def edited(self, index: int, text: str) -> list[Message]:
        """The messages up to the user message at ``index``, which becomes ``text``; the
        current path is recorded first, so what followed stays as another branch."""
        self.check(index, "user", "a user message")
        if not isinstance(text, str) or not text.strip():
            raise SessionError("An edited message cannot be empty; it was left as it was.")
        self.record()
        return [*self._messages[:index], {"role": "user", "content": text}]

    def regenerating(self, index: int | None) -> list[Message]:
        """The messages before the reply at ``index`` (the last message by default); the
        current path is recorded first, so the old reply stays as another branch."""
        if index is None:
            index = len(self._messages) - 1
            if index < 0 or self._messages[index]["role"] != "assistant":
                raise SessionError("Nothing to regenerate: the last message is not a reply.")
        self.check(index, "assistant", "a reply")
        self.record()
        return self._messages[:index]

    # ----------------------------------------------------------------- changing

    def record(self) -> None:
        """Make the messages the tree's current path (adding what it lacks)."""
        self._branches.record(self.talk())

    def replace(self, messages: Sequence[Message]) -> list[Message]:
        """Make ``messages`` the transcript, returning the one it replaces. The tree records
        it at the next :meth:`record`, and the stats follow at the next turn (so putting
        the old transcript back loses nothing)."""
        previous, self._messages = self._messages, list(messages)
        return previous

    def begin(self, messages: Sequence[Message]) -> None:
        """A turn on ``messages`` starts: they are the transcript and the tree's path, and
        the stats are those of the replies on it (a reply the tree did not have, as a
        client's history brings, has none)."""
        self._messages = list(messages)
        self.record()
        self._turns = self._branches.path_turns()

    def add_reply(self, reply: str, stopped: bool) -> None:
        """A turn's reply joins the transcript and the tree."""
        message: Message = {"role": "assistant", "content": reply}
        if stopped:
            message["stopped"] = True
        self._messages.append(message)
        self.record()

    def add_turn(self, stats: TurnStats) -> None:
        """The stats of the reply just added, kept with it in the tree too."""
        self._turns.append(stats)
        self._branches.set_turn(stats)

    def revise_reply(self, message: Message) -> None:
        """Put ``message`` in place of the last reply, in the transcript and on the tree's
        path (its stats stay with it); the old version is not kept as a branch."""
        if not self._messages or self._messages[-1]["role"] != "assistant":
            raise SessionError("There is no reply to revise: the last message is not a reply.")
        if message.get("role") != "assistant":
            raise SessionError("A reply is revised by an assistant message.")
        self.record()
        self._messages[-1] = dict(message)
        self._branches.replace_last(message)

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (``""`` or None: none)."""
        self._messages = ([{"role": "system", "content": text}] if text else []) + self.talk()

    def undo(self, turns: int) -> None:
        """Remove the last ``turns`` exchanges (user message and what followed it), and
        every branch that starts after what is left; they move to ``archived``."""
        self.record()
        messages = list(self._messages)
        removed = 0
        while removed < turns and any(m["role"] == "user" for m in messages):
            if messages.pop()["role"] == "user":
                removed += 1
        if not removed:
            raise SessionError("Nothing to undo: there is no user message yet.")
        self._messages = messages
        # what goes is archived, as a trim's is: the undone exchanges and every branch
        # that started after what is left (an edited version of an undone message)
        self._archived.extend(self._branches.after(len(self.talk())))
        self._branches.truncate(len(self.talk()))
        # an undone reply takes its stats with it (a restored reply has none to give back)
        self._turns = self._branches.path_turns()

    def trim(self, too_long: Callable[[list[Message]], bool], limit: int) -> int:
        """Drop the oldest exchanges, keeping the system prompt, while ``too_long(messages)``;
        they move to ``archived``. Returns how many messages went. ``limit`` is only said
        when the system prompt alone is too long."""
        self.record()
        keep = self.offset
        messages = list(self._messages)
        dropped: list[Message] = []
        while too_long(messages):
            if len(messages) <= keep:
                raise SessionError(
                    f"The system prompt alone is over {limit:,} tokens; nothing to trim to."
                )
            dropped.append(messages.pop(keep))
            # an exchange goes whole: drop the replies that answered this message too
            while len(messages) > keep and messages[keep]["role"] != "user":
                dropped.append(messages.pop(keep))
        if dropped:
            self._archived.extend(dropped)
            self._messages = messages
            self._branches.drop_first(len(dropped))
            self._turns = self._branches.path_turns()
        return len(dropped)

    def restore_archived(self, index: int) -> None:
        """Put archived exchange ``index`` (of :func:`archived_exchanges`) back at the end of
        the transcript and the tree's path; it leaves ``archived`` once it is in the
        transcript. A reply right after a reply there is another version of it (a
        regenerate's): it comes back as a branch, the later one on the path. The replies
        come back without stats (none were kept)."""
        spans = exchange_spans(self._archived)
        if not 0 <= index < len(spans):
            raise SessionError(f"There is no archived exchange {index}.")
        start, end = spans[index]
        kept = len(self.talk())
        path = self.talk()
        for message in self._archived[start:end]:
            if len(path) > kept and message["role"] == path[-1]["role"] == "assistant":
                self._branches.record(path)  # the earlier version stays as a branch
                path[-1] = dict(message)
            else:
                path.append(dict(message))
        self._messages = self._messages[: self.offset] + path
        self.record()
        del self._archived[start:end]

    def switch(self, index: int, step: int) -> None:
        """Make the version ``step`` away from the message at ``index`` the current path
        (down that branch as it was last left)."""
        self.record()
        if not self.offset <= index < len(self._messages) or not self._branches.switch(
            index - self.offset, step
        ):
            raise SessionError("There is no other version of that message that way.")
        self._follow_tree()

    def remove_pair(self, index: int) -> None:
        """Delete the user message at ``index`` and its reply (every version of it); the
        messages after them stay."""
        self.check(index, "user", "a user message")
        self.record()
        self._branches.remove_pair(index - self.offset)
        self._follow_tree()

    def _follow_tree(self) -> None:
        """The tree's path is now the transcript: take its messages and stats."""
        self._messages = self._messages[: self.offset] + self._branches.messages()
        self._turns = self._branches.path_turns()


def exchange_spans(archived: Sequence[Message]) -> list[tuple[int, int]]:
    """(start, end) in ``archived`` of each exchange: a user message and what followed it
    there, up to the next user message (messages before the first one are one too)."""
    starts = [i for i, m in enumerate(archived) if i == 0 or m["role"] == "user"]
    return list(pairwise([*starts, len(archived)]))


def archived_exchanges(archived: Sequence[Message]) -> list[list[Message]]:
    """``archived`` (a session's, as :attr:`History.archived` keeps it: a flat list of
    messages, oldest first) as exchanges, each a user message and its replies: what
    :meth:`History.restore_archived` takes by index."""
    return [[dict(m) for m in archived[a:b]] for a, b in exchange_spans(archived)]
