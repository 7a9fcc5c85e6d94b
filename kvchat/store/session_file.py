"""Reading ``session.json``: parse it and check its structure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvchat.store.base import SESSION_FILE, StoreError, one_line, session_dir


def read_json(path: Path) -> dict:
    """Parse a ``session.json``; any problem is a :class:`StoreError` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{path} is missing.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path} is damaged ({one_line(exc)}); it was left as it is.") from None
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


def read(name: str) -> dict:
    """The parsed ``session.json`` of ``name`` (no model needed)."""
    path = session_dir(name) / SESSION_FILE
    if not path.exists():
        raise StoreError(f"No saved session named {name!r} (no {path}).")
    return read_json(path)
