"""mlx's ``tree_flatten`` as kvchat calls it, with the type it has there.

``mlx.utils.tree_flatten`` returns a list of ``(path, leaf)`` pairs, or a dict when a
dict is passed as its ``destination``; its annotation is the union of both, so every
caller would have to narrow it. kvchat never passes a destination.
"""

from __future__ import annotations

from typing import Any, cast

from mlx.utils import tree_flatten


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """The ``(path, leaf)`` pairs of an mlx tree (a model's parameters, a cache's state)."""
    return cast(list[tuple[str, Any]], tree_flatten(tree))
