"""``checkpoints.safetensors``: a session's checkpoints (engine/caches/checkpoints.py), saved
beside its cache so that undo, regenerate and edits stay cheap after a resume.

One file, written by mlx-lm's ``save_prompt_cache`` (no pickle): the layers of
every checkpoint in turn, oldest first, with metadata ``layout`` naming each
checkpoint's token count and the places of its layers in the session's cache.
Where the last prompt's end is a checkpoint, the log-probabilities there follow
as one more layer (an ``ArraysCache`` holding that one array; metadata
``logprobs_at`` says where), so a regenerate after a resume evaluates nothing.
``session.json`` records the file's sha256 and the token counts. A file that
is missing, damaged or does not fit the cache is never fatal: the session
resumes with its cache and without checkpoints.

A save whose checkpoints are the very ones this process last wrote to (or read
from) the folder's file, with that file untouched since, leaves the file as it
is: saving an idle session does not rewrite up to :data:`SAVED_BYTES`.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from kvchat.atomic import sha256_of
from kvchat.store.base import CHECKPOINTS_FILE, StoreError, one_line
from kvchat.store.files import open_regular, write_caches_atomic
from kvchat.store.schema import Count

if TYPE_CHECKING:
    from kvchat.engine.caches.cache_check import Reference
    from kvchat.engine.caches.checkpoints import Checkpoint
    from kvchat.engine.conversation.session import Session

# Bytes of checkpoints one save writes at most, the newest first: every save rewrites the
# file, and undo or regenerate after a resume goes back a turn or two, not sixteen.
SAVED_BYTES = 64 << 20

# [[tokens, [[layer], [layer, part], ...]], ...]
_LAYOUT = TypeAdapter(list[tuple[Count, list[list[Count]]]], config={"strict": True})


@dataclass(frozen=True)
class _OnDisk:
    """A checkpoints file as this process last wrote or read it: the objects saved in it
    (held weakly: the session may let them go), the file's identity and its entry."""

    refs: tuple[weakref.ref[Any], ...]
    key: tuple[str, int | None]  # the model's fingerprint, where the log-probabilities are
    file: tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size
    entry: dict[str, Any]


_on_disk: dict[Path, _OnDisk] = {}


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size


def _saved_as(path: Path, objects: list[Any], key: tuple[str, int | None]) -> dict[str, Any] | None:
    """The entry of ``path`` if it holds exactly ``objects`` as this process put them
    there, untouched since; else None."""
    known = _on_disk.get(path)
    if known is None or known.key != key or len(known.refs) != len(objects):
        return None
    if any(ref() is not obj for ref, obj in zip(known.refs, objects)):
        return None
    try:
        if _identity(os.stat(path, follow_symlinks=False)) != known.file:
            return None
    except OSError:
        return None
    return dict(known.entry)


def _remember(
    path: Path,
    objects: list[Any],
    key: tuple[str, int | None],
    info: os.stat_result,
    entry: dict[str, Any],
) -> None:
    refs = tuple(weakref.ref(obj) for obj in objects)
    _on_disk[path] = _OnDisk(refs, key, _identity(info), dict(entry))


def write_checkpoints(folder: Path, session: Session) -> dict[str, Any] | None:
    """Write ``session``'s checkpoints atomically; return their entry for ``session.json``
    (None, and no file, when it keeps none)."""
    from mlx_lm.models.cache import ArraysCache

    path = folder / CHECKPOINTS_FILE
    kept = _newest_within(session.checkpoints.kept, SAVED_BYTES)
    if not kept:
        _on_disk.pop(path, None)
        return None
    logits = session.prompt_logprobs
    if logits is not None and logits[0] not in {point.tokens for point in kept}:
        logits = None
    objects = [*kept, *([logits[1]] if logits else [])]
    key = (session.lm.fingerprint, logits[0] if logits else None)
    entry = _saved_as(path, objects, key)
    if entry is not None:
        return entry
    layers = [layer for point in kept for layer in point.layers.values()]
    layout = [[point.tokens, [list(p) for p in point.layers]] for point in kept]
    metadata = {"model_fingerprint": session.lm.fingerprint, "layout": json.dumps(layout)}
    if logits is not None:
        holder = ArraysCache(1)
        holder[0] = logits[1]
        layers.append(holder)
        metadata["logprobs_at"] = str(logits[0])
    sha, size = write_caches_atomic(path, layers, metadata)
    entry = {
        "file": CHECKPOINTS_FILE,
        "sha256": sha,
        "bytes": size,
        "tokens": [point.tokens for point in kept],
    }
    _remember(path, objects, key, os.stat(path, follow_symlinks=False), entry)
    return entry


def _newest_within(kept: list[Checkpoint], budget: int) -> list[Checkpoint]:
    """The newest of ``kept`` (oldest first, as kept) whose bytes fit ``budget``."""
    total, newest = 0, []
    for point in reversed(kept):
        total += point.nbytes
        if total > budget:
            break
        newest.append(point)
    return newest[::-1]


def read_checkpoints(
    folder: Path, info: dict[str, Any] | None, session: Session, reference: Reference
) -> tuple[list[Checkpoint], str | None]:
    """The checkpoints saved for ``session`` (just resumed with its cache, checked against
    ``reference``), and None; or none and why not, as a clause; none and None when none
    were saved."""
    import mlx.core as mx

    from kvchat.engine.caches.checkpoints import CHECKPOINT_BUDGET
    from kvchat.engine.caches.loading import load_prompt_cache

    if info is None:
        return [], None
    path = folder / CHECKPOINTS_FILE
    try:
        with open_regular(path, CHECKPOINT_BUDGET + (64 << 20)) as f:
            read = os.fstat(f.fileno())
            if sha256_of(f) != info["sha256"]:
                return [], f"{path} is damaged (its checksum differs from the one in session.json)"
            layers, meta = load_prompt_cache(f)
            mx.eval([layer.state for layer in layers])
    except FileNotFoundError:
        return [], f"{path} is missing"
    except StoreError as exc:
        return [], str(exc).rstrip(".")
    except Exception as exc:  # truncated or garbage files fail in many ways
        return [], f"{path} could not be read: {one_line(exc)}"
    if meta.get("model_fingerprint") != session.lm.fingerprint:
        return [], f"{path} was made with another model"
    try:
        logits = _logprobs(layers, meta, info["tokens"], reference)
        points = _checkpoints(layers, meta, info["tokens"], session)
        if logits is not None:
            session.prompt_logprobs = logits  # ValueError where the ledger is not that long
    except ValueError as exc:
        return [], f"{path} does not fit the cache: {exc}"
    objects = [*points, *([logits[1]] if logits is not None else [])]
    at = logits[0] if logits is not None else None
    _remember(path, objects, (session.lm.fingerprint, at), read, info)
    return points, None


def _logprobs(
    layers: list[Any], meta: dict[str, Any], tokens: list[int], reference: Reference
) -> tuple[int, Any] | None:
    """Take the log-probabilities off the end of ``layers``, with their position; None
    when none were saved. ValueError when they are not what the model makes (as the
    ``reference`` the cache was checked against shows: no other model step)."""
    from mlx_lm.models.cache import ArraysCache

    from kvchat.engine.caches.cache_check import logprobs_problem

    at = meta.get("logprobs_at")
    if at is None:
        return None
    if not at.isdecimal() or int(at) not in tokens or not layers:
        raise ValueError(f"its log-probabilities are at {at[:20]!r}, not at a checkpoint")
    holder = layers.pop()
    state = holder.state if isinstance(holder, ArraysCache) else (None, None, None)
    arrays = state[0] if state[1] is None and state[2] is None else None
    x = arrays[0] if isinstance(arrays, list) and len(arrays) == 1 else None
    problem = logprobs_problem(x, reference)
    if problem:
        raise ValueError(problem)
    return int(at), x


def _checkpoints(
    layers: list[Any], meta: dict[str, Any], tokens: list[int], session: Session
) -> list[Checkpoint]:
    """The checkpoints ``layers`` make, checked against ``session``; ValueError says why not."""
    from kvchat.engine.caches.cache_check import checkpoint_problem
    from kvchat.engine.caches.checkpoints import (
        MAX_CHECKPOINTS,
        Checkpoint,
        layer_parts,
        stateful_paths,
    )

    try:
        layout = _LAYOUT.validate_json(meta.get("layout", ""))
    except ValidationError:
        raise ValueError("its layout is not readable") from None
    if [t for t, _ in layout] != tokens:
        raise ValueError(
            f"it holds checkpoints at tokens {[t for t, _ in layout]}, session.json lists {tokens}"
        )
    if len(tokens) > MAX_CHECKPOINTS or tokens != sorted(set(tokens)) or 0 in tokens:
        raise ValueError(
            f"its token positions {tokens} are not at most {MAX_CHECKPOINTS} "
            "increasing ones after the first token"
        )
    if tokens and tokens[-1] > len(session.ledger):
        raise ValueError(
            f"a checkpoint is at token {tokens[-1]}, the cache holds {len(session.ledger)}"
        )
    parts = dict(layer_parts(session.cache))
    stateful = set(stateful_paths(session.cache))
    if sum(len(paths) for _, paths in layout) != len(layers):
        raise ValueError(f"it holds {len(layers)} layers, its layout names a different number")
    points, start = [], 0
    for at, raw in layout:
        paths = [tuple(p) for p in raw]
        if not paths or len(set(paths)) != len(paths) or not set(paths) <= stateful:
            raise ValueError(
                f"the checkpoint at token {at} names layers that the cache lacks or can cut back"
            )
        saved = layers[start : start + len(paths)]
        start += len(paths)
        problem = checkpoint_problem(saved, [parts[p] for p in paths], at)
        if problem:
            raise ValueError(f"at token {at}, {problem}")
        points.append(Checkpoint.of(at, dict(zip(paths, saved))))
    return points
