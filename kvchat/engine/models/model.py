"""Loading a model: the one place that turns a ``--model`` value into weights.

Everything else takes a `LoadedModel`, so a different way of loading (for
example a model sharded over several machines) only has to change this file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvchat.engine import cpu
from kvchat.engine.models.demo import build_demo, parse_demo_spec
from kvchat.engine.models.demo_build import Progress

DEFAULT_CONTEXT_LENGTH = 4096
# What mlx_lm.load downloads for a Hugging Face id (its DEFAULT_ALLOW_PATTERNS).
DOWNLOAD_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WAY_OUT = "Use --model demo, or pass the path of a downloaded mlx-lm model folder."


@dataclass
class LoadedModel:
    """A model ready to run, with what sessions need to know about it."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    model_id: str  # as the user gave it: "demo", "demo:qwen2.5-0.5b", a HF id, a folder
    path: Path  # the local folder it was loaded from
    fingerprint: str  # changes when the weights' shape or the tokenizer could differ
    context_length: int
    weights: str = "as stored"  # how the weights are held, e.g. "4-bit, groups of 64, kept packed"
    weights_brief: str = "as stored"  # the same in a few words, e.g. "4-bit packed"
    # The CPU fast path this model got (a kvchat.engine.cpu.FastPath), or None and why not.
    fast_path: Any = None
    fast_path_off: str = "off (not prepared)"

    def fast_path_line(self) -> str:
        """One line: what this model runs through the CPU fast path, or why nothing."""
        return self.fast_path.describe() if self.fast_path is not None else self.fast_path_off


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one sentence naming the way out."""


def load_model(spec: str, progress: Progress | None = None) -> LoadedModel:
    """Load ``spec``: a demo name, a local mlx-lm model folder or a Hugging Face id.

    Demo models are built on first use (``progress(layers written, layers, what)``, see
    :func:`~kvchat.engine.models.demo_build.write_weights`). The weights stay the arrays
    ``mlx_lm.load`` made (nothing cast or dequantized); on the CPU backend the model gets
    the CPU fast path's layers, which compute with them as stored (:func:`cpu.prepare`).
    The weights are read a layer at a time, ``progress(layers read, layers, "layers
    read")`` after each.
    """
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError:
        raise ModelLoadError(
            f"Could not load model {spec.encode('utf-8', 'replace').decode()!r}: its name is "
            f"not valid UTF-8. Rename the folder, or {WAY_OUT[0].lower()}{WAY_OUT[1:]}"
        ) from None
    path = resolve_folder(spec, progress)
    source = None if Path(spec).expanduser() == path else path
    if not (path / "config.json").is_file():
        raise load_error(spec, "the folder has no config.json", source)
    try:
        # mlx-lm annotates load as a pair or a triple; return_config=True gives the triple.
        model, tokenizer, config = mlx_lm.load(str(path), lazy=True, return_config=True)  # type: ignore[misc]
        _read_weights(model, progress)
    except json.JSONDecodeError as exc:
        raise load_error(spec, f"a JSON file in it is damaged ({exc})", source) from exc
    except Exception as exc:  # a broken folder fails in many ways; all mean the same here
        raise load_error(spec, first_line(exc), source) from exc
    fast = cpu.prepare(model)
    if isinstance(fast, cpu.FastPath):
        weights, brief = cpu.held(model), cpu.held(model, brief=True)
    else:
        brief = "as stored"
        weights = "as stored (CPU fast path off)" if mx.default_device() == mx.cpu else brief
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=spec,
        path=path,
        fingerprint=fingerprint(spec, path),
        context_length=context_length(config),
        weights=weights,
        weights_brief=brief,
        fast_path=fast if isinstance(fast, cpu.FastPath) else None,
        fast_path_off=fast if isinstance(fast, str) else "",
    )


def _read_weights(model: nn.Module, progress: Progress | None) -> None:
    """Evaluate the lazily loaded weights (what ``mlx_lm.load`` does unless lazy) a layer at
    a time, so that a long read says how far it is; the rest (embeddings, norm, head) last."""
    layers = list(getattr(model, "layers", []))
    for done, layer in enumerate(layers, 1):
        mx.eval(layer.parameters())
        if progress is not None:
            progress(done, len(layers), "layers read")
    mx.eval(model.parameters())


def fingerprint(model_id: str, path: Path) -> str:
    """A short hash of the model id, its config and its tokenizer files."""
    digest = hashlib.sha256(model_id.encode())
    for name in FINGERPRINT_FILES:
        file = path / name
        digest.update(name.encode() + b"\0")
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()[:16]


def context_length(config: dict[str, Any]) -> int:
    """The longest context the config declares, or DEFAULT_CONTEXT_LENGTH."""
    text_config = config.get("text_config", {})
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
        for source in (config, text_config):
            value = source.get(key)
            if isinstance(value, int):
                return value
    return DEFAULT_CONTEXT_LENGTH


def resolve_folder(spec: str, progress: Progress | None = None) -> Path:
    """The local folder for ``spec``, building a demo (``progress`` as it builds) or
    downloading as needed."""
    try:
        demo = parse_demo_spec(spec)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if demo is not None:
        try:
            return build_demo(demo, progress)
        except OSError as exc:
            raise ModelLoadError(
                f"Could not build the demo model '{spec}': {first_line(exc)}. "
                "Free some disk space, or set KVCHAT_CACHE_DIR to a writable folder."
            ) from exc
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise load_error(spec, "it is a file, not a folder")
        return path
    try:
        return Path(snapshot_download(spec, allow_patterns=DOWNLOAD_PATTERNS))
    except HFValidationError as exc:
        reason = "there is no such folder, and it is not a Hugging Face model id either"
        raise load_error(spec, reason) from exc
    except LocalEntryNotFoundError as exc:
        reason = "it is not a local folder and it could not be downloaded (no network?)"
        raise load_error(spec, reason) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        reason = "Hugging Face has no such public model (a typo, or a private or gated one?)"
        raise load_error(spec, reason) from exc
    except HfHubHTTPError as exc:
        raise load_error(spec, f"the download failed ({first_line(exc)})") from exc


def load_error(spec: str, reason: str, source: Path | None = None) -> ModelLoadError:
    """The error saying model ``spec`` (read from ``source``) could not load, and why."""
    where = f" from {source}" if source else ""
    return ModelLoadError(f"Could not load model '{spec}'{where}: {reason}. {WAY_OUT}")


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message without its closing full stop (its type's name
    when it has none)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].rstrip(".")
