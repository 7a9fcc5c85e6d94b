"""Reading ``session.json``: parse it and check it against the schema."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvchat.engine.conversation.branches import Branches
from kvchat.store.base import SESSION_FILE, Generation, StoreError, one_line, session_dir
from kvchat.store.files import JSON_LIMIT, check_folder, read_regular
from kvchat.store.schema import SessionFile, parse_file


def _parsed(path: Path) -> tuple[SessionFile, Generation]:
    try:
        raw = read_regular(path, JSON_LIMIT)  # never a symlink, FIFO or device; capped
    except FileNotFoundError:
        raise StoreError(f"{path} is missing.") from None
    except OSError as exc:
        raise StoreError(f"{path} is damaged ({one_line(exc)}); it was left as it is.") from None
    parsed = parse_file(raw, path)
    return parsed, Generation(parsed.generation, hashlib.sha256(raw).hexdigest())


def _path(name: str) -> Path:
    folder = session_dir(name)
    path = folder / SESSION_FILE
    if not check_folder(folder) or not os.path.lexists(path):
        raise StoreError(f"No saved session named {name!r} (no {path}).")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """Parse a ``session.json``; any problem is a :class:`StoreError` naming the file."""
    return _parsed(path)[0].model_dump(exclude_unset=True)


def read(name: str) -> dict[str, Any]:
    """The parsed ``session.json`` of ``name`` (no model needed)."""
    return read_json(_path(name))


def read_with_generation(name: str) -> tuple[dict[str, Any], Generation]:
    """:func:`read`, with the file's generation (a sharded run's rank 0 reads the file
    once, sends it to every rank, and checks its save against this)."""
    parsed, generation = _parsed(_path(name))
    return parsed.model_dump(exclude_unset=True), generation


def read_with_tree(name: str) -> tuple[dict[str, Any], Branches | None, Generation]:
    """:func:`read`, with the branch tree the validation built from the file (None where
    the file has none), so that a load does not build it again, and its generation."""
    parsed, generation = _parsed(_path(name))
    return parsed.model_dump(exclude_unset=True), parsed.tree, generation
