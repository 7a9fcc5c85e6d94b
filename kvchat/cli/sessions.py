"""``kvchat sessions``: list, show, search, export, import, remove and prune saved sessions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvchat import locations
from kvchat.safety import dumps_json, printable
from kvchat.units import human_bytes

if TYPE_CHECKING:
    pass

from .common import app, fail

sessions_app = typer.Typer(
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
    for key, value in info.items():
        if key == "last_turn" and value:
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        typer.echo(f"{key:<13} {printable(str(value), one_line=True)}")


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
