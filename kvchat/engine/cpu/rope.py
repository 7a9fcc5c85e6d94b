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


def rotations(
    needed: dict[tuple[RopeKey, int, int], tuple[nn.Module, RopeForm]],
) -> dict[tuple[RopeKey, int, int], Turn]:
    """``{(form key, offset, count): (cos, sin)}``, each ``(count, dims / 2)``, for
    ``needed`` ``{(key, offset, count): (rope, form)}``: the RoPE module applied to ones
    and zeros at ``count`` positions from ``offset`` (as a forward pass of ``count``
    tokens applies it), all of them in one evaluation."""
    probes: dict[tuple[RopeKey, int, int], mx.array] = {}
    for (key, offset, count), (rope, form) in needed.items():
        probe = np.zeros((count, form.dims), dtype=np.float32)
        half = form.dims // 2
        probe[:, slice(0, None, 2) if form.traditional else slice(0, half)] = 1  # pairs' first
        probes[key, offset, count] = rope(mx.array(probe)[None, None], offset=offset)
    mx.eval(list(probes.values()))
    tables: dict[tuple[RopeKey, int, int], Turn] = {}
    for at, turned in probes.items():
        flat, form = np.asarray(turned)[0, 0], needed[at][1]
        if form.traditional:
            tables[at] = flat[:, 0::2].copy(), flat[:, 1::2].copy()
        else:
            tables[at] = flat[:, : form.dims // 2].copy(), flat[:, form.dims // 2 :].copy()
    return tables


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
