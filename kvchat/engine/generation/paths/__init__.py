"""The decoding paths: how a generation core runs the forward passes of the sequences
decoding on it, one object a core (:class:`~.base.Path`, chosen by :func:`choose`):

- :class:`~.batched.Batched`: MLX's own path, rows merged into mlx-lm's batch caches
  where they can, the others apart; each step fed ahead;
- :class:`~.numpy_rows.NumpyRows`: the CPU fast path, every row on its own cache, all of
  them in one numpy step, short prompts folded into it;
- :class:`~.sharded.Sharded`: a sharded model, one forward pass a row, the same
  operations on every rank.
"""

from __future__ import annotations

from typing import Any

from kvchat.engine.cpu import native
from kvchat.engine.generation.batch import merges
from kvchat.engine.generation.paths.base import Path
from kvchat.engine.generation.paths.batched import Batched
from kvchat.engine.generation.paths.numpy_rows import NumpyRows
from kvchat.engine.generation.paths.sharded import Sharded

__all__ = ["Path", "Batched", "NumpyRows", "Sharded", "choose", "decoding_path"]


def choose(threaded: bool, fast_path: Any) -> type[Path]:
    """The path of a core: :class:`Sharded` for a sharded model's (not ``threaded``: it
    runs on the caller's thread), :class:`NumpyRows` where the model's CPU fast path
    (``fast_path``) decodes in numpy now, else :class:`Batched`."""
    if not threaded:
        return Sharded
    if fast_path is not None and fast_path.decodes:
        return NumpyRows
    return Batched


def decoding_path(lm: Any) -> str:
    """One line: how loaded model ``lm``'s core decodes a batch of sequences, and why."""
    fast = getattr(lm, "fast_path", None)
    path = choose(getattr(lm, "group", None) is None, fast)
    if path is Sharded:
        return "one sequence at a time (a sharded model: every rank runs the same steps)"
    if path is NumpyRows:
        return (
            "CPU fast path: its batched numpy step decodes every row at once, each on its "
            f"own cache (the model's decoding step runs whole in numpy; {native.route()})"
        )
    if fast is None:
        why = f"CPU fast path {getattr(lm, 'fast_path_off', 'off')}"
    elif not fast.on:
        why = "CPU fast path switched off for this model"
    else:
        why = f"no numpy decoding step: {fast.step}"
    if merges(lm.model):
        return f"MLX: rows merged into mlx-lm's batch caches, one forward pass a step ({why})"
    return (
        "MLX, one forward pass a row: this model does not decode a merged batch as it "
        f"decodes each row alone ({why})"
    )
