"""kvchat's Typer apps: Typer's own, whose help prints on/off flags without a type.

Typer 0.29's help prints each option's type after its name, on/off flags included
(``--json <bool>``, ``--help <bool>``), as if they took a value. The type column shows a
parameter's metavar when it has one, so the commands here give their flags an empty one.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption


class _UntypedFlags:
    """A command whose flags (``--help`` among them) show no type in its help."""

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""
        return params


class Command(_UntypedFlags, TyperCommand):
    """A command whose flags show no type in its help."""


class Group(_UntypedFlags, TyperGroup):
    """A group of commands whose own flags show no type in its help."""


class Typer(typer.Typer):
    """A Typer app whose group and commands print their flags without a type."""

    def __init__(self, **options: Any) -> None:
        super().__init__(cls=Group, **options)

    def command(self, *args: Any, **options: Any) -> Any:
        options.setdefault("cls", Command)
        return super().command(*args, **options)
