"""Settings: defaults, the TOML file in ``config_file()``, and command-line overrides.

The file is read with :mod:`tomllib` and written by :func:`dumps`, a tiny
writer for the flat key/value table kvchat needs (no extra dependency). A
bad value raises :class:`ConfigError` whose message names the file and the
key, e.g. ``config.toml: cache = "foo": Unknown cache kind 'foo'; ...``.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvchat.engine.kinds import CacheKindError, parse_kind
from kvchat.safety import ascii_int, read_limited

DEFAULT_MODEL = "demo"
DEFAULT_THEME = "kvchat-dark"
MAX_FILE_BYTES = 1 << 20  # a settings file is a few hundred bytes
MAX_NUMBER = 1 << 60  # no count, size or time kvchat takes comes near this


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Config:
    """Everything kvchat can be told before it starts."""

    model: str = DEFAULT_MODEL
    cache: str = "standard"
    system: str = ""
    max_tokens: int = 512
    temp: float = 0.0
    theme: str = DEFAULT_THEME
    autosave: bool = True
    ttl: int = 1800
    """Seconds an idle session stays in memory before it is offloaded to disk (0: forever)."""
    memory_budget: int = 0
    """Bytes of prompt caches (and loaded models' weights) kept in memory before the least
    recently used caches are offloaded (0: no limit). The file may say ``"4GiB"``, ``"512MB"`` or a plain number of bytes."""
    keymap: tuple[tuple[str, str], ...] = ()
    """(binding id, keys) pairs from the ``[keymap]`` table, e.g. ``("send", "ctrl+s")``;
    the TUI checks the ids and keys (see ``kvchat/tui/keymap.py``)."""

    def override(self, **values: Any) -> Config:
        """A copy with the given values set, skipping ``None`` (flags the user did not pass)."""
        given = {k: v for k, v in values.items() if v is not None}
        checked = {k: _check(k, v, source="--" + k.replace("_", "-")) for k, v in given.items()}
        return replace(self, **checked)


KEYS: tuple[str, ...] = tuple(f.name for f in fields(Config))

_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*((?:[kmgt]i?)?b?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_size(value: int | str) -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1.5G`` or a plain integer."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4GiB or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return _bounded(value)
    match = _SIZE.fullmatch(str(value))
    if not match:
        raise ValueError("expected a size such as 4GiB, 512MB or a number of bytes")
    whole, fraction, unit = match.group(1), match.group(2) or "0", match.group(3).lower()
    scale = _UNITS[unit[:1]]
    if "i" in unit:
        scale = 1024 ** ("kmgt".index(unit[0]) + 1)
    try:
        number = ascii_int(whole) + ascii_int(fraction[:9]) / 10 ** len(fraction[:9])
    except ValueError:
        raise ValueError("is larger than any memory") from None
    return _bounded(int(number * scale))


def _bounded(value: int) -> int:
    if value > MAX_NUMBER:
        raise ValueError("is too large")
    return value


def _check(key: str, value: Any, source: str) -> Any:
    """Validate one setting; raise ConfigError naming ``source`` and the value."""

    def fail(reason: str) -> ConfigError:
        shown = _literal(value)
        shown = shown if len(shown) <= 40 else shown[:36] + "..."
        return ConfigError(f"{source} = {shown}: {reason}")

    if key not in KEYS:
        raise ConfigError(f"{source}: unknown setting; known settings: {', '.join(KEYS)}.")
    if key in ("model", "system", "theme"):
        if not isinstance(value, str):
            raise fail("expected a string.")
        if key in ("model", "theme") and not value.strip():
            raise fail("must not be empty.")
        return value
    if key == "cache":
        if not isinstance(value, str):
            raise fail("expected a cache kind such as \"standard\" or \"quantized:8\".")
        try:
            return parse_kind(value).name
        except CacheKindError as error:
            raise fail(str(error)) from None
    if key in ("max_tokens", "ttl"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("expected a whole number.")
        if value < (1 if key == "max_tokens" else 0):
            raise fail("must be at least 1." if key == "max_tokens" else "must not be negative.")
        try:
            return _bounded(value)
        except ValueError as error:
            raise fail(f"{error}.") from None
    if key == "temp":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("expected a number.")
        if not math.isfinite(value) or not 0 <= value <= 5:
            raise fail("expected a temperature between 0 and 5.")
        return float(value)
    if key == "autosave":
        if not isinstance(value, bool):
            raise fail("expected true or false.")
        return value
    if key == "memory_budget":
        try:
            return parse_size(value)
        except ValueError as error:
            raise fail(f"{error}.") from None
    if key == "keymap":
        return _check_keymap(value, source)
    raise AssertionError(key)


def _check_keymap(value: Any, source: str) -> tuple[tuple[str, str], ...]:
    """The ``[keymap]`` table as (id, keys) pairs: every value a string of keys."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: expected a table of binding ids and keys, "
                          'such as [keymap] then send = "ctrl+s".')
    pairs = []
    for binding_id, keys in value.items():
        if not isinstance(keys, str) or not keys.strip():
            raise ConfigError(f"{source}.{_string(binding_id)[:40]} = {_literal(keys)[:40]}: expected "
                              'keys as a string, such as "ctrl+s" or "f5,ctrl+r".')
        pairs.append((binding_id, keys))
    return tuple(pairs)


def load_config(path: Path | None = None) -> Config:
    """Read ``path`` (default ``config_file()``); a missing file gives the defaults."""
    if path is None:
        from kvchat.locations import config_file

        path = config_file()
    try:
        raw = read_limited(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return Config()
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror}).") from None
    except ValueError as error:
        raise ConfigError(f"{path}: cannot be used as a settings file: {error}.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not valid UTF-8 (byte {raw[error.start]:#04x} at offset {error.start})."
        ) from None
    return parse_config(text, name=path.name)


def parse_config(text: str, name: str = "config.toml") -> Config:
    """A :class:`Config` from TOML text; ``name`` prefixes error messages."""
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as error:  # TOMLDecodeError, a 5,000-digit number, [[[[...
        reason = str(error).splitlines()[0] if str(error) else "nested too deeply"
        raise ConfigError(f"{name}: not valid TOML ({reason}).") from None
    values = {key: _check(key, value, source=f"{name}: {key}") for key, value in data.items()}
    return replace(Config(), **values)


def save_config(config: Config, path: Path | None = None) -> Path:
    """Write ``config`` atomically (temporary file, fsync, rename)."""
    if path is None:
        from kvchat.locations import config_file

        path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".toml")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(dumps(config))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def remember(path: Path | None = None, **values: Any) -> Config:
    """Change some settings in the file, keeping the others as they are there.

    A file that does not parse is replaced by the defaults plus ``values``.
    """
    try:
        current = load_config(path)
    except ConfigError:
        current = Config()
    updated = current.override(**values)
    save_config(updated, path)
    return updated


def dumps(config: Config) -> str:
    """TOML text for ``config``: one ``key = value`` line per setting."""
    lines = ["# kvchat settings; command-line flags override these.\n"]
    for key in KEYS:
        if key != "keymap":
            lines.append(f"{key} = {_literal(getattr(config, key))}\n")
    if config.keymap:  # a table comes after the plain keys
        lines.append("\n[keymap]\n")
        lines.extend(f"{_string(i)} = {_string(keys)}\n" for i, keys in config.keymap)
    return "".join(lines)


def _literal(value: Any) -> str:
    """A TOML literal for a string, bool, int or float."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    return _string(repr(value))


def _string(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
