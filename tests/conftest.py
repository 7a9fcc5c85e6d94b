"""Shared fixtures. Every test (and every subprocess it starts) sees kvchat's
directories in one temporary folder, so the suite never touches the user's
files and builds the demo model once."""

from __future__ import annotations

import os

import pytest

import kvchat  # noqa: F401  first, so OpenBLAS is preloaded before any test imports mlx


@pytest.fixture(scope="session", autouse=True)
def kvchat_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Point KVCHAT_HOME, KVCHAT_CONFIG_DIR and KVCHAT_CACHE_DIR at a session tmp dir."""
    root = tmp_path_factory.mktemp("kvchat")
    dirs = {
        "KVCHAT_HOME": str(root / "data"),
        "KVCHAT_CONFIG_DIR": str(root / "config"),
        "KVCHAT_CACHE_DIR": str(root / "cache"),
    }
    saved = {name: os.environ.get(name) for name in dirs}
    os.environ.update(dirs)
    yield dirs
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def demo_model(kvchat_dirs):
    """The tiny demo model, built once for the whole run."""
    from kvchat.engine.model import load_model

    return load_model("demo")


@pytest.fixture(scope="session")
def arch(tmp_path_factory):
    """``arch(name)``: the tiny model of an mlx-lm family (tests/arch_models.py), built
    and loaded once for the whole run."""
    from tests.arch_models import build

    root = tmp_path_factory.mktemp("arch")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = build(root / name, name)
        return loaded[name]

    return get


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private KVCHAT_HOME per test (subprocesses inherit it)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
