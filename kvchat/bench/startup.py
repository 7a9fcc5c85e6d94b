"""The bench's start-up section: how long the commands that import nothing heavy take
(``--version``, ``--help``, ``sessions list``) and importing the TUI up to its first
frame's modules, each in a fresh process, best of three (issue 39's first minute)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from .common import KVCHAT, Log, temp_home

PYTHON = [sys.executable, "-c"]
# what is run, in a fresh process each: the name the report gives it, and its argv
RUNS = (
    ("kvchat --version", [*KVCHAT, "--version"]),
    ("kvchat --help", [*KVCHAT, "--help"]),
    ("kvchat sessions list", [*KVCHAT, "sessions", "list"]),
    ("importing the TUI (its first frame's modules)", [*PYTHON, "import kvchat.tui.run"]),
    ("importing mlx-lm (what the TUI leaves to its loading worker)", [*PYTHON, "import mlx_lm"]),
)


def start_up_times(log: Log, rounds: int = 3) -> dict[str, Any]:
    """Each run's best wall time in seconds, and the bare interpreter's for reference."""
    log("start-up: the light commands and the TUI's imports, fresh processes")
    with temp_home():  # sessions list makes the sessions folder: not in the user's home
        rows = [{"what": "python -c pass", "s": _best([*PYTHON, "pass"], rounds)}]
        rows += [{"what": what, "s": _best(argv, rounds)} for what, argv in RUNS]
    return {"rows": rows, "rounds": rounds}


def _best(argv: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, timeout=120)
        times.append(time.perf_counter() - started)
    return min(times)
