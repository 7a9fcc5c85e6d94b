"""Starting the TUI: the app made from the config file and the command line's options,
run in kvchat's event loop, and what is still unsaved saved once it has ended."""

from __future__ import annotations

from typing import Any

from kvchat import store
from kvchat.config import ConfigError, load_config
from kvchat.engine.generation.threads import mlx_event_loop
from kvchat.settings import apply_overrides

from .app import KvChatApp


def tui_app(
    *,
    model: str | None = None,
    cache: str | None = None,
    system: str | None = None,
    resume: str | None = None,
    flags: dict[str, Any] | None = None,
) -> KvChatApp:
    """The TUI with the config file's settings, overridden by the given options and
    ``flags`` (generation settings by name, None where not given, as
    :func:`kvchat.cli.common.setting_options` passes them); the flags given also win
    over the settings saved with the sessions it opens. :class:`ConfigError` or
    :class:`store.StoreError` says why not."""
    if resume and model is None:
        model = store.summary(resume).model_id
    flags = flags or {}
    config = apply_overrides(
        load_config(), {"model": model, "cache": cache, "system": system}, flags
    )
    given = {name: getattr(config, name) for name, value in flags.items() if value is not None}
    return KvChatApp(config, resume=resume, settings_flags=given)


def run_tui(**flags) -> int:
    """Start the TUI (:func:`tui_app` says what ``flags`` can be). Returns the exit status."""
    import sys

    try:
        app = tui_app(**flags)
    except (store.StoreError, ConfigError) as error:
        print(f"kvchat: {error}", file=sys.stderr)
        return 2
    return run_app(app)


def run_app(app: KvChatApp) -> int:
    """Run ``app`` until it exits; returns its exit status. Its thread workers run in an
    :class:`~kvchat.engine.generation.threads.MlxThreadPool`, whose threads have ended cleanly when
    this returns, so the process then exits normally."""
    with mlx_event_loop() as loop:
        app.run(loop=loop)
    return after_exit(app)


def after_exit(app: KvChatApp) -> int:
    """Once ``app`` has ended and every worker with it: save what is still unsaved (after a
    signal, or a crash of the UI) where autosave is on, on the app's thread, and let go of
    the sessions it had open (their leases: see :mod:`kvchat.store.lease`); return the
    exit status. (A sharded run saves through its ring, which is gone by now.)"""
    import sys

    try:
        if app.config.autosave and not app.sharded:
            try:
                app.pool.save_unsaved()
            except (store.StoreError, OSError) as error:
                print(f"kvchat: could not save before quitting: {error}", file=sys.stderr)
                return 1
    finally:
        app.pool.let_go_all()
    if app.quitter.signalled is not None:
        return 0
    return app.return_code or 0
