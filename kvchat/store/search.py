"""Search across every saved session's transcript: the queries over the index that
:mod:`~kvchat.store.search_index` keeps (FTS5 phrases with a prefix star; ``LIKE`` where
Python's SQLite lacks FTS5), each brought up to date with the saved sessions first.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import asdict, dataclass, field
from typing import Any

from kvchat.store import search_index
from kvchat.store.base import StoreError, one_line

SNIPPET_TOKENS = 12
_SEPARATORS = re.compile(r"[\x00-\x1f\x7f]")


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
    if not search_index.HAS_FTS5:
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
    found = Found(notes=search_index.sync())
    try:
        with search_index.open_index(found.notes) as conn:
            found.hits = _query(conn, terms, max(1, limit))
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(
            f"The search index at {search_index.index_path()} cannot be used ({one_line(exc)})."
        ) from None
    return found


def matching_sessions(text: str) -> set[str]:
    """The sessions whose transcript matches ``text``, from the index as it is (the
    picker calls :func:`~kvchat.store.search_index.sync` once when it opens, then this on
    each keystroke)."""
    terms = _words(text)
    if not terms:
        return set()
    if search_index.HAS_FTS5:
        sql = "SELECT DISTINCT name FROM rows WHERE id IN (SELECT rowid FROM fts WHERE fts MATCH ?)"
        args: tuple[str, ...] = (_fts_query(terms),)
    else:
        sql = "SELECT DISTINCT name FROM rows WHERE " + " AND ".join(
            "text LIKE ? ESCAPE '\\'" for _ in terms
        )
        args = tuple(map(_like, terms))
    try:
        with search_index.open_index([]) as conn:
            return {name for (name,) in conn.execute(sql, args)}
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"The search index cannot be used ({one_line(exc)}).") from None
