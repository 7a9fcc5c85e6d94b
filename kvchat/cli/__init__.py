"""The ``kvchat`` command: the TUI by default, and sub-commands added to one Typer ``app``.

``common`` holds the app and what every command shares; ``main`` the TUI,
``replay`` and ``eval-cache``; ``ask``, ``bench``, ``doctor``, ``launch``, ``models``,
``serve`` and ``sessions`` their commands.
Importing this package registers them all.
"""

from __future__ import annotations

from . import ask, bench, doctor, launch, models, serve, sessions  # noqa: F401  (they register commands)
from .ask import stream_reply
from .common import app
from .main import main

__all__ = ["app", "main", "stream_reply"]
