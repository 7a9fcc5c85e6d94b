"""Branches: every path a conversation has taken, kept as a tree of messages.

A session's ``messages`` are its current path. Editing an earlier user message
or regenerating an earlier reply starts a new path from that point; the old
continuation stays in the tree as another branch, and switching to it makes it
the current path again. The tree holds the conversation's messages (the system
prompt excepted: it belongs to the session, not to a branch), each node with its
parent, in creation order, so siblings are numbered in the order they were
written. A reply's node keeps its turn's stats, so a branch brings its own back.

The tree only grows by :meth:`Branches.record` (the current messages, matched
against the tree from the root: a message not found among its parent's children
becomes a new child) and shrinks only by an explicit deletion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.engine.conversation.stats import TurnStats


class BranchError(ValueError):
    """A saved branch record that does not describe the session's messages."""


@dataclass
class Node:
    parent: int  # the index of the parent node, -1 for a first message
    message: dict[str, Any]
    turn: TurnStats | None = None


def _key(message: dict[str, Any]) -> tuple[Any, Any, bool]:
    return message["role"], message["content"], bool(message.get("stopped"))


def talk(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without the system prompt: what the branches are made of."""
    return messages[1:] if messages and messages[0]["role"] == "system" else list(messages)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("stopped"):
        out["stopped"] = True
    return out


class Branches:
    """The tree of a conversation's messages and its current path (node indices)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.path: list[int] = []
        self._chosen: dict[int, int] = {}  # node (-1: the root) -> its child last on the path

    @classmethod
    def linear(cls, messages: list[dict[str, Any]], turns: Sequence[TurnStats] = ()) -> Branches:
        """One path: ``messages``; ``turns`` belong to its last replies, in order."""
        tree = cls()
        tree.record(messages)
        replies = [i for i in tree.path if tree.nodes[i].message["role"] == "assistant"]
        for node, turn in zip(replies[len(replies) - len(turns) :], turns):
            tree.nodes[node].turn = turn
        return tree

    # ------------------------------------------------------------ reading

    @property
    def forked(self) -> bool:
        """True when there is more than the current path."""
        return len(self.nodes) > len(self.path)

    def children(self, parent: int) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.parent == parent]

    def positions(self) -> list[tuple[int, int]]:
        """(k, n) for each message of the path: it is branch k of n (from 1) there. One
        pass over the tree, however long the path."""
        place: dict[int, int] = {}  # node -> its place among its parent's children
        count: dict[int, int] = {}  # parent -> how many children it has
        for i, node in enumerate(self.nodes):
            count[node.parent] = place[i] = count.get(node.parent, 0) + 1
        return [(place[i], count[self.nodes[i].parent]) for i in self.path]

    def position(self, index: int) -> tuple[int, int]:
        """(k, n): the message at ``index`` on the path is branch k of n (from 1) there."""
        return self.positions()[index]

    def holds(self, messages: list[dict[str, Any]]) -> bool:
        """True when ``messages`` are the current path."""
        return len(messages) == len(self.path) and all(
            _key(self.nodes[i].message) == _key(m) for i, m in zip(self.path, messages)
        )

    def messages(self) -> list[dict[str, Any]]:
        return [dict(self.nodes[i].message) for i in self.path]

    def path_turns(self) -> list[TurnStats]:
        return [turn for i in self.path if (turn := self.nodes[i].turn) is not None]

    # ------------------------------------------------------------ changing

    def record(self, messages: list[dict[str, Any]]) -> None:
        """Make ``messages`` the current path, adding the ones the tree lacks."""
        path: list[int] = []
        parent = -1
        added = False  # the parent was added just now: it has no children to search
        for i, message in enumerate(messages):
            key = _key(message)
            on_path = self.path[i] if i < len(self.path) else None
            node: int | None
            if (
                on_path is not None
                and self.nodes[on_path].parent == parent
                and _key(self.nodes[on_path].message) == key
            ):
                node = on_path
            else:
                node = (
                    None
                    if added
                    else next(
                        (c for c in self.children(parent) if _key(self.nodes[c].message) == key),
                        None,
                    )
                )
            added = node is None
            if node is None:
                self.nodes.append(Node(parent, _plain(message)))
                node = len(self.nodes) - 1
            path.append(node)
            parent = node
        self._set_path(path)

    def set_turn(self, turn: TurnStats) -> None:
        """Keep ``turn`` with the last message of the path (the reply it produced)."""
        if self.path:
            self.nodes[self.path[-1]].turn = turn

    def replace_last(self, message: dict[str, Any]) -> None:
        """Put ``message`` in place of the path's last message (a reply revised after its
        turn), keeping its turn's stats."""
        self.nodes[self.path[-1]].message = _plain(message)

    def switch(self, index: int, step: int) -> bool:
        """Move the path at ``index`` to the sibling ``step`` away (and down that branch as
        it was last seen); False, changing nothing, when there is none that way."""
        node = self.path[index]
        siblings = self.children(self.nodes[node].parent)
        j = siblings.index(node) + step
        if not 0 <= j < len(siblings):
            return False
        path = [*self.path[:index], siblings[j]]
        while children := self.children(path[-1]):
            chosen = self._chosen.get(path[-1])
            path.append(chosen if chosen in children else children[-1])
        self._set_path(path)
        return True

    def remove_pair(self, index: int) -> None:
        """Delete the user message at ``index`` and its reply, with the reply's other
        versions; what followed the reply (every branch of it) moves up in their place."""
        user = self.path[index]
        reply = self.path[index + 1] if index + 1 < len(self.path) else None
        kept = self.children(reply) if reply is not None else []
        parent = self.nodes[user].parent
        for child in kept:
            self.nodes[child].parent = parent
        path = self.path[:index] + self.path[index + 2 :]
        self._remove(self._subtree([user]), path)

    def after(self, length: int) -> list[dict[str, Any]]:
        """The messages :meth:`truncate` would delete: the path from ``length`` on and every
        branch that starts after it, in the order they were added."""
        if length >= len(self.path):
            return []
        gone = self._subtree([self.path[length]])
        return [dict(self.nodes[i].message) for i in sorted(gone)]

    def truncate(self, length: int) -> None:
        """Delete the path from ``length`` on, with every branch that starts after it."""
        if length < len(self.path):
            self._remove(self._subtree([self.path[length]]), self.path[:length])

    def drop_first(self, count: int) -> None:
        """The first ``count`` messages of the path left the conversation (trimmed): the
        tree starts after them, and the branches that forked before them go too."""
        if count <= 0:
            return
        roots = self.children(self.path[count - 1])
        keep = self._subtree(roots)
        for root in roots:
            self.nodes[root].parent = -1
        gone = set(range(len(self.nodes))) - keep
        self._remove(gone, self.path[count:])

    # ------------------------------------------------------------ records

    def to_record(self) -> dict[str, Any]:
        nodes = []
        for node in self.nodes:
            item = {"parent": node.parent, **node.message}
            if node.turn is not None:
                item["turn"] = node.turn.to_dict()
            nodes.append(item)
        return {"nodes": nodes, "path": list(self.path)}

    @classmethod
    def from_record(cls, record: dict[str, Any], messages: list[dict[str, Any]]) -> Branches:
        """The tree a saved record describes, checked against the session's ``messages``
        (system prompt excluded); :class:`BranchError` says what does not fit."""
        tree = cls()
        for i, item in enumerate(record["nodes"]):
            parent = item["parent"]
            if not -1 <= parent < i:
                raise BranchError(f"branches.nodes[{i}].parent must be -1 or an earlier node")
            turn = item.get("turn")
            tree.nodes.append(
                Node(parent, _plain(item), TurnStats.from_dict(turn) if turn is not None else None)
            )
        path = list(record["path"])
        if len(path) != len(messages):
            raise BranchError("branches.path is not as long as the messages")
        parent = -1
        for i, node in enumerate(path):
            if not 0 <= node < len(tree.nodes) or tree.nodes[node].parent != parent:
                raise BranchError(f"branches.path[{i}] is not a child of the message before it")
            if _key(tree.nodes[node].message) != _key(messages[i]):
                raise BranchError(f"branches.path[{i}] differs from the message it stands for")
            parent = node
        tree._set_path(path)
        return tree

    # ------------------------------------------------------------ helpers

    def _set_path(self, path: list[int]) -> None:
        self.path = path
        parent = -1
        for node in path:
            self._chosen[parent] = node
            parent = node

    def _subtree(self, roots: list[int]) -> set[int]:
        """``roots`` and every node under them (parents come before their children)."""
        inside = set(roots)
        for i, node in enumerate(self.nodes):
            if node.parent in inside:
                inside.add(i)
        return inside

    def _remove(self, gone: set[int], path: list[int]) -> None:
        """Drop the nodes in ``gone`` (whose children were moved or go too), renumbering."""
        new_index = {-1: -1}
        nodes: list[Node] = []
        for i, node in enumerate(self.nodes):
            if i not in gone:
                new_index[i] = len(nodes)
                nodes.append(node)
        for node in nodes:
            node.parent = new_index[node.parent]
        self.nodes = nodes
        self._chosen = {
            new_index[a]: new_index[b]
            for a, b in self._chosen.items()
            if a in new_index and b in new_index
        }
        self._set_path([new_index[i] for i in path])
