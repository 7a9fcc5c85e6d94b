"""Search across every saved session's transcript: an SQLite FTS5 index in the data folder.

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
import re
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat import locations
from kvchat.store.base import NAME_RE, SESSION_FILE, StoreError, one_line
from kvchat.store.session_file import read_json

INDEX_FILE = "search.sqlite3"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 2.0
SNIPPET_TOKENS = 12
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
_SEPARATORS = re.compile(r"[\x00-\x1f\x7f]")


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


@dataclass(frozen=True)
class Hit:
    """One message that matches: its session, role, place in the transcript (archived
    messages first, as ``sessions export`` prints them), a snippet with the match in
    ``[brackets]``, and when the session was last used."""

    name: str
    role: str
    index: int
    snippet: str
    last_used: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Found:
    """What :func:`search_sessions` found, and notes: an index rebuilt, sessions skipped."""

    hits: list[Hit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
def _open(notes: list[str] | None = None) -> Iterator[sqlite3.Connection]:
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
    with contextlib.suppress(sqlite3.Error, OSError), _open() as conn:
        _put(conn, name, _file_id(json_path), data, None)


def drop_session(name: str) -> None:
    """Forget ``name`` after its removal; never raises (a later :func:`sync` drops it)."""
    with contextlib.suppress(sqlite3.Error, OSError), _open() as conn:
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
        with _open(notes) as conn:
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


def _words(text: str) -> list[str]:
    """The words of a query, split at spaces and control characters (a NUL would end
    the query early in SQLite)."""
    return _SEPARATORS.sub(" ", text).split()


def _terms(text: str) -> list[str]:
    terms = _words(text)
    if not terms:
        raise StoreError("Nothing to search for; give a word or a phrase.")
    return terms


def _fts_query(terms: list[str]) -> str:
    """Each term as a quoted FTS5 phrase with a prefix star (``"it""s"*``): the user's
    text is never read as FTS5 syntax, and a word being typed already matches."""
    return " ".join('"' + t.replace('"', '""') + '"*' for t in terms)


def _like(term: str) -> str:
    return "%" + term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _plain_snippet(text: str, term: str) -> str:
    """What FTS5's snippet() gives, roughly, for the LIKE fallback."""
    at = text.lower().find(term.lower())
    if at < 0:  # LIKE folds ASCII case only; str.lower() folds more
        return text[:80] + ("…" if len(text) > 80 else "")
    start, end = max(0, at - 40), at + len(term) + 40
    return (
        ("…" if start else "")
        + text[start:at]
        + "["
        + text[at : at + len(term)]
        + "]"
        + text[at + len(term) : end]
        + ("…" if end < len(text) else "")
    )


def _query(conn: sqlite3.Connection, terms: list[str], limit: int) -> list[Hit]:
    """The first ``limit`` matching messages, newest session first: the matches are
    ordered and cut first, so snippets are made only for the ones returned."""
    order = "ORDER BY s.updated DESC, r.name, r.idx LIMIT ?"
    if not HAS_FTS5:
        where = " AND ".join("r.text LIKE ? ESCAPE '\\'" for _ in terms)
        sql = (
            "SELECT r.name, r.role, r.idx, r.text, s.updated FROM rows r "
            f"JOIN sessions s ON s.name = r.name WHERE {where} {order}"
        )
        rows = conn.execute(sql, (*map(_like, terms), limit))
        return [Hit(n, role, i, _plain_snippet(text, terms[0]), u) for n, role, i, text, u in rows]
    match = _fts_query(terms)
    ids = [
        i
        for (i,) in conn.execute(
            "SELECT r.id FROM rows r JOIN sessions s ON s.name = r.name "
            f"WHERE r.id IN (SELECT rowid FROM fts WHERE fts MATCH ?) {order}",
            (match, limit),
        )
    ]
    snippets = dict(
        conn.execute(
            f"SELECT rowid, snippet(fts, 0, '[', ']', '…', ?) FROM fts WHERE fts MATCH ? "
            f"AND rowid IN ({','.join('?' * len(ids))})",
            (SNIPPET_TOKENS, match, *ids),
        )
    )
    by_id = {
        r[0]: r[1:]
        for r in conn.execute(
            "SELECT r.id, r.name, r.role, r.idx, s.updated FROM rows r JOIN sessions s "
            f"ON s.name = r.name WHERE r.id IN ({','.join('?' * len(ids))})",
            ids,
        )
    }
    return [Hit(by_id[i][0], by_id[i][1], by_id[i][2], snippets[i], by_id[i][3]) for i in ids]


def search_sessions(text: str, limit: int = 50) -> Found:
    """The messages of saved sessions that hold every word of ``text`` (as a word or
    the start of one, case and accents ignored), newest session first, then in
    transcript order; at most ``limit``. Brings the index up to date first."""
    terms = _terms(text)
    found = Found(notes=sync())
    try:
        with _open(found.notes) as conn:
            found.hits = _query(conn, terms, max(1, limit))
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(
            f"The search index at {index_path()} cannot be used ({one_line(exc)})."
        ) from None
    return found


def matching_sessions(text: str) -> set[str]:
    """The sessions whose transcript matches ``text``, from the index as it is (the
    picker calls :func:`sync` once when it opens, then this on each keystroke)."""
    terms = _words(text)
    if not terms:
        return set()
    if HAS_FTS5:
        sql = "SELECT DISTINCT name FROM rows WHERE id IN (SELECT rowid FROM fts WHERE fts MATCH ?)"
        args: tuple[str, ...] = (_fts_query(terms),)
    else:
        sql = "SELECT DISTINCT name FROM rows WHERE " + " AND ".join(
            "text LIKE ? ESCAPE '\\'" for _ in terms
        )
        args = tuple(map(_like, terms))
    try:
        with _open([]) as conn:
            return {name for (name,) in conn.execute(sql, args)}
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"The search index cannot be used ({one_line(exc)}).") from None
