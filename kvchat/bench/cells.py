"""The bench's table cells: figures formatted for its Markdown and Rich tables, and the
shape of a table."""

from __future__ import annotations

from typing import Any

Table = tuple[str, list[str], list[list[str]], str | None]  # title, headers, rows, note


def figure(x: Any, digits: int = 3) -> str:
    """A measured figure: – for none, yes/no, thousands separated, 3 significant digits."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def times(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×" if x < 100 else f"{x:,.0f}×"


def megabytes(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f} MB"


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"
