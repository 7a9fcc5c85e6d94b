"""The quick commands load nothing heavy: ``kvchat --version``, ``--help`` and ``sessions
list`` answer without importing MLX, mlx-lm, transformers, Textual or numpy (each costs
seconds on a busy machine), checked through ``sys.modules`` in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from tests.helpers import ask_from_shell

HEAVY = ("mlx", "mlx_lm", "transformers", "textual", "numpy")

PROBE = """
import json, sys
args, watched = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
from kvchat.cli import main
sys.argv = ["kvchat", *args]
try:
    main()
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted({m.split(".")[0] for m in sys.modules} & watched)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _run(args: list[str], env: dict[str, str]) -> tuple[dict[str, object], str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return json.loads(out.stderr.strip().splitlines()[-1]), out.stdout


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["sessions", "list"]])
def test_quick_commands_import_nothing_heavy(args, demo_model, home):
    ask_from_shell("listed", "Hello there.")  # a saved session for `sessions list` to read
    result, stdout = _run(args, dict(os.environ))
    assert result == {"code": 0, "heavy": []}, stdout
    if args == ["sessions", "list"]:
        assert "listed" in stdout


def test_version_names_mlx_from_its_metadata(kvchat_dirs):
    _, stdout = _run(["--version"], dict(os.environ))
    assert stdout.splitlines()[1].startswith(f"mlx {version('mlx')}, backend ")


def test_sessions_show_reads_as_text(demo_model, home):
    """Words for labels and missing values, the last turn as a sentence: no Python reprs
    (``None``, ``key=value``) on the screen; ``--json`` keeps the raw fields."""
    ask_from_shell("shown", "Hello there.")
    _, stdout = _run(["sessions", "show", "shown"], dict(os.environ))
    lines = dict(
        line.split(None, 1)
        for line in stdout.replace("last turn", "last_turn").splitlines()
        if line.strip()
    )
    assert "None" not in stdout and "=" not in stdout, stdout
    assert lines["model"] == "demo"
    assert lines["system"] == "(none)"
    assert lines["last_turn"].startswith("prompt ") and " evaluated in " in lines["last_turn"]


TUI_PROBE = """
import json, sys
from kvchat.tui.run import tui_app
app = tui_app(model="demo", resume=None)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[1])))))
"""


def test_the_tui_is_made_without_mlx_lm(kvchat_dirs, home):
    """``kvchat`` imports its TUI and makes the app (everything before its first frame)
    without mlx-lm, transformers or numpy: the engine's model and cache code comes in the
    load worker, behind the loading screen (mlx-lm and transformers were 0.6 s of the
    1.1 s it took to import the app; mlx.core, 5 ms, comes with the app's event loop)."""
    out = subprocess.run(
        [sys.executable, "-c", TUI_PROBE, json.dumps(["mlx_lm", "transformers", "numpy"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout) == [], out.stderr
