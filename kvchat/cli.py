"""The ``kvchat`` command: the TUI by default, and sub-commands added to `app`."""

from __future__ import annotations

import json
import platform
import sys
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import kvchat
from kvchat import blas, locations
from kvchat.safety import dumps_json, printable

if TYPE_CHECKING:
    from kvchat.engine.model import LoadedModel

app = typer.Typer(
    name="kvchat",
    help="A terminal chat for local LLMs on MLX with a live KV cache per conversation.",
    add_completion=False,
    pretty_exceptions_enable=False,
)


def load_or_exit(spec: str) -> LoadedModel:
    """Load a model, or print the one-line reason to stderr and exit with status 2."""
    from kvchat.engine.model import ModelLoadError, load_model

    try:
        return load_model(spec)
    except ModelLoadError as exc:
        typer.echo(f"kvchat: {printable(str(exc))}", err=True)
        raise typer.Exit(2) from None


def _print_version(value: bool) -> None:
    if not value:
        return
    import mlx.core as mx

    typer.echo(f"kvchat {kvchat.__version__}")
    typer.echo(f"mlx {mx.__version__}, device {_device_name()}")
    typer.echo(f"BLAS: {blas.describe()}")
    raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m",
            help="demo, demo:<shape>, a Hugging Face id or a folder (default: the config's).",
        ),
    ] = None,
    cache: Annotated[
        str | None, typer.Option(help="Cache kind, e.g. standard, quantized:8, rotating:4096.")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for new sessions.")] = None,
    resume: Annotated[str | None, typer.Option(help="Open this saved session.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Longest reply, in tokens.")] = None,
    temp: Annotated[float | None, typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Show versions and exit."
        ),
    ] = False,
) -> None:
    """Chat with a local model in the terminal (the default when no command is given)."""
    if ctx.invoked_subcommand is not None:
        return
    from kvchat.tui.app import exit_now, run_tui

    if system is not None:
        system = _as_text(system, "--system")
    exit_now(run_tui(
        model=model, cache=cache, system=system, resume=resume, max_tokens=max_tokens, temp=temp
    ))


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show versions, the MLX device, the BLAS in use and kvchat's directories."""
    report = _doctor_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    width = max(map(len, report))
    for key, value in report.items():
        typer.echo(f"{key:<{width}}  {value}")


def _doctor_report() -> dict[str, Any]:
    import mlx.core as mx

    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "kvchat": kvchat.__version__,
        "mlx": mx.__version__,
        "mlx-lm": package_version("mlx-lm"),
        "textual": package_version("textual"),
        "device": _device_name(),
        "blas": blas.describe(),
        "blas_status": blas.info.status,
        "cpu_fastpath": _fastpath(),
        "matmul_gflops": round(_matmul_gflops(), 1),
        "data_dir": str(locations.data_dir()),
        "config_dir": str(locations.config_dir()),
        "cache_dir": str(locations.cache_dir()),
    }


def _fastpath() -> str:
    from kvchat.engine import cpu

    return cpu.describe()


def _device_name() -> str:
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def _matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul speed on the default device, n×n by n×n."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    mx.eval(a @ a)  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ a)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


# --------------------------------------------------------------- ask and sessions


def _fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``kvchat: message`` on stderr (made safe: it may quote a file); return the Exit."""
    typer.echo(f"kvchat: {printable(message)}", err=True)
    return typer.Exit(code)


def _as_text(raw: bytes | str, what: str) -> str:
    """``raw`` (stdin's bytes, or an argument holding bytes Python could not decode) as
    text: bytes that are not UTF-8 become U+FFFD, and stderr says so."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = raw.encode("utf-8", "surrogatepass")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        typer.echo(f"kvchat: {what} is not valid UTF-8; the bytes that are not were replaced "
                   "with U+FFFD.", err=True)
        return raw.decode("utf-8", "replace")


@app.command()
def ask(
    text: Annotated[str, typer.Argument(help="The message; '-' reads standard input.")],
    session: Annotated[
        str | None, typer.Option("--session", "-s", help="Load (or create) this saved session.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Model (default: the session's, else the config's)."),
    ] = None,
    cache: Annotated[str | None, typer.Option(help="Cache kind, e.g. quantized:8.")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for a new session.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Longest reply, in tokens.")] = None,
    temp: Annotated[float | None, typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reply and stats as JSON.")] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="After the reply, print the turn's figures on stderr.")
    ] = False,
) -> None:
    """Answer one message from the shell, streaming the reply to stdout as it is written.

    With --session, resume that saved session (cache included) and save it back.
    """
    import contextlib

    from kvchat import store
    from kvchat.config import ConfigError, load_config
    from kvchat.engine.kinds import CacheKindError, parse_kind
    from kvchat.engine.session import GenerationSettings, Session, SessionError

    text = _as_text(sys.stdin.buffer.read() if text == "-" else text, "the message")
    system = _as_text(system, "--system") if system is not None else None
    if not text.strip():
        raise _fail("Nothing to send: the message is empty.", 2)
    try:
        config = load_config().override(max_tokens=max_tokens, temp=temp)
        kind = parse_kind(cache) if cache else None
        if session is not None:
            store.check_name(session)
    except (ConfigError, CacheKindError, store.StoreError) as exc:
        raise _fail(str(exc), 2) from None

    lock = store.session_lock(session) if session else contextlib.nullcontext()
    try:
        with lock:
            saved = store.read(session) if session and store.exists(session) else None
            spec = model or (saved or {}).get("model_id") or config.model
            lm = load_or_exit(spec)
            resumed, notice = False, None
            if saved is not None:
                loaded = store.load(session, lm)
                chat, resumed, notice = loaded.session, loaded.resumed_from_disk, loaded.notice
                chat.settings.max_tokens = config.max_tokens if max_tokens else chat.settings.max_tokens
                chat.settings.temp = config.temp if temp is not None else chat.settings.temp
                if kind is not None:
                    chat.set_kind(kind)
                if system is not None and system != (chat.system or ""):
                    typer.echo("kvchat: --system only applies to a new session; kept the saved one.",
                               err=True)
            else:
                settings = GenerationSettings(max_tokens=config.max_tokens, temp=config.temp)
                chat = Session(lm, kind=kind or config.cache,
                               system=system if system is not None else config.system or None,
                               settings=settings)
                notice = store.set_aside(session) if session else None  # a cache left alone
            if notice:
                typer.echo(f"kvchat: {printable(notice)}", err=True)
            events = chat.send(text)
            try:
                done = _stream_reply(events, echo=not as_json)
            except KeyboardInterrupt:
                events.close()  # between tokens this keeps the reply as stopped
                if session:  # keep the partial reply (marked stopped) with the transcript
                    store.save(chat, session)
                typer.echo("\nkvchat: interrupted" + (f"; saved session {session}."
                                                       if session else "."), err=True)
                raise typer.Exit(130) from None
            save_error = None
            if session:
                try:
                    store.save(chat, session)
                except store.StoreError as exc:  # the reply is shown all the same
                    save_error = str(exc)
    except (store.StoreError, SessionError, CacheKindError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        payload = {"reply": done.reply, **done.stats.to_dict(),
                   "resumed_from_disk": resumed, "notice": notice, "session": session,
                   "saved": bool(session) and save_error is None}
        typer.echo(dumps_json(payload))
    if stats:
        typer.echo(_stats_line(done), err=True)
    if save_error:
        raise _fail(save_error)


def _stream_reply(events, echo: bool):
    """Consume a turn, writing each piece of the reply to stdout as it comes (made safe
    for the terminal) when ``echo``; return its ``TurnDone``."""
    from kvchat.engine.session import Chunk, TurnDone

    done = None
    for event in events:
        if isinstance(event, Chunk) and echo:
            sys.stdout.write(printable(event.text))
            sys.stdout.flush()
        elif isinstance(event, TurnDone):
            done = event
    if echo:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return done


def _stats_line(done) -> str:
    s = done.stats
    line = (f"kvchat: {s.prompt_tokens:,} prompt tokens ({s.reused_tokens:,} reused, "
            f"{s.evaluated_tokens:,} evaluated) in {s.prompt_eval_s:.2f} s, "
            f"{s.generated_tokens:,} generated at {s.gen_tps:.1f} tok/s, "
            f"cache {s.cache_tokens:,} tokens")
    if done.stopped:
        line += ", stopped"
    return line + (f"; rebuilt: {s.rebuilt}" if s.rebuilt else "")


sessions_app = typer.Typer(help="List, show, export and remove saved sessions.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")


def _store_call(fn, *args):
    from kvchat.store import StoreError

    try:
        return fn(*args)
    except StoreError as exc:
        raise _fail(str(exc)) from None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


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
    rows = [("NAME", "MODEL", "CACHE", "TURNS", "TOKENS", "SIZE", "LAST USED")]
    for s in found:
        rows.append((s.name, s.model_id, s.cache_kind, str(s.turns), str(s.cache_tokens),
                     _size(s.size_bytes), s.last_used[:19].replace("T", " ")))
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
        raise _fail(str(exc), 2) from None
    plan = _store_call(store.prune, seconds, True)
    result = plan
    if plan.removed:
        names = ", ".join(plan.removed)
        if not yes:
            if not sys.stdin.isatty():
                raise _fail(f"Would delete {len(plan.removed)} session(s) ({names}); run it again "
                            "with --yes to confirm, as standard input is not a terminal.", 2)
            if not typer.confirm(f"Delete {len(plan.removed)} session(s): {names}?", default=False):
                raise _fail("Nothing was deleted.")
        result = _store_call(store.prune, seconds, False, plan.removed)
    removed = result.removed
    typer.echo(f"Removed {len(removed)} session(s)" + (f": {', '.join(removed)}." if removed else "."))
    for name, why in plan.skipped + (result.skipped if result is not plan else []):
        typer.echo(f"Skipped {name}: {printable(why)}")


@app.command()
def replay(
    script: Annotated[Path, typer.Argument(help="A JSON script: {\"system\": ..., \"turns\": [...]}.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Model to run it on.")] = "demo",
    cache: Annotated[str, typer.Option(help="Cache kind to start with.")] = "standard",
    max_tokens: Annotated[int, typer.Option(help="Longest reply, in tokens.")] = 64,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Baseline: every turn from an empty cache.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run a scripted conversation through one session and show what each turn cost."""
    from rich.console import Console

    from kvchat.engine.kinds import CacheKindError, parse_kind
    from kvchat.engine.session import GenerationSettings
    from kvchat.replay import ReplayError, load_script, result_table, run_script

    try:
        parsed = load_script(script)
        kind = parse_kind(cache)
    except (ReplayError, CacheKindError) as exc:
        raise _fail(str(exc), 2) from None
    if max_tokens < 1:
        raise _fail("--max-tokens must be at least 1.", 2)
    lm = load_or_exit(model)
    try:
        result = run_script(lm, parsed, kind=kind, no_cache=no_cache,
                            settings=GenerationSettings(max_tokens=max_tokens))
    except CacheKindError as exc:
        raise _fail(str(exc), 2) from None
    if as_json:
        typer.echo(dumps_json(result, indent=2))  # replies are model output
    else:
        Console().print(result_table(result))


@app.command()
def bench(
    model: Annotated[
        str, typer.Option("--model", "-m", help="Model to measure (default: a shape-true Qwen2.5-0.5B).")
    ] = "demo:qwen2.5-0.5b",
    quick: Annotated[
        bool, typer.Option("--quick", help="A short run: history sweep up to 2k tokens, smaller article.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print every figure as JSON.")] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write a Markdown report to this file.")
    ] = None,
) -> None:
    """Measure the prompt cache: turns with and without it, history sweep, cache kinds, save/load, BLAS."""
    from kvchat.bench import print_tables, run_bench, to_markdown

    started = time.perf_counter()
    lm = load_or_exit(model)
    result = run_bench(
        model, quick=quick, lm=lm, load_s=time.perf_counter() - started,
        log=lambda msg: typer.echo(msg, err=True),
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_markdown(result), encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print_tables(result)


def main() -> None:
    """Console-script entry point."""
    app()
