"""Reading ``cache.safetensors``: is the saved cache sound for this model and transcript?"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvchat import __version__
from kvchat.store.base import CACHE_FILE, ledger_hash, one_line
from kvchat.store.files import file_sha256

if TYPE_CHECKING:
    from kvchat.engine.model import LoadedModel
    from kvchat.engine.session import Session


def read_cache(
    folder: Path, data: dict, lm: LoadedModel, ledger: list[int], empty: Session
) -> tuple[list | None, list[int] | None, str | None]:
    """(cache, its ledger, None) if the saved cache is sound for ``lm`` and ``ledger``,
    else (None, None, why not); (None, None, None) when an empty cache was saved.
    """
    from mlx_lm.models.cache import load_prompt_cache

    from kvchat.engine.cache_check import cache_problem
    from kvchat.engine.kinds import cache_offset, trim_to
    from kvchat.engine.session import common_prefix

    info = data.get("cache")
    path = folder / CACHE_FILE
    if data.get("model_fingerprint") != lm.fingerprint:
        return None, None, (
            f"it was made with model {data.get('model_id')!r}, which differs from "
            f"{lm.model_id!r} now"
        )
    if not ledger:
        return None, None, None if not info else "session.json lists no tokens for it"
    if not isinstance(info, dict):
        return None, None, f"session.json names no cache file for its {len(ledger)} tokens"
    if not path.exists():
        return None, None, f"{path} is missing"
    sha = file_sha256(path)
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # truncated or garbage files fail in many ways
        return None, None, f"{path} could not be read: {one_line(exc)}"
    if meta.get("kvchat_version") != __version__:
        return None, None, (
            f"{path} was written by kvchat {meta.get('kvchat_version') or 'unknown'}, "
            f"this is {__version__}"
        )
    if meta.get("model_fingerprint") != lm.fingerprint:
        return None, None, f"{path} was made with another model"
    if meta.get("cache_kind") != empty.kind.name:
        return None, None, f"{path} holds a {meta.get('cache_kind')} cache, not {empty.kind.name}"
    problem = cache_problem(cache, empty.cache, lm.model)
    if problem:
        return None, None, f"{path} does not fit the model: {problem}"

    if meta.get("ledger_sha256") != ledger_hash(ledger):
        # The cache was replaced but session.json was not (a save cut short): the
        # newer cache still holds the tokens it shares with this transcript's ledger.
        saved = meta.get("ledger", "")
        try:
            cached = [int(t) for t in saved.split(",")] if saved else []
        except ValueError:
            cached = []
        n = common_prefix(cached, ledger)
        if ledger_hash(cached) == meta.get("ledger_sha256") and n and trim_to(cache, n):
            return cache, ledger[:n], None
        return None, None, f"{path} does not belong with session.json (a save was cut short?)"
    if sha != info.get("sha256"):
        return None, None, f"{path} is damaged (its checksum differs from the one in session.json)"
    if cache_offset(cache) != len(ledger):
        return None, None, (
            f"{path} holds {cache_offset(cache)} tokens but session.json lists {len(ledger)}"
        )
    try:
        import mlx.core as mx

        mx.eval([c.state for c in cache])
    except Exception as exc:
        return None, None, f"{path} could not be read: {one_line(exc)}"
    return cache, ledger, None

