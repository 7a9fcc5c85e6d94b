"""Save and load a whole session: the cache first, ``session.json`` last."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import __version__
from kvchat.atomic import remove_stale, write_atomic
from kvchat.store.base import (
    CACHE_FILE,
    CACHE_SUM_FILE,
    CHECKPOINTS_FILE,
    FORMAT,
    SESSION_FILE,
    Generation,
    Loaded,
    StoreError,
    cache_metadata,
    now,
    one_line,
    session_dir,
)
from kvchat.store.cache_file import CacheRead, read_cache
from kvchat.store.checkpoint_file import read_checkpoints, write_checkpoints
from kvchat.store.files import (
    NO_SPACE,
    check_folder,
    make_dir,
    write_caches_atomic,
)
from kvchat.store.generations import check_base
from kvchat.store.lock import session_lock
from kvchat.store.schema import parse_file
from kvchat.store.search_index import index_session
from kvchat.store.session_file import read_with_tree
from kvchat.store.shards import drop_shards

if TYPE_CHECKING:
    from kvchat.engine.caches.cache_check import Reference
    from kvchat.engine.conversation.session import GenerationSettings, Session
    from kvchat.engine.models.model import LoadedModel

Progress = Callable[[int, int], None]


def save(
    session: Session, name: str, shards: list[str] | None = None, *, base: Generation | None = None
) -> Path:
    """Write ``session`` under ``name`` (cache first, then ``session.json``); return the folder.

    Takes the session's lock. A crash at any point leaves the previous save
    loadable: at worst its cache is rebuilt from its transcript. A write that
    fails (a full disk, a file size limit) is a :class:`StoreError` in one
    sentence, with the previous save as it was and no temporary file left.
    ``shards`` are the checksums of the other ranks' cache shards, written already
    (``store/shards.py``), for a sharded run.

    ``base`` is the generation this process loaded or last saved (``Loaded.generation``;
    ``Generation()`` for a session new here): when the saved session is no longer that
    one, nothing is written and :class:`~kvchat.store.generations.SessionChanged` says what
    is there now; otherwise ``base`` moves forward to the generation written. Without
    ``base`` the save replaces whatever is there (tests, benchmarks).
    """
    with session_lock(name) as folder:
        try:
            return _save_locked(session, name, folder, shards, base)
        except OSError as exc:  # mlx writes the cache through the file object: OSError too
            reason = "no space left on device" if exc.errno in NO_SPACE else one_line(exc)
        raise StoreError(f"Could not save session {name}: {reason}; the previous save is intact.")


def _save_locked(
    session: Session, name: str, folder: Path, shards: list[str] | None, base: Generation | None
) -> Path:
    """:func:`save` once the lock is held (a failure leaves no temporary file behind)."""
    json_path = folder / SESSION_FILE
    cache_path = folder / CACHE_FILE
    generation, before = check_base(name, json_path, base) if check_folder(folder) else (1, None)
    make_dir(folder)
    remove_stale(folder)
    created = (before or {}).get("created") or now()
    if not os.path.lexists(json_path):
        set_aside(name)

    ledger = list(session.ledger)
    cache_info: dict[str, Any] | None = None
    if ledger:
        metadata = cache_metadata(session)
        if os.path.isdir(cache_path) and not os.path.islink(cache_path):
            _keep_aside(cache_path)  # a folder in the way: a file cannot replace it

        def checksum_first(sha: str, size: int) -> None:
            # The cache's checksum goes to disk before the cache does, so a load
            # after a save cut short before session.json can verify the new cache.
            record = {"sha256": sha, "bytes": size, "ledger_sha256": metadata["ledger_sha256"]}
            write_atomic(folder / CACHE_SUM_FILE, json.dumps(record).encode())

        sha, size = write_caches_atomic(cache_path, session.cache, metadata, checksum_first)
        cache_info = {
            "file": CACHE_FILE,
            "sha256": sha,
            "bytes": size,
            "tokens": session.cache_tokens,
            "ledger_sha256": metadata["ledger_sha256"],
            **({"shards": shards} if shards else {}),
        }
    points = write_checkpoints(folder, session) if ledger else None

    data = {
        "format": FORMAT,
        "generation": generation,
        "kvchat_version": __version__,
        "created": created,
        "updated": now(),
        **transcript(session, name),
        "ledger": ledger,
        "cache": cache_info,
        # only where there are checkpoints: a session without them reads as before
        **({"checkpoints": points} if points else {}),
    }
    text = json.dumps(data, ensure_ascii=False, indent=1)
    sha = write_atomic(json_path, text.encode())
    if base is not None:
        base.number, base.sha256 = generation, sha
    index_session(name, data, json_path)  # never raises: the index catches up on a search
    if cache_info is None:
        cache_path.unlink(missing_ok=True)
        (folder / CACHE_SUM_FILE).unlink(missing_ok=True)
    if points is None:
        (folder / CHECKPOINTS_FILE).unlink(missing_ok=True)
    drop_shards(folder, len(cache_info.get("shards", [])) if cache_info else 0)
    return folder


def transcript(session: Session, name: str) -> dict[str, Any]:
    """What ``session.json`` holds of ``session`` besides its cache, ledger and times (and
    what an export shows)."""
    return {
        "name": name,
        "model_id": session.lm.model_id,
        "model_fingerprint": session.lm.fingerprint,
        "cache_kind": session.kind.name,
        "settings": asdict(session.settings),
        "messages": session.messages,
        "archived": session.archived,
        "turns": [t.to_dict() for t in session.turns],
        # only where there are branches: a session without them reads as before
        **({"branches": branches} if (branches := session.branch_record()) else {}),
    }


def set_aside(name: str) -> str | None:
    """Move a cache that has no ``session.json`` beside it (a session whose transcript
    was lost) to ``cache.safetensors.orphan-<time>``, so a new session started under
    its name does not overwrite it; return a one-sentence notice, None if none was there.
    Call it with the session's lock held."""
    folder = session_dir(name)
    if not check_folder(folder):
        return None
    cache_path = folder / CACHE_FILE
    if os.path.lexists(folder / SESSION_FILE) or not os.path.lexists(cache_path):
        return None
    kept = _keep_aside(cache_path)
    (folder / CACHE_SUM_FILE).unlink(missing_ok=True)
    (folder / CHECKPOINTS_FILE).unlink(missing_ok=True)  # of no use without the cache
    return (
        f"{folder} held a cache without session.json; it was kept as {kept.name} "
        "and a new session was started."
    )


def _keep_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.orphan-<time>`` beside it; return the new path."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    kept = path.with_name(f"{path.name}.orphan-{stamp}")
    os.rename(path, kept)
    return kept


def load(
    name: str,
    lm: LoadedModel,
    progress: Progress | None = None,
    *,
    data: dict[str, Any] | None = None,
    reader: Callable[..., CacheRead] = read_cache,
) -> Loaded:
    """Load session ``name`` for model ``lm``, cache included when it is sound.

    When the cache cannot be used, the transcript still loads, the cache is
    rebuilt from it (``progress(done, total)`` reports the prefill) and
    ``notice`` says why in one sentence. A sharded run passes the parsed
    ``session.json`` (``data``, which rank 0 sent) and a ``reader`` that reads this
    rank's shard (:func:`~kvchat.store.cache_file.read_cache`'s signature).
    """
    from kvchat.engine.caches.cache_check import Reference
    from kvchat.engine.caches.kinds import CacheKindError
    from kvchat.engine.conversation.session import GenerationSettings, Session
    from kvchat.engine.conversation.stats import TurnStats

    folder = session_dir(name)
    if data is None:
        data, branches, generation = read_with_tree(name)  # the tree checked against the messages
    else:  # rank 0's parsed file, sent to this rank of a sharded run: validated here too
        branches = parse_file(json.dumps(data).encode(), folder / "session.json").tree
        generation = Generation(data.get("generation", 0))  # rank 0 knows the file's sha
    # the schema (store/schema.py) has checked every field's type and range by now
    settings = _settings(GenerationSettings, data.get("settings", {}))
    turns = [TurnStats.from_dict(t) for t in data.get("turns", [])]
    messages = [dict(m) for m in data["messages"]]
    archived = list(data.get("archived", []))
    ledger: list[int] | None = list(data.get("ledger", []))
    kind = data.get("cache_kind", "standard")

    kind_notice = None
    try:
        empty = Session(lm, kind=kind, settings=settings, messages=messages)
    except CacheKindError as exc:
        kind_notice = f"cache kind {kind!r} cannot be used here ({exc}), so it is now 'standard'"
        kind = "standard"
        empty = Session(lm, kind=kind, settings=settings, messages=messages)

    problem = kind_notice
    cache: list[Any] | None = None
    reference = Reference(empty.cache, lm.model)  # the model runs on it only when asked
    if problem is None:
        cache, ledger, problem = reader(folder, data, lm, ledger, empty, reference)
    session = Session.restore(
        lm,
        messages=messages,
        kind=empty.kind,
        settings=settings,
        ledger=ledger,
        cache=cache,
        turns=turns,
        archived=archived,
        branches=branches,
    )
    if problem is None:
        loaded = _with_checkpoints(folder, data, session, reference, resumed=cache is not None)
    else:
        session.rebuild(f"the saved cache was not used: {problem}", progress, next_turn_counts=True)
        notice = f"The saved cache was not used ({problem}); it was rebuilt from the transcript."
        loaded = Loaded(session, resumed_from_disk=False, notice=notice)
    loaded.generation = generation
    return loaded


def _with_checkpoints(
    folder: Path, data: dict[str, Any], session: Session, reference: Reference, resumed: bool
) -> Loaded:
    """``session``, resumed with its cache (checked against ``reference``), given the
    checkpoints saved with it; a checkpoints file that cannot be used is left out with a
    notice."""
    if not resumed:
        return Loaded(session, resumed_from_disk=False, notice=None)
    points, problem = read_checkpoints(folder, data.get("checkpoints"), session, reference)
    session.checkpoints.adopt(points)
    notice = (
        None
        if problem is None
        else (
            f"The saved checkpoints were not used ({problem}); the cache was, so undo and "
            "regenerate evaluate the transcript again until new ones are kept."
        )
    )
    return Loaded(session, resumed_from_disk=True, notice=notice)


def _settings(cls: type[GenerationSettings], raw: dict[str, Any]) -> GenerationSettings:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names})
