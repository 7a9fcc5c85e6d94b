"""Sessions with more than one writer: generations, the conflict a save refuses, and
keeping both sides of one. Imports no Textual.

``session.json`` carries a ``generation``: 1 for a session's first save, one more for
each save after it (a file from before it has none: generation 0). Every load
returns the :class:`Generation` it read (the number and the sha256 of the file's
bytes); a save given that object as ``base`` checks, under the session's lock, that
the file on disk is still that one, and moves it forward when it writes. When another
process saved in between, the save writes nothing and raises :class:`SessionChanged`
with what is on disk now; :func:`save_as_branch` then keeps this process's
conversation as branches of the saved one, which stays the main line: nothing of
either side is lost.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import TYPE_CHECKING, Any

from kvchat.atomic import write_atomic
from kvchat.engine.conversation.branches import Branches, talk
from kvchat.engine.conversation.stats import TurnStats
from kvchat.store.base import SESSION_FILE, Generation, StoreError, now, session_dir
from kvchat.store.files import JSON_LIMIT, check_folder, read_regular
from kvchat.store.lock import session_lock
from kvchat.store.schema import parse_file

if TYPE_CHECKING:
    from pathlib import Path

    from kvchat.engine.conversation.session import Session


class SessionChanged(StoreError):
    """A save refused because another process saved the session since this one loaded
    it. ``data`` is the ``session.json`` on disk now (parsed), ``generation`` its."""

    def __init__(self, name: str, data: dict[str, Any], generation: Generation) -> None:
        self.name, self.data, self.generation = name, data, generation
        super().__init__(
            f"Session {name} was saved by another kvchat since this one loaded it "
            f"(it is at generation {generation.number} now); nothing was overwritten."
        )


def on_disk(path: Path) -> tuple[bytes | None, dict[str, Any] | None, Generation]:
    """The bytes, parsed content and generation of ``session.json`` ``path`` as it is
    now; (None, None, Generation()) when there is none. A damaged one is a StoreError."""
    try:
        raw = read_regular(path, JSON_LIMIT)
    except FileNotFoundError:
        return None, None, Generation()
    data = parse_file(raw, path).model_dump(exclude_unset=True)
    return raw, data, Generation(data.get("generation", 0), hashlib.sha256(raw).hexdigest())


def check_base(name: str, path: Path, base: Generation | None) -> tuple[int, dict[str, Any] | None]:
    """Under the session's lock, before a save writes anything: the generation number
    the save writes and the file on disk now (parsed; None when there is none). Raises
    :class:`SessionChanged` when ``base`` is given and the file on disk is not the one
    it describes (a file removed meanwhile is no conflict: the save makes it again).
    A damaged file is a StoreError for a checked save; an unchecked one replaces it."""
    try:
        raw, data, current = on_disk(path)
    except StoreError:
        if base is not None:
            raise
        return 1, None
    if base is not None and raw is not None and not base.describes(raw):
        assert data is not None  # on_disk parses whatever it read
        raise SessionChanged(name, data, current)
    return current.number + 1, data


def generation_of(name: str) -> Generation:
    """The generation of saved session ``name`` now (Generation() when none is saved):
    a cheap look before a send, to tell the user early."""
    folder = session_dir(name)
    if not check_folder(folder):
        return Generation()
    return on_disk(folder / SESSION_FILE)[2]


def save_as_branch(session: Session, name: str) -> Generation:
    """Keep ``session``'s conversation in saved session ``name`` as branches of what is
    saved there now, which stays the current path (its cache untouched); return the
    generation written. Messages both share are kept once; every path of ``session``'s
    tree is added, each reply with its turn's stats."""
    from kvchat.store.search_index import index_session

    with session_lock(name) as folder:
        path = folder / SESSION_FILE
        _, data, current = on_disk(path)
        if data is None:
            raise StoreError(f"Session {name} is no longer saved; save this one again.")
        theirs = _tree(data)
        main = theirs.path
        mine = copy.deepcopy(session.branches)
        mine.record(session.talk())
        for leaf in _leaves(mine):
            nodes = _path_to(mine, leaf)
            theirs.record([mine.nodes[i].message for i in nodes])
            for here, there in zip(theirs.path, nodes):
                if theirs.nodes[here].turn is None and mine.nodes[there].turn is not None:
                    theirs.nodes[here].turn = mine.nodes[there].turn
        theirs.record([theirs.nodes[i].message for i in main])  # back to their path
        data["branches"] = theirs.to_record() if theirs.forked else None
        if data["branches"] is None:
            del data["branches"]
        data["generation"] = current.number + 1
        data["updated"] = now()
        text = json.dumps(data, ensure_ascii=False, indent=1).encode()
        sha = write_atomic(path, text)
        index_session(name, data, path)
        return Generation(data["generation"], sha)


def _tree(data: dict[str, Any]) -> Branches:
    """The branch tree of a parsed ``session.json`` (one path where it saved none)."""
    messages = talk(data["messages"])
    if data.get("branches"):
        return Branches.from_record(data["branches"], messages)
    return Branches.linear(messages, [TurnStats.from_dict(t) for t in data.get("turns", [])])


def _leaves(tree: Branches) -> list[int]:
    """The nodes with no children, in creation order."""
    parents = {node.parent for node in tree.nodes}
    return [i for i in range(len(tree.nodes)) if i not in parents]


def _path_to(tree: Branches, node: int) -> list[int]:
    """The nodes from the root to ``node``."""
    out = []
    while node != -1:
        out.append(node)
        node = tree.nodes[node].parent
    return out[::-1]
