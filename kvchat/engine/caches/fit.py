"""Can a model run with a cache kind? Found out by running it, once per model and kind.

Some models' attention reads the keys and values, or builds its mask, itself
rather than through mlx-lm's attention function, so it fails on caches it was
not written for: Gemma 2's on a quantized cache (``expand_dims`` of a tuple)
and on a chunked one (a mask of the wrong shape). And mlx quantizes a cache
in groups of 32, 64 or 128 values along the head dimension, so the group must
divide the model's head size (Phi-3's is 96: 32 fits, mlx-lm's default 64
does not). A probe runs the model on two tokens and then two more with a
fresh cache of the kind; the answer is kept for the model's lifetime on each
device (MLX's default device, the CPU or the GPU, decides which kernels run).

A backend can lack what a kind needs whatever the model: on MLX's CUDA backend
(0.32.4) the models' attention failed on a quantized cache with a RuntimeError.
:func:`backend_problem` runs what a need names (mlx-lm's quantized attention)
on tiny arrays, once per device, so a refusal can say it is the backend and not
the model; the model probe still runs after it passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

T = TypeVar("T")

GROUP_SIZES = (64, 32)  # preferred first: 64 is mlx-lm's default

# id(model) -> (a weak reference to it, {(device, question): answer})
_FOUND: dict[int, tuple[weakref.ref[nn.Module], dict[tuple[str, str], Any]]] = {}

QUANTIZED_ATTENTION = "quantized attention"  # attention that reads a quantized cache

# (device, need) -> None or what failed
_BACKEND: dict[tuple[str, str], str | None] = {}


def group_size(model: nn.Module) -> int | str:
    """The group size quantized caches use for ``model``, or why none fits (a clause)."""
    return once(model, "group size", lambda: _group_size(model))


def problem(model: nn.Module, key: str, make: Callable[[], list[Any]]) -> str | None:
    """None when ``model`` runs with a cache from ``make()`` (a fresh one each call),
    else the exception's type name; ``key`` names the kind for the record."""
    return once(model, key, lambda: _problem(model, make))


def known(model: nn.Module, key: str) -> bool:
    """True when the answer to ``key`` for ``model`` on this device was found already."""
    ref, found = _FOUND.get(id(model), (None, {}))
    return ref is not None and ref() is model and (device(), key) in found


def once(model: nn.Module, key: str, find: Callable[[], T]) -> T:
    """``find()``'s answer to ``key`` for ``model`` on this device, found the first time
    and then kept."""
    slot = id(model)
    ref, found = _FOUND.get(slot, (None, {}))
    if ref is None or ref() is not model:
        found = {}
        _FOUND[slot] = (weakref.ref(model, lambda _: _FOUND.pop(slot, None)), found)
    question = (device(), key)
    if question not in found:
        found[question] = find()
    return cast(T, found[question])  # the answer find() gave for this key


def backend() -> str:
    """The MLX backend that runs on the default device: "cpu", "cuda" or "metal"."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def device() -> str:
    """MLX's default device and its backend, as a refusal names it: "cpu", "gpu (cuda)"."""
    name = backend()
    return name if name == "cpu" else f"gpu ({name})"


def backend_problem(need: str, bits: int, group: int) -> str | None:
    """None when MLX's backend on this device can do ``need`` with ``bits``-bit values in
    groups of ``group``, else what failed (found once per device and need)."""
    key = (device(), f"{need} {bits} {group}")
    if key not in _BACKEND:
        _BACKEND[key] = _backend_problem(need, bits, group)
    return _BACKEND[key]


def _backend_problem(need: str, bits: int, group: int) -> str | None:
    if need != QUANTIZED_ATTENTION:
        raise ValueError(f"no probe for {need!r}")
    queries = mx.zeros((1, 2, 2, group))
    try:
        keys, values = (
            mx.quantize(mx.ones((1, 1, 4, group)), group_size=group, bits=bits) for _ in range(2)
        )
        mx.eval(
            quantized_scaled_dot_product_attention(  # mlx-lm takes "causal" as a mask too
                queries,
                keys,
                values,
                scale=1.0,
                mask="causal",  # type: ignore[arg-type]
                group_size=group,
                bits=bits,
            )
        )
    except Exception as exc:  # the backend says it in its own words
        said = str(exc).strip().splitlines()[:1]
        return f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__
    return None


def _group_size(model: nn.Module) -> int | str:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    dims = sorted(
        {
            x.shape[-1]
            for c in cache
            if type(c) is KVCache
            for x in (c.keys, c.values)
            if x is not None
        }
    )
    group = next((g for g in GROUP_SIZES if all(d % g == 0 for d in dims)), None)
    if group is None:
        shown = dims[0] if len(dims) == 1 else dims
        return (
            f"its head size {shown} is not a multiple of {GROUP_SIZES[-1]}, "
            "the smallest group mlx quantizes"
        )
    return group


def _problem(model: nn.Module, make: Callable[[], list[Any]]) -> str | None:
    cache = make()
    try:
        for _ in range(2):  # a first prompt, then a second one that attends to it
            mx.eval(model(mx.array([[0, 0]]), cache=cache))
    except Exception as exc:  # the model's own attention code fails in its own way
        return type(exc).__name__
    return None
