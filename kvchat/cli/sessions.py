"""``kvchat sessions``: list, show, search, export, import, remove and prune saved sessions."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvchat import locations
from kvchat.safety import dumps_json, printable
from kvchat.units import human_bytes

if TYPE_CHECKING:
    pass

from .common import app, fail
from .typed import Typer

sessions_app = Typer(
    help="List, show, search, export and remove saved sessions.", no_args_is_help=True
)
app.add_typer(sessions_app, name="sessions")


def _store_call(fn, *args):
    from kvchat.store import StoreError

    try:
        return fn(*args)
    except StoreError as exc:
        raise fail(str(exc)) from None


@sessions_app.command("list")
def sessions_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Saved sessions, most recently used first."""
    from kvchat import store

    found = store.list_sessions()
    if as_json:
        typer.echo(dumps_json([s.to_dict() for s in found], indent=2))
        return
    if not found:
        typer.echo(f"No saved sessions in {printable(str(locations.sessions_dir()))}.")
        return
    rows: list[tuple[str, ...]] = [
        ("NAME", "MODEL", "CACHE", "TURNS", "TOKENS", "SIZE", "LAST USED")
    ]
    for s in found:
        rows.append(
            (
                s.name,
                s.model_id,
                s.cache_kind,
                str(s.turns),
                str(s.cache_tokens),
                human_bytes(s.size_bytes),
                s.last_used[:19].replace("T", " "),
            )
        )
    rows = [tuple(printable(c, one_line=True) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for s in found:
        if s.note:
            typer.echo(f"note: {s.name}: {printable(s.note, one_line=True)}")


@sessions_app.command("show")
def sessions_show(
    name: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One saved session: model, cache, size and its last turn's stats."""
    from kvchat import store

    summary = _store_call(store.summary, name)
    data = {} if summary.note else _store_call(store.read, name)
    info = summary.to_dict()
    info["system"] = next(
        (m["content"] for m in data.get("messages", [])[:1] if m["role"] == "system"), None
    )
    info["messages"] = len(data.get("messages", []))
    info["created"] = data.get("created")
    info["last_turn"] = (data.get("turns") or [None])[-1]
    if as_json:
        typer.echo(dumps_json(info, indent=2))
        return
    for label, value in _described(info):
        typer.echo(f"{label:<13} {printable(value, one_line=True)}")


def _described(info: dict[str, Any]) -> list[tuple[str, str]]:
    """``sessions show``'s lines for people: words for labels and missing values, sizes
    in bytes' units, the last turn as a sentence (``--json`` keeps the raw fields)."""
    lines = [
        ("name", info["name"]),
        ("model", info["model_id"] or "unknown"),
        ("cache kind", info["cache_kind"]),
        ("turns", str(info["turns"])),
        ("cache", f"{info['cache_tokens']} tokens, {human_bytes(info['size_bytes'])} on disk"),
        ("created", _when(info["created"])),
        ("last used", _when(info["last_used"])),
        ("messages", str(info["messages"])),
        ("system", info["system"] if info["system"] is not None else "(none)"),
        ("folder", info["path"]),
    ]
    if info.get("note"):
        lines.append(("note", info["note"]))
    if info.get("last_turn"):
        lines.append(("last turn", _turn_sentence(info["last_turn"])))
    return lines


def _when(stamp: str | None) -> str:
    """An ISO time to the second, as ``2026-11-28 12:59:51``; anything else as it is."""
    if not stamp:
        return "unknown"
    return (
        stamp[:19].replace("T", " ")
        if re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", stamp)
        else stamp
    )


def _turn_sentence(turn: dict[str, Any]) -> str:
    """A turn's stats in a sentence: ``prompt 12 tokens (0 reused, 12 evaluated in 0.033
    s); 5 generated at 520 tokens/s; cache 16 tokens (16.0 KiB)``, and why it was
    rebuilt or stopped where it was."""

    def number(key: str, form: str = "{}") -> str:
        value = turn.get(key)
        return form.format(value) if isinstance(value, (int, float)) else "?"

    parts = [
        f"prompt {number('prompt_tokens')} tokens ({number('reused_tokens')} reused, "
        f"{number('evaluated_tokens')} evaluated in {number('prompt_eval_s', '{:.3f}')} s)",
        f"{number('generated_tokens')} generated at {number('gen_tps', '{:.1f}')} tokens/s",
    ]
    size = turn.get("cache_bytes")
    held = human_bytes(size) if isinstance(size, int) else "?"
    parts.append(f"cache {number('cache_tokens')} tokens ({held})")
    if turn.get("stopped"):
        parts.append("stopped")
    if turn.get("rebuilt"):
        parts.append(f"rebuilt: {turn['rebuilt']}")
    return "; ".join(parts)


@sessions_app.command("search")
def sessions_search(
    text: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most this many.")] = 20,
) -> None:
    """Messages of saved sessions holding every word of TEXT (or words starting with
    them), newest session first; each match is shown between square brackets."""
    from kvchat import store

    found = _store_call(store.search_sessions, text, limit)
    for note in found.notes:
        typer.echo(f"note: {printable(note, one_line=True)}", err=True)
    if as_json:
        typer.echo(dumps_json([h.to_dict() for h in found.hits], indent=2))
        return
    if not found.hits:
        typer.echo(f"No saved session mentions {printable(text, one_line=True)}.")
        return
    for h in found.hits:
        where = f"{h.name} #{h.index} {h.role} ({h.last_used[:16].replace('T', ' ')})"
        typer.echo(f"{printable(where, one_line=True)}: {printable(h.snippet, one_line=True)}")


@sessions_app.command("rm")
def sessions_rm(name: str) -> None:
    """Delete a saved session and its cache."""
    from kvchat import store

    _store_call(store.delete, name, None)  # waits as long as `ask` would
    typer.echo(f"Removed session {name}.")


@sessions_app.command("export")
def sessions_export(
    name: str,
    fmt: Annotated[str, typer.Option("--format", "-f", help="md or json.")] = "md",
) -> None:
    """Print a session's transcript as Markdown or JSON."""
    from kvchat import store

    text = _store_call(store.export, name, fmt)
    sys.stdout.write(text if fmt == "json" else printable(text))  # JSON escapes its own
    sys.stdout.flush()


@sessions_app.command("import")
def sessions_import(
    path: Path,
    name: Annotated[str | None, typer.Option(help="Its name (default: the file's).")] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="The model it is for (default: the file's, else the config's).",
        ),
    ] = None,
) -> None:
    """Save a JSON export (`export NAME --format json`) as a new session; its cache is
    built when it is first used."""
    from kvchat import store
    from kvchat.config import ConfigError, load_config

    try:
        default = load_config().model
    except ConfigError as error:
        raise fail(str(error), 2) from None
    saved = _store_call(store.import_session, path, name, model, default)
    typer.echo(
        f"Imported {printable(str(path), one_line=True)} as session {saved}; "
        f"`kvchat --resume {saved}` opens it."
    )


@sessions_app.command("prune")
def sessions_prune(
    older_than: Annotated[str, typer.Option("--older-than", help="e.g. 30d, 12h, 90m.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
) -> None:
    """Delete sessions not used for longer than the given duration (asks first, on a
    terminal); sessions in use, damaged ones and symlinks are skipped and named."""
    from kvchat import store
    from kvchat.safety import printable

    try:
        seconds = store.parse_duration(older_than)
    except store.StoreError as exc:
        raise fail(str(exc), 2) from None
    plan = _store_call(store.prune, seconds, True)
    result = plan
    if plan.removed:
        names = ", ".join(plan.removed)
        if not yes:
            if not sys.stdin.isatty():
                raise fail(
                    f"Would delete {len(plan.removed)} session(s) ({names}); run it again "
                    "with --yes to confirm, as standard input is not a terminal.",
                    2,
                )
            if not typer.confirm(f"Delete {len(plan.removed)} session(s): {names}?", default=False):
                raise fail("Nothing was deleted.")
        result = _store_call(store.prune, seconds, False, plan.removed)
    removed = result.removed
    typer.echo(
        f"Removed {len(removed)} session(s)" + (f": {', '.join(removed)}." if removed else ".")
    )
    for name, why in plan.skipped + (result.skipped if result is not plan else []):
        typer.echo(f"Skipped {name}: {printable(why)}")
