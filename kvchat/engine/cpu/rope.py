"""The rotary embedding as the numpy decoding step applies it: what it needs of a RoPE
module (:class:`RopeForm`), the cosines and sines of the angles at given offsets, taken
from the module itself (applied to ones and zeros, so any of mlx-lm's variants computes
its own angles), and the rotation of queries and keys by them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import rope_utils

# RoPE modules that turn each pair of the first ``dims`` features by an angle (after an
# optional constant factor) and leave the rest: what applying one to ones and zeros reads.
ROPES = (
    nn.RoPE,
    rope_utils.Llama3RoPE,
    rope_utils.YarnRoPE,
    rope_utils.SuScaledRoPE,
    rope_utils.ProportionalRoPE,
    rope_utils.DynamicNTKScalingRoPE,
)


# A RoPE module's class name, its settings and its frequency table (bytes), if any.
RopeKey = tuple[str, tuple[tuple[str, bool | int | float | str], ...], bytes | None]
# (cos, sin) of the angles one offset turns each feature pair by
Turn = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class RopeForm:
    """What the step needs of a RoPE module: the features it turns, their pairing, and a
    key equal for modules that compute the same angles (one table for all layers)."""

    dims: int
    traditional: bool
    key: RopeKey


def rope_form(rope: nn.Module) -> RopeForm | str:
    """``rope``'s :class:`RopeForm`, or why the step cannot take it."""
    if type(rope) not in ROPES:
        return f"its RoPE ({type(rope).__name__}) is not one the numpy step computes"
    dims = getattr(rope, "dims", None) or getattr(rope, "dim", None)
    if not isinstance(dims, int) or dims <= 0 or dims % 2:
        return f"its RoPE turns {dims!r} features (an even count is needed)"
    settings = tuple(
        sorted((k, v) for k, v in vars(rope).items() if isinstance(v, (bool, int, float, str)))
    )
    freqs = rope.get("_freqs")
    table = None if freqs is None else np.asarray(freqs.astype(mx.float32)).tobytes()
    return RopeForm(
        dims, bool(getattr(rope, "traditional", False)), (type(rope).__name__, settings, table)
    )


# Positions a kept table of angles grows by at least (a step's tables are slices of it).
TABLE_STEP = 256
# RoPE modules whose angles depend on the length of what they turn (a longer sequence, a
# larger base): their tables are made for each step's own offset and count, never kept
BY_LENGTH = (rope_utils.DynamicNTKScalingRoPE,)
# form key -> (cos, sin) ``(positions, dims / 2)`` from position 0: every step's tables
# are slices of these, made once for all steps, layers, rows and models with equal keys
_TABLES: dict[RopeKey, Turn] = {}


def rotations(
    needed: dict[tuple[RopeKey, int, int], tuple[nn.Module, RopeForm]],
) -> dict[tuple[RopeKey, int, int], Turn]:
    """``{(form key, offset, count): (cos, sin)}``, each ``(count, dims / 2)`` and
    C-contiguous, for ``needed`` ``{(key, offset, count): (rope, form)}``: the RoPE module
    applied to ones and zeros at ``count`` positions from ``offset``, as a forward pass of
    ``count`` tokens applies it. Slices of a table kept for the key, which grows (at least
    TABLE_STEP positions at a time) where a step needs more; made afresh for a module whose
    angles depend on the length (BY_LENGTH). All in one evaluation. (A decoding step of
    qwen2.5-0.5b spent 0.2-0.4 of its 12 ms making them each step.)"""
    fresh: dict[tuple[RopeKey, int, int], mx.array] = {}
    ends: dict[RopeKey, tuple[int, nn.Module, RopeForm]] = {}
    for (key, offset, count), (rope, form) in needed.items():
        if isinstance(rope, BY_LENGTH):
            fresh[key, offset, count] = _probe(rope, form, offset, count)
        elif offset + count > (ends[key][0] if key in ends else 0):
            ends[key] = (offset + count, rope, form)
    grown: dict[RopeKey, mx.array] = {}
    for key, (end, rope, form) in ends.items():
        have = len(_TABLES[key][0]) if key in _TABLES else 0
        if end > have:
            grown[key] = _probe(rope, form, have, max(end - have, TABLE_STEP, have))
    mx.eval([*fresh.values(), *grown.values()])
    for key, turned in grown.items():
        more, old = _pairs(turned, ends[key][2]), _TABLES.get(key)
        _TABLES[key] = (
            more
            if old is None
            else (
                np.concatenate([old[0], more[0]]),
                np.concatenate([old[1], more[1]]),
            )
        )
    tables = {at: _pairs(turned, needed[at][1]) for at, turned in fresh.items()}
    for key, offset, count in needed:
        if (key, offset, count) not in tables:
            cos, sin = _TABLES[key]
            tables[key, offset, count] = cos[offset : offset + count], sin[offset : offset + count]
    return tables


def _probe(rope: nn.Module, form: RopeForm, offset: int, count: int) -> mx.array:
    """``rope`` applied to ones and zeros at ``count`` positions from ``offset``: each
    pair's first feature 1, its second 0, so that the pair comes out as (cos, sin)."""
    probe = np.zeros((count, form.dims), dtype=np.float32)
    half = form.dims // 2
    probe[:, slice(0, None, 2) if form.traditional else slice(0, half)] = 1  # pairs' first
    out: mx.array = rope(mx.array(probe)[None, None], offset=offset)
    return out


def _pairs(turned: mx.array, form: RopeForm) -> Turn:
    """A probe's (cos, sin), each ``(positions, dims / 2)``, C-contiguous."""
    flat = np.asarray(turned)[0, 0]
    if form.traditional:
        return np.ascontiguousarray(flat[:, 0::2]), np.ascontiguousarray(flat[:, 1::2])
    half = form.dims // 2
    return np.ascontiguousarray(flat[:, :half]), np.ascontiguousarray(flat[:, half:])


def rotate(x: np.ndarray, form: RopeForm, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first ``form.dims`` features of each head of ``x`` (heads × head dim, or
    tokens × heads × head dim with ``cos``/``sin`` of shape tokens × 1 × dims / 2)."""
    out = x.copy()
    dims = form.dims
    if form.traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = a * cos - b * sin
        out[..., 1:dims:2] = a * sin + b * cos
    else:
        half = dims // 2
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half] = a * cos - b * sin
        out[..., half:dims] = a * sin + b * cos
    return out
