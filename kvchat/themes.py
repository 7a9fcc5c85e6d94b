"""Themes: TOML files turned into Textual ``Theme`` objects.

kvchat ships a few in ``builtin_themes_dir()`` (dark, light, high contrast);
users add more as ``*.toml`` files in ``user_themes_dir()``. A file holds the
fields of :class:`textual.theme.Theme` (``name``, ``primary``, ``background``,
``dark``...) and an optional ``[variables]`` table. A user theme with the name
of a shipped one replaces it.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import Theme

_COLOURS = (
    "primary",
    "secondary",
    "warning",
    "error",
    "success",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
_FIELDS = {f.name for f in fields(Theme)}


class ThemeError(ValueError):
    """A theme file that cannot be used; the message names the file."""


def load_theme(path: Path) -> Theme:
    """One theme from a TOML file."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ThemeError(f"{path.name}: cannot be read ({error}).") from None
    except tomllib.TOMLDecodeError as error:
        raise ThemeError(f"{path.name}: not valid TOML ({error}).") from None
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ThemeError(f"{path.name}: unknown key {unknown[0]!r}.")
    name = data.setdefault("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise ThemeError(f"{path.name}: name must be a non-empty string.")
    if "primary" not in data:
        raise ThemeError(f"{path.name}: primary colour is missing.")
    for key in _COLOURS:
        if key in data:
            try:
                Color.parse(data[key])
            except (ColorParseError, TypeError, ValueError):
                raise ThemeError(f"{path.name}: {key} = {data[key]!r} is not a colour.") from None
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeError(f"{path.name}: [variables] must map names to strings.")
    if not isinstance(data.get("dark", True), bool):
        raise ThemeError(f"{path.name}: dark must be true or false.")
    try:
        return Theme(**data)
    except TypeError as error:
        raise ThemeError(f"{path.name}: {error}.") from None


def load_themes(*directories: Path) -> tuple[list[Theme], list[str]]:
    """Every ``*.toml`` theme in ``directories``, in order (later ones replace earlier
    ones of the same name), and one message per file that could not be used."""
    themes: dict[str, Theme] = {}
    problems: list[str] = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.toml")):
            try:
                theme = load_theme(path)
            except ThemeError as error:
                problems.append(str(error))
                continue
            themes[theme.name] = theme
    return list(themes.values()), problems


def kvchat_themes() -> tuple[list[Theme], list[str]]:
    """The shipped themes plus the user's."""
    from kvchat.locations import builtin_themes_dir, user_themes_dir

    return load_themes(builtin_themes_dir(), user_themes_dir())
