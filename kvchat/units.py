"""How kvchat writes sizes for people: one function, binary units (KiB, MiB, GiB) everywhere
(the sidebar, the session picker, dialogs, ``kvchat sessions list``), as mlx and the
memory figures count them. Imports no Textual."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``n`` bytes as ``512 B``, ``57.5 KiB``, ``1.2 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError
