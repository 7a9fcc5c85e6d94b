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


@pytest.fixture
def endless(demo_model, monkeypatch):
    """The demo model with no end tokens. The trained demo ends its turn after a sentence
    or two; tests of a reply that is still running (stopped, cut by max_tokens, a client
    that gives up) need one that goes on."""
    monkeypatch.setattr(demo_model.tokenizer, "eos_token_ids", set())
    return demo_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private KVCHAT_HOME per test (subprocesses inherit it)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
