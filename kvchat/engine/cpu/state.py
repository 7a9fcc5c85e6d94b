"""Whether the CPU fast path is on: one switch, read by every hooked function."""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "KVCHAT_CPU_FASTPATH"  # "0" turns the fast path off

_on = False


def wanted() -> bool:
    """The fast path applies: MLX runs on the CPU and ``KVCHAT_CPU_FASTPATH`` is not 0."""
    return os.environ.get(ENV, "1") != "0" and mx.default_device() == mx.cpu


def set_active(on: bool) -> None:
    global _on
    _on = bool(on)


def active() -> bool:
    return _on
