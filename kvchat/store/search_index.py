"""The search index of every saved session's transcript: an SQLite FTS5 database in the
data folder, and keeping it in step with the saved sessions (the queries over it are
:mod:`~kvchat.store.search`'s).

The index (``search.sqlite3``, 0600) is a cache of the ``session.json`` files and
can always be rebuilt from them: losing it loses nothing. ``rows`` holds one row
per message (session name, role, index, text); the FTS5 table ``fts`` indexes
their text (external content, kept in step by triggers). ``sessions`` records, for
each session, the identity of the ``session.json`` it was read from (inode, mtime,
size), so :func:`sync` re-reads only the files that changed since: a save whose
index update failed (a full disk, a locked database), a session removed by hand or
saved by an older kvchat is caught up by the next search, without a flag to lose.

A save updates its session's rows (:func:`index_session`), a removal drops them
(:func:`drop_session`); neither ever fails because of the index. A missing index
is built, a damaged one or one of another schema version rebuilt, with a notice.
Where Python's SQLite lacks FTS5, queries fall back to ``LIKE`` over ``rows``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvchat import locations
from kvchat.store.base import NAME_RE, SESSION_FILE, StoreError, one_line
from kvchat.store.session_file import read_json

INDEX_FILE = "search.sqlite3"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 2.0
REBUILT = "The search index was unusable"  # how the notice of a rebuild begins
# Errors that say nothing against the file (another kvchat writing, a full disk): no rebuild.
_PASSING = (
    "SQLITE_BUSY",
    "SQLITE_LOCKED",
    "SQLITE_FULL",
    "SQLITE_IOERR",
    "SQLITE_READONLY",
    "SQLITE_CANTOPEN",
    "SQLITE_PERM",
    "SQLITE_NOMEM",
)


def _has_fts5() -> bool:
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE t USING fts5(x)")
    except sqlite3.Error:
        return False
    return True


HAS_FTS5 = _has_fts5()

_TABLES = """
CREATE TABLE sessions (name TEXT PRIMARY KEY, file_id TEXT, updated TEXT, note TEXT);
CREATE TABLE rows (id INTEGER PRIMARY KEY, name TEXT NOT NULL, role TEXT NOT NULL,
                   idx INTEGER NOT NULL, text TEXT NOT NULL);
CREATE INDEX rows_name ON rows(name);
"""
_FTS = """
CREATE VIRTUAL TABLE fts USING fts5(text, content='rows', content_rowid='id',
                                    tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER rows_ai AFTER INSERT ON rows BEGIN
  INSERT INTO fts(rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER rows_ad AFTER DELETE ON rows BEGIN
  INSERT INTO fts(fts, rowid, text) VALUES ('delete', old.id, old.text);
END;
"""


def index_path() -> Path:
    return locations.data_dir() / INDEX_FILE


def _file_id(path: Path) -> str | None:
    """Which ``session.json`` is there now (a save renames a new file into place)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return f"{info.st_ino}:{info.st_mtime_ns}:{info.st_size}"


def _create(path: Path) -> None:
    """A new, empty index at ``path``, built beside it and renamed into place (a symlink
    there is replaced, never followed)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(_TABLES + (_FTS if HAS_FTS5 else ""))
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.commit()
        finally:
            conn.close()
        with contextlib.suppress(FileNotFoundError):  # the old file's, never to be replayed
            os.unlink(path.with_name(path.name + "-journal"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _connect(path: Path) -> sqlite3.Connection:
    """Open the index at ``path``; sqlite3.DatabaseError if it is not a current one."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise sqlite3.DatabaseError("not a regular file")
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version}, not {SCHEMA_VERSION}")
        conn.execute("SELECT count(*) FROM sessions").fetchone()
        if HAS_FTS5:
            conn.execute("SELECT rowid FROM fts LIMIT 1").fetchall()
    except BaseException:
        conn.close()
        raise
    return conn


def _passing(exc: sqlite3.DatabaseError) -> bool:
    """Whether ``exc`` says nothing against the file (``sqlite_errorname`` is 3.11+)."""
    name = getattr(exc, "sqlite_errorname", "")
    return name.startswith(_PASSING) or "is locked" in str(exc)


@contextlib.contextmanager
def open_index(notes: list[str] | None = None) -> Iterator[sqlite3.Connection]:
    """The index, built when missing and rebuilt (with a note in ``notes``) when damaged
    or of another schema version; committed on success, closed always."""
    path = index_path()
    if not os.path.lexists(path):
        _create(path)
    try:
        conn = _connect(path)
    except sqlite3.DatabaseError as exc:
        if notes is None or _passing(exc):
            raise
        notes.append(f"{REBUILT} ({one_line(exc)}); it was rebuilt from the saved sessions.")
        _create(path)
        conn = _connect(path)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def _transcript(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [*data.get("archived", []), *data["messages"]]


def _put(
    conn: sqlite3.Connection,
    name: str,
    file_id: str | None,
    data: dict[str, Any] | None,
    note: str | None,
) -> None:
    """Replace ``name``'s rows with ``data``'s messages (none when it could not be read)."""
    conn.execute("DELETE FROM rows WHERE name = ?", (name,))
    updated = str(data.get("updated", "")) if data else ""
    conn.execute(
        "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)", (name, file_id, updated, note)
    )
    if data:
        conn.executemany(
            "INSERT INTO rows (name, role, idx, text) VALUES (?, ?, ?, ?)",
            [(name, m["role"], i, m["content"]) for i, m in enumerate(_transcript(data))],
        )


def index_session(name: str, data: dict[str, Any], json_path: Path) -> None:
    """Bring ``name``'s rows up to date after a save wrote ``data`` to ``json_path``.

    Never raises: a failure (a full disk, a locked or damaged index) leaves the
    index behind the file, and the next :func:`sync` catches up.
    """
    with contextlib.suppress(sqlite3.Error, OSError), open_index() as conn:
        _put(conn, name, _file_id(json_path), data, None)


def drop_session(name: str) -> None:
    """Forget ``name`` after its removal; never raises (a later :func:`sync` drops it)."""
    with contextlib.suppress(sqlite3.Error, OSError), open_index() as conn:
        conn.execute("DELETE FROM rows WHERE name = ?", (name,))
        conn.execute("DELETE FROM sessions WHERE name = ?", (name,))


def _sync(conn: sqlite3.Connection) -> None:
    """Re-read the ``session.json`` files that changed since they were indexed, through
    the store's safe reader; forget the sessions that are gone."""
    known = dict(conn.execute("SELECT name, file_id FROM sessions"))
    seen = set()
    for entry in os.scandir(locations.sessions_dir()):
        if not NAME_RE.fullmatch(entry.name):
            continue  # .locks, folders being removed
        seen.add(entry.name)
        json_path = Path(entry.path) / SESSION_FILE
        file_id = _file_id(json_path)
        if entry.name in known and known[entry.name] == file_id:
            continue
        data, note = None, None
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            note = f"{entry.path} is not a session folder; it was not searched."
        elif file_id is not None:
            try:
                data = read_json(json_path)
            except StoreError as exc:
                note = f"{exc} It was not searched."
        _put(conn, entry.name, file_id, data, note)
    for gone in known.keys() - seen:
        conn.execute("DELETE FROM rows WHERE name = ?", (gone,))
        conn.execute("DELETE FROM sessions WHERE name = ?", (gone,))


def sync() -> list[str]:
    """Bring the index up to date with the saved sessions; return its notes (a rebuild,
    sessions skipped because damaged or not session folders)."""
    notes: list[str] = []
    try:
        with open_index(notes) as conn:
            _sync(conn)
            notes += [
                n
                for (n,) in conn.execute(
                    "SELECT note FROM sessions WHERE note IS NOT NULL ORDER BY name"
                )
            ]
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(
            f"The search index at {index_path()} cannot be used ({one_line(exc)})."
        ) from None
    return notes


def reindex() -> list[str]:
    """Rebuild the index from every ``session.json``; return the notes of :func:`sync`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index_path())
    return sync()
