"""kvchat's themes on the app, and the theme picked (in the palette) kept in config.toml."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.app import App

from kvchat.config import ConfigError, remember
from kvchat.themes import kvchat_themes


def install_themes(app: App, wanted: str) -> None:
    """Register kvchat's themes on ``app`` (saying which were skipped, and why) and show
    theme ``wanted``, or kvchat-dark (saying why) when ``app`` has no such theme."""
    themes, problems = kvchat_themes()
    for theme in themes:
        app.register_theme(theme)
    for problem in problems:
        app.notify(f"Theme skipped: {problem}", severity="warning", markup=False)
    if wanted in app.available_themes:
        app.theme = wanted
    else:
        app.notify(
            f"Unknown theme {wanted!r}; using kvchat-dark.", severity="warning", markup=False
        )
        app.theme = "kvchat-dark"


def remember_theme(config_path: Path | None, name: str, notify: Callable[..., Any]) -> None:
    """Write theme ``name`` to the config file (``notify`` says why not, if not)."""
    try:
        remember(config_path, theme=name)
    except ConfigError as error:  # the file does not parse: it was left alone
        notify(str(error), severity="warning", markup=False)
    except OSError as error:
        notify(f"Could not remember the theme: {error}", severity="warning")
