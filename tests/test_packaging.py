"""The wheel ships every package and data file (pyproject.toml lists packages by hand); the
floor check pins what pyproject.toml declares; the CUDA extras are declared."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kvchat import locations

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in ROOT.glob("kvchat/**/__init__.py")
    }
    assert on_disk <= listed, "add these to [tool.setuptools] packages in pyproject.toml"
    assert pyproject["tool"]["setuptools"]["package-dir"]["kvchat.themes"] == "themes"


def test_builtin_themes_dir_is_found():
    assert locations.builtin_themes_dir() == ROOT / "themes"


def test_the_floor_check_pins_each_declared_floor_that_applies_here():
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "floors.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "mlx-lm>=0.32.0" in dependencies and "mlx-lm==0.32.0" in out
    # mlx's line for this platform only (mlx[cpu] on Linux, mlx on macOS)
    line = next(d for d in dependencies if d.startswith("mlx") and sys.platform in d)
    assert [pin for pin in out if pin.startswith("mlx==")] == [
        "mlx==" + line.split(">=")[1].split(";")[0]
    ]
    assert not any(pin.startswith(("rich", "typer", "tokenizers")) for pin in out)  # no floor


def test_cuda_extras_pull_mlx_cuda_backends():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for major in ("12", "13"):
        (line,) = extras[f"cuda{major}"]
        assert line.startswith(f"mlx[cuda{major}]>=") and "sys_platform == 'linux'" in line
