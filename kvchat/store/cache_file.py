"""Reading ``cache.safetensors``: is the saved cache sound for this model and transcript?"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import __version__
from kvchat.atomic import sha256_of
from kvchat.store.base import CACHE_SUM_FILE, StoreError, ledger_hash, one_line
from kvchat.store.files import open_regular, read_regular
from kvchat.store.shards import shard_file, shard_sha

if TYPE_CHECKING:
    from kvchat.engine.caches.cache_check import Reference
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel


# A saved cache as read: (the cache, its ledger, why it cannot be used).
CacheRead = tuple[list[Any] | None, list[int] | None, str | None]


def read_cache(
    folder: Path,
    data: dict[str, Any],
    lm: LoadedModel,
    ledger: list[int],
    empty: Session,
    reference: Reference,
    rank: int = 0,
) -> CacheRead:
    """(cache, its ledger, None) if the saved cache is sound for ``lm`` and ``ledger``
    (checked against ``reference``, made from ``empty``'s cache), else (None, None, why
    not); (None, None, None) when an empty cache was saved.

    A rank other than 0 of a sharded run reads its own shard (``store/shards.py``).
    """
    import mlx.core as mx

    from kvchat.engine.caches.cache_check import cache_problem
    from kvchat.engine.caches.kinds import cache_offset, trim_to
    from kvchat.engine.caches.loading import load_prompt_cache
    from kvchat.engine.conversation.maintenance import common_prefix
    from kvchat.engine.sharding.sharded_model import layout_problem

    info = data.get("cache")
    path = folder / shard_file(rank)
    if not ledger and not info:  # an empty cache (an imported session): any model will do
        return None, None, None
    if data.get("model_fingerprint") != lm.fingerprint:
        return (
            None,
            None,
            layout_problem(data.get("model_fingerprint"), lm.fingerprint)
            or (
                f"it was made with model {data.get('model_id')!r}, which differs from "
                f"{lm.model_id!r} now"
            ),
        )
    if not ledger:
        return None, None, None if not info else "session.json lists no tokens for it"
    if not isinstance(info, dict):
        return None, None, f"session.json names no cache file for its {len(ledger)} tokens"
    if not os.path.lexists(path):
        return None, None, f"{path} is missing"
    try:  # a regular file only (no symlink, FIFO, device), no bigger than a cache can be
        with open_regular(path, _size_cap(lm)) as f:
            sha = sha256_of(f)
            cache, meta = load_prompt_cache(f)
            mx.eval([c.state for c in cache])
    except StoreError as exc:
        return None, None, str(exc).rstrip(".")
    except Exception as exc:  # truncated or garbage files fail in many ways
        return None, None, f"{path} could not be read: {one_line(exc)}"
    if meta.get("kvchat_version") != __version__:
        return (
            None,
            None,
            (
                f"{path} was written by kvchat {meta.get('kvchat_version') or 'unknown'}, "
                f"this is {__version__}"
            ),
        )
    if meta.get("model_fingerprint") != lm.fingerprint:
        return None, None, f"{path} was made with another model"
    if meta.get("cache_kind") != empty.kind.name:
        return None, None, f"{path} holds a {meta.get('cache_kind')} cache, not {empty.kind.name}"
    problem = cache_problem(cache, reference)
    if problem:
        return None, None, f"{path} does not fit the model: {problem}"

    if meta.get("ledger_sha256") != ledger_hash(ledger) and rank:
        return None, None, f"{path} does not belong with session.json (a save was cut short?)"
    if meta.get("ledger_sha256") != ledger_hash(ledger):
        # The cache was replaced but session.json was not (a save cut short): the
        # newer cache still holds the tokens it shares with this transcript's ledger.
        saved = meta.get("ledger", "")
        try:
            cached = [int(t) for t in saved.split(",")] if saved else []
        except ValueError:
            cached = []
        n = common_prefix(cached, ledger)
        if not _verified(folder, sha, meta.get("ledger_sha256")):
            return (
                None,
                None,
                (
                    f"{path} does not belong with session.json and its checksum cannot be "
                    f"verified against {CACHE_SUM_FILE}"
                ),
            )
        if ledger_hash(cached) == meta.get("ledger_sha256") and n and trim_to(cache, n):
            return cache, ledger[:n], None
        return None, None, f"{path} does not belong with session.json (a save was cut short?)"
    if sha != shard_sha(info, rank):
        return None, None, f"{path} is damaged (its checksum differs from the one in session.json)"
    held: int | str | None = cache_offset(cache)
    if held is None:  # recurrent state only: the file's own count stands for the position
        held = meta.get("ledger_len")
    if str(held) != str(len(ledger)):
        return None, None, f"{path} holds {held} tokens but session.json lists {len(ledger)}"
    return cache, ledger, None


def _verified(folder: Path, sha: str, ledger_sha: str | None) -> bool:
    """Whether ``cache.sha256`` (written by the save before it renamed the cache into
    place) vouches for a cache file with checksum ``sha`` holding ledger ``ledger_sha``."""
    try:
        record = json.loads(read_regular(folder / CACHE_SUM_FILE, 4096))
    except (OSError, StoreError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == sha
        and bool(ledger_sha)
        and (record.get("ledger_sha256") == ledger_sha)
    )


def _size_cap(lm: LoadedModel) -> int:
    """The most bytes a cache file of ``lm`` is read for: four times the model's weights
    (a KV cache of the whole context stays well under that) plus 64 MiB."""
    from kvchat.engine.models.registry import weight_bytes

    return 4 * weight_bytes(lm) + (64 << 20)
