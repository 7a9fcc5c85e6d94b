"""Shared fixtures. Every test (and every subprocess it starts) sees kvchat's
directories in one temporary folder, so the suite never touches the user's
files and builds the demo model once."""

from __future__ import annotations

import os
import re

import pytest

# Full float32 products on every backend: the suite compares a batch's rows with each row
# alone (token for token, log-probabilities within 1e-4), which holds at full precision.
# MLX's default on NVIDIA and M5-class GPUs runs a batch's float32 products in TF32 and
# one row's in full float32; tests/test_batch_probe.py covers that mode. Set before MLX
# is imported, and inherited by every subprocess.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# The generation core checks after each step that every sequence's cache holds its ledger
# (kvchat/engine/generation/invariant.py): a break fails the turn instead of going on.
os.environ.setdefault("KVCHAT_DEBUG_BATCH", "1")

from kvchat import blas  # noqa: E402

blas.preload()  # as kvchat's entry point does, before any test imports mlx


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, the tests marked ``cpu_only`` (the CPU fast path, the BLAS)
    where MLX's default device is not the CPU, and where MLX's backend cannot attend over
    a quantized cache (kvchat refuses those kinds there when they are chosen), those
    marked ``quantized_attention`` and the cases of a test whose parameters name a
    quantized or rotated kind."""
    import mlx.core as mx

    from kvchat.engine.caches import fit

    device = mx.default_device()
    problem = next(
        (p for bits in (4, 8) if (p := fit.backend_problem(fit.QUANTIZED_ATTENTION, bits, 64))),
        None,
    )
    on_gpu = device != mx.cpu and f"about the CPU fast path or the BLAS; MLX runs on {device}"
    refused = problem and f"quantized cache kinds are refused on {fit.device()}: {problem}"
    for item in items:
        if on_gpu and item.get_closest_marker("cpu_only"):
            item.add_marker(pytest.mark.skip(reason=on_gpu))
        elif refused and (
            item.get_closest_marker("quantized_attention") or _names_a_quantized_kind(item)
        ):
            item.add_marker(pytest.mark.skip(reason=refused))


def _names_a_quantized_kind(item: pytest.Item) -> bool:
    """Whether the case's id names a quantized or rotated kind (``quantized:8``, or a
    crafted cache's ``quantized-bits``)."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and re.search(r"(quantized|rotated)", callspec.id) is not None


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
    from kvchat.engine.models.model import load_model

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


# The demo's template, except that an assistant message before the last one loses its
# thoughts (everything up to its last </think>), as Qwen3's and DeepSeek-R1's do.
DROPPING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="session")
def dropping_model(demo_model, tmp_path_factory):
    """A copy of the demo folder whose chat template drops the thoughts of earlier
    replies, loaded like any model folder (kvchat's load_model, mlx_lm.load)."""
    from helpers import with_template

    folder = tmp_path_factory.mktemp("models") / "demo-drops-thoughts"
    return with_template(demo_model, folder, DROPPING_TEMPLATE)


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
