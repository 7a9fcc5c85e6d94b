"""Sessions on disk: save, load, list, delete, export, prune. Imports no Textual.

One folder per session under :func:`kvchat.locations.sessions_dir`:

- ``session.json``: the transcript and everything needed to resume it
  (settings, model id and fingerprint, cache kind, ledger, per-turn stats,
  archived turns, kvchat version, times, name);
- ``cache.safetensors``: the prompt cache, written by mlx-lm's
  ``save_prompt_cache`` (no pickle), with metadata naming the kvchat version,
  model fingerprint, cache kind and the ledger it holds.

Every write is atomic (temporary file in the same folder, fsync, rename,
fsync of the folder), the cache first and ``session.json`` last. The JSON
records the cache file's sha256 and the ledger's hash, so a load can tell
whether the pair belongs together. Anything wrong with the cache (missing,
damaged, another model or kvchat version, a ledger that does not match) is
never fatal: the transcript loads and the cache is rebuilt from it, with a
one-sentence notice. Only a damaged ``session.json`` is an error, and nothing
is ever deleted or overwritten because of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import __version__, locations

if TYPE_CHECKING:
    from kvchat.engine.model import LoadedModel
    from kvchat.engine.session import Session

FORMAT = 1
SESSION_FILE = "session.json"
CACHE_FILE = "cache.safetensors"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"
LOCK_TIMEOUT_S = 60.0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# Tests set this to a stage name to make a save stop there (and wait to be killed).
PAUSE_ENV = "KVCHAT_STORE_TEST_PAUSE"

Progress = Callable[[int, int], None]


class StoreError(Exception):
    """A session on disk cannot be read or written; one sentence that names the file."""


@dataclass
class SessionSummary:
    """One line of ``kvchat sessions list``; ``note`` says what is wrong with a damaged one."""

    name: str
    model_id: str
    cache_kind: str
    turns: int
    cache_tokens: int
    size_bytes: int
    last_used: str
    path: Path
    note: str | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass
class Loaded:
    """What :func:`load` returns: the session, whether its cache came from disk, and why not."""

    session: Session
    resumed_from_disk: bool
    notice: str | None


# ------------------------------------------------------------------ names


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid session name, else raise :class:`StoreError`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise StoreError(
            f"Invalid session name {name!r}: use up to 100 letters, digits, '-', '_' or '.', "
            "starting with a letter or digit."
        )
    return name


def session_dir(name: str) -> Path:
    """The folder of session ``name`` (it may not exist)."""
    return locations.sessions_dir() / check_name(name)


def exists(name: str) -> bool:
    """Whether a session called ``name`` has been saved."""
    return (session_dir(name) / SESSION_FILE).is_file()


# ------------------------------------------------------------------ locking

_held: dict[str, tuple[int, int, int]] = {}  # name -> (fd, depth, thread id)
_held_guard = threading.Lock()


@contextlib.contextmanager
def session_lock(name: str, timeout: float | None = None) -> Iterator[Path]:
    """Hold the exclusive lock of session ``name`` (``fcntl.flock`` on ``.lock`` in its folder).

    Two processes (or threads) never work on one session at once: the second
    waits up to ``timeout`` seconds (``KVCHAT_LOCK_TIMEOUT`` or 60 by default),
    then raises :class:`StoreError`. Re-entrant within one thread, so
    :func:`save` can take it while a caller already holds it. Yields the folder.
    """
    folder = session_dir(name)
    key = str(folder)
    me = threading.get_ident()
    with _held_guard:
        entry = _held.get(key)
        if entry and entry[2] == me:
            _held[key] = (entry[0], entry[1] + 1, me)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield folder
        finally:
            with _held_guard:
                fd, depth, owner = _held[key]
                _held[key] = (fd, depth - 1, owner)
        return

    if timeout is None:
        timeout = float(os.environ.get("KVCHAT_LOCK_TIMEOUT", LOCK_TIMEOUT_S))
    _make_dir(folder)
    lock_path = folder / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"Session {name!r} is in use by another kvchat (lock {lock_path} held "
                        f"for over {timeout:g} s); try again when it finishes."
                    ) from None
                time.sleep(0.05)
    except BaseException:
        os.close(fd)
        raise
    with _held_guard:
        _held[key] = (fd, 1, me)
    try:
        yield folder
    finally:
        with _held_guard:
            _held.pop(key, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ------------------------------------------------------------------ files


def _make_dir(folder: Path) -> None:
    locations.sessions_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pause(stage: str) -> None:
    """Test hook: with ``KVCHAT_STORE_TEST_PAUSE=<stage>`` a save stops here to be killed."""
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"kvchat-store-paused:{stage}", file=sys.stderr, flush=True)
        time.sleep(3600)


def _temp_path(folder: Path, suffix: str) -> Path:
    path = folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{suffix}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def _commit(tmp: Path, final: Path, stage: str) -> str:
    """fsync ``tmp``, rename it over ``final``, fsync the folder; return its sha256."""
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    _pause(stage)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return digest.hexdigest()


def _write_bytes_atomic(path: Path, data: bytes, stage: str) -> str:
    tmp = _temp_path(path.parent, ".json")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
        return _commit(tmp, path, stage)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ledger_hash(ledger: list[int]) -> str:
    """A short, stable hash of a token ledger."""
    return hashlib.sha256(",".join(map(str, ledger)).encode()).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# ------------------------------------------------------------------ save


def save(session: Session, name: str) -> Path:
    """Write ``session`` under ``name`` (cache first, then ``session.json``); return the folder.

    Takes the session's lock. A crash at any point leaves the previous save
    loadable: at worst its cache is rebuilt from its transcript.
    """
    from mlx_lm.models.cache import save_prompt_cache

    with session_lock(name) as folder:
        for stale in folder.glob(f"{TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)
        json_path = folder / SESSION_FILE
        created = _now()
        with contextlib.suppress(StoreError):
            created = _read_json(json_path).get("created", created) if json_path.exists() else created

        ledger = list(session.ledger)
        lm = session.lm
        cache_info = None
        if ledger:
            metadata = {
                "kvchat_version": __version__,
                "format": str(FORMAT),
                "model_fingerprint": lm.fingerprint,
                "cache_kind": session.kind.name,
                "ledger_len": str(len(ledger)),
                "ledger_sha256": ledger_hash(ledger),
                "ledger": ",".join(map(str, ledger)),
            }
            tmp = _temp_path(folder, ".safetensors")
            try:
                save_prompt_cache(str(tmp), session.cache, metadata)
                sha = _commit(tmp, folder / CACHE_FILE, "cache")
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            cache_info = {
                "file": CACHE_FILE,
                "sha256": sha,
                "bytes": (folder / CACHE_FILE).stat().st_size,
                "tokens": session.cache_tokens,
                "ledger_sha256": metadata["ledger_sha256"],
            }

        data = {
            "format": FORMAT,
            "kvchat_version": __version__,
            "name": name,
            "created": created,
            "updated": _now(),
            "model_id": lm.model_id,
            "model_fingerprint": lm.fingerprint,
            "cache_kind": session.kind.name,
            "settings": asdict(session.settings),
            "messages": session.messages,
            "archived": session.archived,
            "ledger": ledger,
            "turns": [t.to_dict() for t in session.turns],
            "cache": cache_info,
        }
        text = json.dumps(data, ensure_ascii=False, indent=1)
        _write_bytes_atomic(json_path, text.encode(), "json")
        if cache_info is None:
            (folder / CACHE_FILE).unlink(missing_ok=True)
        return folder


# ------------------------------------------------------------------ load


def _read_json(path: Path) -> dict:
    """Parse a ``session.json``; any problem is a :class:`StoreError` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{path} is missing.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path} is damaged ({_one_line(exc)}); it was left as it is.") from None
    problem = _json_problem(data)
    if problem:
        raise StoreError(f"{path} is damaged ({problem}); it was left as it is.")
    return data


def _json_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return "not a JSON object"
    messages = data.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        return "its messages are not a list of role/content objects"
    ledger = data.get("ledger", [])
    if not isinstance(ledger, list) or not all(isinstance(t, int) for t in ledger):
        return "its ledger is not a list of token ids"
    if not isinstance(data.get("cache_kind", "standard"), str):
        return "its cache kind is not a name"
    if not isinstance(data.get("turns", []), list) or not isinstance(data.get("archived", []), list):
        return "its turns or archived turns are not lists"
    if not isinstance(data.get("settings", {}), dict):
        return "its settings are not an object"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read(name: str) -> dict:
    """The parsed ``session.json`` of ``name`` (no model needed)."""
    path = session_dir(name) / SESSION_FILE
    if not path.exists():
        raise StoreError(f"No saved session named {name!r} (no {path}).")
    return _read_json(path)


def load(name: str, lm: LoadedModel, progress: Progress | None = None) -> Loaded:
    """Load session ``name`` for model ``lm``, cache included when it is sound.

    When the cache cannot be used, the transcript still loads, the cache is
    rebuilt from it (``progress(done, total)`` reports the prefill) and
    ``notice`` says why in one sentence.
    """
    from kvchat.engine.kinds import CacheKindError
    from kvchat.engine.session import GenerationSettings, Session
    from kvchat.engine.stats import TurnStats

    folder = session_dir(name)
    data = read(name)
    json_path = folder / SESSION_FILE
    try:
        settings = _settings(GenerationSettings, data.get("settings", {}))
        turns = [TurnStats.from_dict(t) for t in data.get("turns", [])]
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{json_path} is damaged ({_one_line(exc)}); it was left as it is.") from None
    messages = [dict(m) for m in data["messages"]]
    archived = list(data.get("archived", []))
    ledger = list(data.get("ledger", []))
    kind = data.get("cache_kind", "standard")

    kind_notice = None
    try:
        empty = Session(lm, kind=kind, settings=settings, messages=messages)
    except CacheKindError as exc:
        kind_notice = f"cache kind {kind!r} cannot be used here ({exc}), so it is now 'standard'"
        kind = "standard"
        empty = Session(lm, kind=kind, settings=settings, messages=messages)

    problem = kind_notice
    cache = None
    if problem is None:
        cache, ledger, problem = _read_cache(folder, data, lm, ledger, empty)
    session = Session.restore(
        lm, messages=messages, kind=empty.kind, settings=settings,
        ledger=ledger, cache=cache,
        turns=turns, archived=archived,
    )
    if problem is None:
        return Loaded(session, resumed_from_disk=cache is not None, notice=None)
    session.rebuild(f"the saved cache was not used: {problem}", progress)
    notice = f"The saved cache was not used ({problem}); it was rebuilt from the transcript."
    return Loaded(session, resumed_from_disk=False, notice=notice)


def _settings(cls, raw: dict):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names})


def _read_cache(
    folder: Path, data: dict, lm: LoadedModel, ledger: list[int], empty: Session
) -> tuple[list | None, list[int] | None, str | None]:
    """(cache, its ledger, None) if the saved cache is sound for ``lm`` and ``ledger``,
    else (None, None, why not); (None, None, None) when an empty cache was saved.
    """
    from mlx_lm.models.cache import load_prompt_cache

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
    sha = _file_sha256(path)
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # truncated or garbage files fail in many ways
        return None, None, f"{path} could not be read: {_one_line(exc)}"
    if meta.get("kvchat_version") != __version__:
        return None, None, (
            f"{path} was written by kvchat {meta.get('kvchat_version') or 'unknown'}, "
            f"this is {__version__}"
        )
    if meta.get("model_fingerprint") != lm.fingerprint:
        return None, None, f"{path} was made with another model"
    if meta.get("cache_kind") != empty.kind.name:
        return None, None, f"{path} holds a {meta.get('cache_kind')} cache, not {empty.kind.name}"
    problem = _shape_problem(cache, empty.cache, path)
    if problem:
        return None, None, problem

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
        return None, None, f"{path} could not be read: {_one_line(exc)}"
    return cache, ledger, None


def _shape_problem(cache: list, fresh: list, path: Path) -> str | None:
    if len(cache) != len(fresh):
        return f"{path} has {len(cache)} layers, the model {len(fresh)}"
    for saved, new in zip(cache, fresh):
        if type(saved) is not type(new):
            return f"{path} holds {type(saved).__name__} layers, expected {type(new).__name__}"
        for attr in ("bits", "group_size", "max_size", "chunk_size", "keep"):
            have, want = getattr(saved, attr, None), getattr(new, attr, None)
            if have != want:
                return f"{path} has {attr} {have}, expected {want}"
    return None


# ------------------------------------------------------------------ list, delete, export, prune


def _folder_size(folder: Path) -> int:
    total = 0
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def _summary(folder: Path) -> SessionSummary | None:
    json_path = folder / SESSION_FILE
    if not json_path.exists() and not (folder / CACHE_FILE).exists():
        return None  # being created (only a lock or temporary files so far)
    size = _folder_size(folder)
    mtime = datetime.fromtimestamp(folder.stat().st_mtime, timezone.utc).isoformat(
        timespec="seconds"
    )
    try:
        data = _read_json(json_path)
    except StoreError as exc:
        return SessionSummary(folder.name, "?", "?", 0, 0, size, mtime, folder, note=str(exc))
    info = data.get("cache") or {}
    return SessionSummary(
        name=folder.name,
        model_id=str(data.get("model_id", "?")),
        cache_kind=str(data.get("cache_kind", "?")),
        turns=sum(1 for m in data["messages"] if m["role"] == "user"),
        cache_tokens=int(info.get("tokens", 0)) if isinstance(info, dict) else 0,
        size_bytes=size,
        last_used=str(data.get("updated", mtime)),
        path=folder,
    )


def list_sessions() -> list[SessionSummary]:
    """Every saved session, newest first; a damaged one appears with a ``note``."""
    out = []
    for folder in locations.sessions_dir().iterdir():
        if not folder.is_dir() or not NAME_RE.fullmatch(folder.name):
            continue
        summary = _summary(folder)
        if summary is not None:
            out.append(summary)
    return sorted(out, key=lambda s: s.last_used, reverse=True)


def summary(name: str) -> SessionSummary:
    """The summary of one saved session (``kvchat sessions show``)."""
    folder = session_dir(name)
    found = _summary(folder) if folder.is_dir() else None
    if found is None:
        raise StoreError(f"No saved session named {name!r} (no {folder / SESSION_FILE}).")
    return found


def delete(name: str) -> None:
    """Remove session ``name`` and its files (waits for its lock)."""
    folder = session_dir(name)
    if not folder.is_dir():
        raise StoreError(f"No saved session named {name!r} (no {folder}).")
    with session_lock(name, timeout=5.0):
        shutil.rmtree(folder)


def export(name: str, fmt: str = "md") -> str:
    """The transcript of ``name`` as Markdown (``md``) or JSON (``json``)."""
    data = read(name)
    if fmt == "json":
        keep = ("name", "model_id", "cache_kind", "created", "updated", "settings",
                "messages", "archived", "turns")
        return json.dumps({k: data.get(k) for k in keep}, ensure_ascii=False, indent=2)
    if fmt != "md":
        raise StoreError(f"Unknown export format {fmt!r}; use md or json.")
    lines = [
        f"# {name}",
        "",
        f"- model: {data.get('model_id')}",
        f"- cache kind: {data.get('cache_kind')}",
        f"- created: {data.get('created')}, last used: {data.get('updated')}",
        "",
    ]
    if data.get("archived"):
        lines += ["## Archived (trimmed from the history)", ""]
        lines += _md_messages(data["archived"], level=3)
    lines += _md_messages(data["messages"], level=2)
    return "\n".join(lines).rstrip() + "\n"


def _md_messages(messages: list[dict], level: int) -> list[str]:
    out = []
    for m in messages:
        title = m["role"].capitalize() + (" (stopped)" if m.get("stopped") else "")
        out += [f"{'#' * level} {title}", "", m["content"], ""]
    return out


def prune(older_than_seconds: float) -> list[str]:
    """Delete sessions last used more than ``older_than_seconds`` ago; return their names.

    Damaged sessions and sessions in use are left alone.
    """
    cutoff = time.time() - older_than_seconds
    removed = []
    for s in list_sessions():
        if s.note:
            continue
        try:
            used = datetime.fromisoformat(s.last_used).timestamp()
        except ValueError:
            continue
        if used < cutoff:
            try:
                with session_lock(s.name, timeout=0):
                    shutil.rmtree(s.path)
            except StoreError:
                continue
            removed.append(s.name)
    return removed


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30d``, ``12h``, ``90m``, ``45s`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match:
        raise StoreError(f"Invalid duration {text!r}; use a number and a unit, e.g. 30d, 12h, 90m.")
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * unit
