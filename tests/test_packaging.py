"""The wheel ships every package and data file (pyproject.toml lists packages by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat import locations

tomllib = pytest.importorskip("tomllib")

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
