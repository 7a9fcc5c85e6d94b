"""Write a model's weights into mlx-lm's folder format a layer at a time.

A demo variant (float32, ``bf16``, ``q4``, ``q8``) is made from a model whose
parameters are still lazy (mlx-lm's own class, freshly initialised, or loaded
with ``lazy=True``): they are cast and quantized with mlx-lm's own functions
(as ``mlx_lm.convert`` does), then evaluated and written one layer at a time.
So a 4-bit variant of a model that would take 11 GB in float32 is built while
holding about one layer in float32 and one shard of its output, and no float32
copy ever reaches the disk. The bytes it will write are known before the first layer is
computed (each lazy array's size is), so a build says first how much disk it takes.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from kvchat.units import human_bytes

SHARD_BYTES = 1 << 30  # big models are written in shards of about this size
GROUP_SIZE = 64  # mlx_lm.convert's default for the affine mode
# progress(done, total, what they count): a model's build and load so far, e.g.
# (3, 24, "layers written, 40.1 MiB of 310.2 MiB") or (3, 24, "layers read")
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Variant:
    """How a demo's weights are stored: the float dtype, and the bits when packed."""

    dtype: str
    bits: int | None = None

    @property
    def phrase(self) -> str:
        """The variant in words, for help texts."""
        return f"{self.bits}-bit" if self.bits else self.dtype


# ``--model`` suffix -> variant. Quantized variants are made from bfloat16 weights,
# as mlx_lm.convert makes them from a bfloat16 checkpoint (scales, biases and the
# norms bfloat16), which is what mlx-community's 4- and 8-bit models hold.
VARIANTS = {
    "": Variant("float32"),
    "bf16": Variant("bfloat16"),
    "q8": Variant("bfloat16", 8),
    "q4": Variant("bfloat16", 4),
}


def stored(
    model: nn.Module, config: dict[str, Any], variant: Variant
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``model``'s parameters by name as ``variant`` stores them (still lazy when they
    were), and the config to save beside them (with mlx_lm.convert's ``quantization``
    block when packed). Their ``nbytes`` are the bytes a build writes."""
    dtype = getattr(mx, variant.dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, value: mx.array) -> mx.array:
        floating = mx.issubdtype(value.dtype, mx.floating)
        return value.astype(dtype) if keep(path) and floating else value

    model.update(tree_map_with_path(cast, model.parameters()))
    if variant.bits:
        from mlx_lm.utils import quantize_model

        with contextlib.redirect_stdout(sys.stderr):  # its progress line is not a reply
            model, config = quantize_model(model, config, GROUP_SIZE, variant.bits)
    return dict(tree_flatten(model.parameters())), config


def write_weights(
    folder: Path,
    model: nn.Module,
    config: dict[str, Any],
    variant: Variant,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``model``'s parameters as ``variant`` into ``folder``; return the config
    to save beside them (see :func:`stored`).

    ``model``'s parameters should be lazy: each layer is computed only when it is
    written. The model is emptied (as mlx-lm's ``save_model`` donates it), so that
    no layer stays in memory once written. ``progress(layers written, layers, what)`` is
    called before the first (``what`` saying the bytes the weights will take), after each
    but the last, and once every file is written.
    """
    weights, config = stored(model, config, variant)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    size = sum(value.nbytes for value in weights.values())
    layers = len({_layer_of(key) for key in weights} - {None})
    written = 0
    done: set[str] = set()  # the layers computed

    def report(count: int) -> None:
        if progress is not None:
            progress(
                count, layers, f"layers written, {human_bytes(written)} of {human_bytes(size)}"
            )

    report(0)
    shards = _split(weights)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    index = {}
    for name, keys in zip(names, shards, strict=True):
        shard = {}
        for run in _layers(keys):
            arrays = {key: weights.pop(key) for key in run}
            mx.eval(arrays)
            shard.update(arrays)
            written += sum(value.nbytes for value in arrays.values())
            del arrays
            layer = _layer_of(run[0])
            if layer is not None and layer not in done:
                done.add(layer)
                if len(done) < layers:  # the last once its file is written
                    report(len(done))
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        index.update(dict.fromkeys(keys, name))
        del shard
    if len(shards) > 1:
        write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
    report(layers)
    return config


def _layers(keys: list[str]) -> list[list[str]]:
    """``keys`` in runs that share a layer (``...layers.<i>.``), in order."""
    runs: list[list[str]] = []
    last = None
    for key in keys:
        layer = _layer_of(key) or key
        if layer != last:
            runs.append([])
            last = layer
        runs[-1].append(key)
    return runs


def _layer_of(key: str) -> str | None:
    """The ``layers.<i>.`` a parameter's name is in, or None (embeddings, the last norm)."""
    found = re.search(r"layers\.\d+\.", key)
    return found.group(0) if found else None


def _split(weights: dict[str, mx.array]) -> list[list[str]]:
    """Group parameter names into shards of at most about SHARD_BYTES each."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, value in weights.items():
        if shards[-1] and size + value.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += value.nbytes
    return shards


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON with sorted keys (a model folder's files)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
