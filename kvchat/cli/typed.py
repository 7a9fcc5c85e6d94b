"""kvchat's Typer apps: Typer's own, whose help prints flags and paragraphs as meant.

Typer 0.29's help prints each option's type after its name, on/off flags included
(``--json <bool>``, ``--help <bool>``), as if they took a value. The type column shows a
parameter's metavar when it has one, so the commands here give their flags an empty one.

Its Rich help also keeps a docstring's line breaks inside a paragraph, so a docstring
wrapped at the source's width printed as ragged lines at the terminal's ("history
sweep,⏎cache kinds"). The commands here take their help with each paragraph on one line,
for Rich to wrap.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption


def unwrapped(text: str | None) -> str | None:
    """``text`` (a command's help) with each paragraph's line breaks made spaces."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


class _Help:
    """A command whose help is unwrapped and whose flags (``--help`` among them) show no
    type in it."""

    def __init__(self, *args: Any, help: str | None = None, **options: Any) -> None:
        super().__init__(*args, help=unwrapped(help), **options)  # type: ignore[call-arg]

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""
        return params


class Command(_Help, TyperCommand):
    """A command whose help is unwrapped and whose flags show no type in it."""


class Group(_Help, TyperGroup):
    """A group of commands whose own help is unwrapped and whose flags show no type in it."""


class Typer(typer.Typer):
    """A Typer app whose group and commands print their help unwrapped and their flags
    without a type."""

    def __init__(self, **options: Any) -> None:
        super().__init__(cls=Group, **options)

    def command(self, *args: Any, **options: Any) -> Any:
        options.setdefault("cls", Command)
        return super().command(*args, **options)
