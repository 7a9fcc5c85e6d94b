"""Transcripts in and out: export as Markdown or JSON, import a JSON export as a new
session. Imports no Textual.

An imported session has its transcript, settings and per-turn stats but no cache
(an empty ledger): the first turn after it is opened prefills the whole
transcript, as a fresh session would. The file is validated by the same schema as
``session.json`` (it is untrusted), and nothing saved is overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import __version__
from kvchat.atomic import write_atomic
from kvchat.safety import dumps_json
from kvchat.store.base import FORMAT, NAME_RE, SESSION_FILE, StoreError, exists, now, one_line
from kvchat.store.files import JSON_LIMIT, make_dir, read_regular
from kvchat.store.lock import session_lock
from kvchat.store.save_load import set_aside, transcript
from kvchat.store.schema import parse_session
from kvchat.store.search_index import index_session
from kvchat.store.session_file import read

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session

FORMATS = ("md", "json")  # the export formats: render writes them, every caller offers these
_EXPORTED = (
    "name",
    "model_id",
    "cache_kind",
    "created",
    "updated",
    "settings",
    "messages",
    "archived",
    "turns",
    "branches",
)


def export(name: str, fmt: str = "md") -> str:
    """The transcript of saved session ``name`` as Markdown (``md``) or JSON (``json``)."""
    return render(read(name), fmt)


def export_session(session: Session, name: str, fmt: str = "md") -> str:
    """The transcript of a live ``session`` (saved or not), in the same formats; its times
    are its saved copy's creation and now."""
    created = now()
    if exists(name):
        try:
            created = read(name).get("created", created)
        except StoreError:
            pass
    return render({**transcript(session, name), "created": created, "updated": now()}, fmt)


def render(data: dict[str, Any], fmt: str) -> str:
    """``data`` (as in ``session.json``) as the export format ``fmt``."""
    if fmt not in FORMATS:
        raise StoreError(f"Unknown export format {fmt!r}; use {' or '.join(FORMATS)}.")
    if fmt == "json":
        # branches only where there are some: an export without them reads as before
        return dumps_json(
            {k: data.get(k) for k in _EXPORTED if k != "branches" or data.get(k)}, indent=2
        )
    name = data.get("name")
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
    if data.get("branches"):
        others = len(data["branches"]["nodes"]) - len(data["branches"]["path"])
        lines += [
            f"*This is the current branch; {others} message(s) on other branches "
            "are in the JSON export (`--format json`).*",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def _md_messages(messages: list[dict[str, Any]], level: int) -> list[str]:
    out = []
    for m in messages:
        title = m["role"].capitalize() + (" (stopped)" if m.get("stopped") else "")
        out += [f"{'#' * level} {title}", "", m["content"], ""]
    return out


def write_export(path: Path, text: str) -> Path:
    """Write an export to a new file ``path`` (``~`` expanded; readable by the user only)
    atomically: it appears whole or not at all, and an existing file or symlink is never
    replaced. A problem is one :class:`StoreError` sentence. Returns the path written."""
    path = Path(path).expanduser()
    final = path.parent.resolve() / path.name  # the folder may be a link; the file never
    if os.path.lexists(final):
        raise StoreError(f"{path} exists already; choose another file name.")
    try:
        write_atomic(final, text.encode("utf-8"), replace=False)
    except FileExistsError:
        raise StoreError(f"{path} exists already; choose another file name.") from None
    except OSError as exc:
        raise StoreError(
            f"{path} could not be written ({one_line(exc)}); nothing was left there."
        ) from None
    return path


def import_session(
    path: Path,
    name: str | None = None,
    model_id: str | None = None,
    default_model: str | None = None,
    in_use: Collection[str] = (),
) -> str:
    """Save the JSON export at ``path`` as a new session, without a cache; return its name.

    ``name`` must be free; without it the file's name (or ``imported``) is used, with
    ``-2``, ``-3``... added while taken (saved, or in ``in_use``: open, unsaved tabs). The model is ``model_id``, else the file's, else
    ``default_model``. Any
    problem (not a JSON export, a bad field, a name in use) is a :class:`StoreError`.
    """
    path = Path(path).expanduser()
    try:
        raw = read_regular(path, JSON_LIMIT)
    except FileNotFoundError:
        raise StoreError(f"{path} does not exist.") from None
    except OSError as exc:
        raise StoreError(f"{path} cannot be read ({one_line(exc)}).") from None
    if not raw.lstrip().startswith(b"{"):
        raise StoreError(
            f"{path} is not a JSON export; import reads what "
            "`kvchat sessions export NAME --format json` writes."
        )
    data = parse_session(raw, path)
    model = model_id or data.get("model_id") or default_model
    if not model:
        raise StoreError(f"{path} names no model; say which model it is for.")
    if name is None:
        base = data.get("name", "")
        base = base if NAME_RE.fullmatch(base) else "imported"
        # a suffix shortens a long name so that it stays within the 100 characters allowed
        tries = [base, *(base[: 100 - len(s)] + s for s in (f"-{i}" for i in range(2, 10_000)))]
        name = next((n for n in tries if n not in in_use and not exists(n)), None)
        if name is None:
            raise StoreError(
                f"Every name from {base!r} to {tries[-1]!r} is taken; give the import a name."
            )
    with session_lock(name) as folder:
        if exists(name):
            raise StoreError(f"A session named {name!r} already exists; choose another name.")
        make_dir(folder)
        set_aside(name)
        record = {
            **{k: data[k] for k in _EXPORTED if k in data},
            "format": FORMAT,
            "generation": 1,
            "kvchat_version": __version__,
            "name": name,
            "created": data.get("created") or now(),
            "updated": now(),
            "model_id": model,
            "model_fingerprint": "",
            "ledger": [],
            "cache": None,
        }
        json_path = folder / SESSION_FILE
        write_atomic(json_path, dumps_json(record, indent=1).encode())
        index_session(name, record, json_path)
    return name
