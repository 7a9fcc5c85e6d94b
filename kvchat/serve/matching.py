"""Which session answers a request: by name, or by the longest shared token prefix.

Chat clients resend the whole conversation every turn. A request is matched to
the live or saved session of the same model whose ledger (the tokens its cache
holds) shares the longest prefix with the request rendered through the chat
template, so any client gets its history's cache back without knowing about
kvchat. A session whose transcript *is* the request's history is continued in
place. An anonymous session that holds only this very request's answer (the
same prompt sent again) takes the new answer in place as a branch, its old
answer kept (:mod:`kvchat.engine.conversation.branches`), so reruns leave no new sessions.
Otherwise the best match lends a copy of its cache, cut to the prefix it
shares with the whole prompt, the new message included, to a new session
(:meth:`Session.fork_prefix`), so a conversation is never overwritten by
another that merely starts the same way.

A request that names a session (``X-Session-Id``) gets that session, from the
pool, the sessions folder (the TUI's) or new. When it sends no history (only
the new message, perhaps a system prompt), the message is added to the saved
conversation (a client continues a TUI or ``kvchat ask`` conversation by name
alone); otherwise its history is the conversation, and one that does not
extend the saved one starts a branch there, the old line kept.

Call it from the thread that holds the model: it loads caches and forks them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat import locations, store
from kvchat.engine.conversation.branches import talk
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.template import Variables, render

from . import anonymous

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel
    from kvchat.runtime.pool import SessionPool


@dataclass
class Match:
    """The session chosen for a request, and how it was found."""

    name: str
    session: Session
    how: str  # "named", "continued", "branched", "forked" or "new"
    resumed_from_disk: bool = False
    notice: str | None = None
    previous: list[dict] | None = None  # its transcript before this request's history

    def adopt(self, messages: list[dict]) -> None:
        """Make ``messages`` the session's transcript, keeping the one it replaces."""
        self.previous = self.session.replace_history(messages)


@dataclass(frozen=True)
class _Candidate:
    name: str
    ledger: list[int]
    messages: list[tuple[str, str, str]]


def _pairs(messages: list[dict]) -> list[tuple[str, str, str]]:
    """What makes two transcripts the same: each message's role, content, name and tool
    fields."""
    return [
        (
            m["role"],
            m["content"],
            json.dumps([m.get("tool_calls"), m.get("tool_call_id"), m.get("name")], sort_keys=True),
        )
        for m in messages
    ]


class Matcher:
    """Finds sessions for requests among the pool's and the sessions folder's."""

    def __init__(
        self,
        pool: SessionPool,
        lm: LoadedModel,
        kind: str,
        busy: Callable[[str], bool] = lambda name: False,
    ):
        self.pool, self.lm, self.kind = pool, lm, kind
        self.busy = busy  # a session another request holds: neither continued nor copied
        self._saved: dict[str, tuple[tuple[int, int], _Candidate | None]] = {}

    def choose(
        self,
        history: list[dict],
        new: list[dict],
        name: str | None,
        tools: list[dict] | None = None,
        variables: Variables = None,
    ) -> Match:
        """The session to add ``new`` (the user's message, or tools' results) to after
        ``history``, with ``tools`` offered and the template's ``variables`` set (as the turn
        renders its prompt); its messages are set to ``history`` (or, for a named session,
        what the rules above say)."""
        if name is not None:
            return self._named(name, history)
        asked = [*history, *new]
        prompt = render(self.lm, asked, True, tools, variables)
        wanted = _pairs(history)
        scored = [(common_prefix(c.ledger, prompt), c) for c in self._candidates()]
        same = [(n, c) for n, c in scored if c.messages == wanted]
        if same:
            _, best = max(same, key=lambda s: s[0])
            match = self._open(best.name, "continued")
            match.adopt(list(history))
            return match
        rerun = [
            (n, c)
            for n, c in scored
            if anonymous.owns(c.name)
            and c.messages[:-1] == _pairs(asked)
            and c.messages[-1][0] == "assistant"
        ]
        if rerun:
            _, best = max(rerun, key=lambda s: s[0])
            match = self._open(best.name, "branched")
            match.adopt(list(history))
            return match
        return self._fork_or_new(scored, history, prompt)

    def choose_completion(self, prompt: list[int]) -> Match:
        """A new session for a plain completion of ``prompt`` (its tokens), starting
        from a copy of the cache that shares the longest prefix with it, if any."""
        scored = [(common_prefix(c.ledger, prompt), c) for c in self._candidates()]
        return self._fork_or_new(scored, [], prompt)

    # ------------------------------------------------------------ internal

    def _fork_or_new(
        self, scored: list[tuple[int, _Candidate]], history: list[dict], prompt: list[int]
    ) -> Match:
        """A new session holding ``history``, its cache copied from the best of
        ``scored`` up to what it shares with ``prompt`` (the new message's tokens too)."""
        name = anonymous.new_name(self.pool)
        n, best = max(scored, key=lambda s: s[0], default=(0, None))
        if n > 0 and best is not None:
            source = self._open(best.name, "forked")
            child = source.session.fork_prefix(history, tokens=prompt)
            self.pool.add(name, child)
            return Match(name, child, "forked", source.resumed_from_disk, source.notice)
        system = history[0]["content"] if history and history[0]["role"] == "system" else None
        session = self.pool.new_session(
            self.lm, self.kind, system=system, name=name, busy=self.busy
        )
        session.replace_history(history)
        return Match(name, session, "new")

    def _named(self, name: str, history: list[dict]) -> Match:
        if name in self.pool or store.exists(name):
            match = self._open(name, "named")
        else:
            system = history[0]["content"] if history and history[0]["role"] == "system" else None
            session = self.pool.new_session(
                self.lm, self.kind, system=system, name=name, busy=self.busy
            )
            match = Match(name, session, "named")
        kept = match.session.messages
        if talk(history):  # the conversation as the client has it (a branch if it differs)
            match.adopt(list(history))
        else:
            match.adopt([*kept, *(m for m in history if m["role"] != "system" or not kept)])
        return match

    def _open(self, name: str, how: str) -> Match:
        if name in self.pool:
            entry = self.pool.entry(name)
            was_out = not entry.in_memory
            session = self.pool.get(name)
            return Match(
                name,
                session,
                how,
                resumed_from_disk=was_out and entry.notice is None,
                notice=entry.notice if was_out else None,
            )
        loaded = self.pool.open(name, self.lm)
        return Match(name, loaded.session, how, loaded.resumed_from_disk, loaded.notice)

    def _candidates(self) -> list[_Candidate]:
        """Every session of this model: the pool's live ones with their ledgers, the rest
        (offloaded or only on disk) with the ledger their ``session.json`` records."""
        found = []
        live = set()
        for entry in self.pool.entries():
            if entry.session.answering or self.busy(entry.name):
                live.add(entry.name)
                continue
            if entry.in_memory and entry.session.lm.fingerprint == self.lm.fingerprint:
                live.add(entry.name)
                # the keeper's own ledger, read here and now (no copy per session per request)
                ledger = entry.session.keeper.ledger
                found.append(_Candidate(entry.name, ledger, _pairs(entry.session.messages)))
        for name in self._saved_names():
            if name not in live:
                saved = self._read_saved(name)
                if saved is not None:
                    found.append(saved)
        return found

    def _saved_names(self) -> list[str]:
        try:
            names = os.listdir(locations.sessions_dir())
        except OSError:
            return []
        return [n for n in names if store.NAME_RE.fullmatch(n)]

    def _read_saved(self, name: str) -> _Candidate | None:
        """The saved session ``name`` as a candidate (read again only when its file
        changed), or None if it is another model's, damaged or unreadable."""
        path = store.session_dir(name) / store.SESSION_FILE
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        cached = self._saved.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            data = store.read(name)
        except store.StoreError:
            candidate = None
        else:
            same_model = data.get("model_fingerprint") == self.lm.fingerprint
            candidate = (
                _Candidate(name, list(data.get("ledger", [])), _pairs(data["messages"]))
                if same_model
                else None
            )
        self._saved[name] = (stamp, candidate)
        return candidate
