"""The settings file, ``config_file()``: read, checked, and edited in place.

What each key means, its range and default are declared once in
:mod:`kvchat.settings` (which also says the precedence: flag > ``KVCHAT_<NAME>``
> file > default). The file is read with :mod:`tomllib`; a bad value raises
:class:`ConfigError` whose message names the file and the key, e.g.
``config.toml: cache = "foo": Unknown cache kind 'foo'; ...``.

kvchat never regenerates the file: :func:`remember` (the theme picked in the
palette) edits the one key with tomlkit, keeping the user's comments, order,
quoting and the keys kvchat does not know, and writes no default the user did not
set. A file that does not parse is left byte for byte as it is.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomlkit
from tomlkit.exceptions import ParseError
from tomlkit.items import String, StringType

from kvchat.atomic import write_atomic
from kvchat.declaration import ConfigError, parse_size
from kvchat.safety import read_limited
from kvchat.settings import SETTINGS, apply_overrides, check, from_env

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_config",
    "parse_size",
    "remember",
    "tomllib",
]

MAX_FILE_BYTES = 1 << 20  # a settings file is a few hundred bytes


def _override(self: Config, **values: Any) -> Config:
    """A copy with the given values set, skipping ``None`` (flags the user did not pass)."""
    return apply_overrides(self, values)


class Fields:
    """The settings' names and types as Config holds them, so that a type checker sees a
    misspelled one (``config.xtc_probabilty``); tests/test_config.py checks them against
    :data:`~kvchat.settings.SETTINGS`, where each is declared."""

    model: str
    cache: str
    system: str
    max_tokens: int
    temp: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context_size: int
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    theme: str
    autosave: bool
    ttl: int
    memory_budget: int
    keymap: tuple[tuple[str, str], ...]  # the [keymap] table's (binding id, keys) pairs


if TYPE_CHECKING:  # a dataclass made at run time from SETTINGS: what a type checker can see

    class Config(Fields):
        """Everything kvchat can be told before it starts (see kvchat.settings)."""

        def __init__(self, **values: Any) -> None: ...
        def override(self, **values: Any) -> Config: ...

else:
    Config = make_dataclass(
        "Config",
        [(s.name, Fields.__annotations__[s.name], field(default=s.default)) for s in SETTINGS],
        frozen=True,
        namespace={
            "override": _override,
            "__doc__": "Everything kvchat can be told before it starts (see kvchat.settings).",
        },
    )


def _config_path(path: Path | None) -> Path:
    if path is not None:
        return path
    from kvchat.locations import config_file

    return config_file()


def _read_text(path: Path) -> str | None:
    """The file's text; None where there is none."""
    try:
        raw = read_limited(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror}).") from None
    except ValueError as error:
        raise ConfigError(f"{path}: cannot be used as a settings file: {error}.") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not valid UTF-8 (byte {raw[error.start]:#04x} at offset {error.start})."
        ) from None


def load_config(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """The defaults, then ``path`` (default ``config_file()``; a missing file is fine), then
    the ``KVCHAT_<NAME>`` variables of ``environ`` (default ``os.environ``)."""
    path = _config_path(path)
    text = _read_text(path)
    config = Config() if text is None else parse_config(text, name=path.name)
    return apply_overrides(config, from_env(os.environ if environ is None else environ))


def parse_config(text: str, name: str = "config.toml") -> Config:
    """A :class:`Config` from TOML text; ``name`` prefixes error messages."""
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as error:  # TOMLDecodeError, a 5,000-digit number, [[[[...
        reason = str(error).splitlines()[0] if str(error) else "nested too deeply"
        raise ConfigError(f"{name}: not valid TOML ({reason}).") from None
    values = {key: check(key, value, source=f"{name}: {key}") for key, value in data.items()}
    return Config(**values)


def remember(path: Path | None = None, **values: Any) -> None:
    """Set top-level ``values`` in the file, touching only their lines: comments, order,
    quoting and unknown keys stay as they are. A file that does not parse is not written:
    :class:`ConfigError` says where its error is."""
    path = _config_path(path)
    checked = {
        key: check(key, value, source=f"{path.name}: {key}") for key, value in values.items()
    }
    text = _read_text(path) or ""
    try:
        document = tomlkit.parse(text)
    except ParseError as error:
        # tomlkit names the end of the text as the character '\x00'
        reason = str(error).split(" at line ")[0].replace("character: '\\x00'", "end of file")
        raise ConfigError(
            f"{path.name} has an error at line {error.line} ({reason}); your change applies "
            "to this run only and the file was left alone."
        ) from None
    for key, value in checked.items():
        old = document.get(key)
        literal_quotes = (
            isinstance(old, String)
            and old.type is StringType.SLL
            and isinstance(value, str)
            and "'" not in value
            and value.isprintable()
        )
        document[key] = tomlkit.string(value, literal=True) if literal_quotes else value
    target = path.resolve()  # a config kept elsewhere (dotfiles) and linked here stays linked
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, tomlkit.dumps(document).encode("utf-8"))
