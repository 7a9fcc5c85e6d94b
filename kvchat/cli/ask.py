"""``kvchat ask``: one turn from the shell, the reply streamed to stdout."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from kvchat.safety import dumps_json, printable

from .common import app, as_text, fail, load_or_exit, setting_options


@app.command()
@setting_options
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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the reply and stats as JSON.")
    ] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="After the reply, print the turn's figures on stderr.")
    ] = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Answer one message from the shell, streaming the reply to stdout as it is written.

    With --session, resume that saved session (cache included) and save it back. It holds
    the session's lock from the load to the save, so asks on one session take turns;
    the save still checks the generation it loaded (a front end that holds the
    session open, the TUI or serve, is the one that finds the session changed).
    """
    import contextlib

    from kvchat import drafts, store
    from kvchat.config import ConfigError, load_config
    from kvchat.engine.caches.kinds import CacheKindError, parse_kind
    from kvchat.engine.conversation.session import SessionError
    from kvchat.runtime.sessions import load_session, new_session, save_session
    from kvchat.settings import apply_overrides, generation_of

    text = as_text(sys.stdin.buffer.read() if text == "-" else text, "the message")
    system = as_text(system, "--system") if system is not None else None
    if not text.strip():
        raise fail("Nothing to send: the message is empty.", 2)
    try:
        flags = flags or {}
        config = apply_overrides(load_config(), flags)
        kind = parse_kind(cache) if cache else None
        if session is not None:
            store.check_name(session)
    except (ConfigError, CacheKindError, store.StoreError) as exc:
        raise fail(str(exc), 2) from None

    lock = store.session_lock(session) if session else contextlib.nullcontext()
    try:
        with lock:
            saved = store.read(session) if session and store.exists(session) else None
            spec = model or (saved or {}).get("model_id") or config.model
            lm = load_or_exit(spec)
            resumed, notice = False, None
            base = store.Generation()  # nothing saved: the save checks that it still is not
            if saved is not None and session:
                loaded = load_session(session, lm)
                chat, resumed, notice = loaded.session, loaded.resumed_from_disk, loaded.notice
                base = loaded.generation
                chat.settings = apply_overrides(chat.settings, flags)  # flags beat the saved
                if kind is not None:
                    chat.set_kind(kind)
                if system is not None and system != (chat.system or ""):
                    typer.echo(
                        "kvchat: --system only applies to a new session; kept the saved one.",
                        err=True,
                    )
            else:
                chat = new_session(
                    lm,
                    kind=kind or config.cache,
                    system=system if system is not None else config.system or None,
                    settings=generation_of(config),
                )
                notice = store.set_aside(session) if session else None  # a cache left alone
            if notice:
                typer.echo(f"kvchat: {printable(notice)}", err=True)
            events = chat.send(text)
            if session:  # on disk before the prefill: a kill now loses no message
                try:
                    drafts.keep(session, text)
                except (store.StoreError, OSError) as exc:  # a full disk: sent all the same
                    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    typer.echo(
                        f"kvchat: the message could not be kept on disk while it is "
                        f"sent ({printable(str(reason)).lower()}).",
                        err=True,
                    )
            try:
                done = stream_reply(events, echo=not as_json)
            except KeyboardInterrupt:
                events.close()  # between tokens this keeps the reply as stopped
                if session:  # keep the partial reply (marked stopped) with the transcript
                    save_session(chat, session, base=base)
                    drafts.clear(session)
                typer.echo(
                    "\nkvchat: interrupted" + (f"; saved session {session}." if session else "."),
                    err=True,
                )
                raise typer.Exit(130) from None
            save_error = None
            if session:
                try:
                    save_session(chat, session, base=base)
                    drafts.clear(session)
                except store.StoreError as exc:  # the reply is shown all the same
                    save_error = str(exc)
    except (store.StoreError, SessionError, CacheKindError) as exc:
        raise fail(str(exc)) from None
    if as_json:
        payload = {
            "reply": done.reply,
            **done.stats.to_dict(),
            "resumed_from_disk": resumed,
            "notice": notice,
            "session": session,
            "saved": bool(session) and save_error is None,
        }
        typer.echo(dumps_json(payload))
    if stats:
        typer.echo(_stats_line(done), err=True)
    if save_error:
        raise fail(save_error)


def stream_reply(events, echo: bool):
    """Consume a turn, writing each piece of the reply to stdout as it comes (made safe
    for the terminal) when ``echo``; return its ``TurnDone``."""
    from kvchat.engine.conversation.session import Chunk, TurnDone

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
    from kvchat.engine.conversation.thoughts import reevaluated_note

    s = done.stats
    line = (
        f"kvchat: {s.prompt_tokens:,} prompt tokens ({s.reused_tokens:,} reused, "
        f"{s.evaluated_tokens:,} evaluated) in {s.prompt_eval_s:.2f} s, "
        f"{s.generated_tokens:,} generated at {s.gen_tps:.1f} tok/s, "
        f"cache {s.cache_tokens:,} tokens"
    )
    if done.stopped:
        line += ", stopped"
    note = reevaluated_note(s.reevaluated_reply_tokens)
    if note:
        line += f"; {note}"
    return line + (f"; rebuilt: {s.rebuilt}" if s.rebuilt else "")
