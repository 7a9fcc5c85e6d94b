"""One setting, :class:`Setting`: its declaration (type, range, default, and where it
can be given) and the checks a value for it passes, with the value forms they share
(sizes such as ``4GiB``, TOML literals for messages).

The table of every setting kvchat has is :data:`kvchat.settings.SETTINGS`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvchat.safety import ascii_int

MAX_NUMBER = 1 << 60  # no count, size or time kvchat takes comes near this


class EntryError(ValueError):
    """An entry of a table setting (``[keymap]``) that cannot be used: ``key`` and ``value``
    name it, and the message says why; the setting's check names ``source.key = value``."""

    def __init__(self, key: Any, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.key, self.value = key, value


class ConfigError(ValueError):
    """A setting that cannot be used; the message names where it came from and the key.
    ``reason`` is the message's last part alone (why the value cannot be used), or ""."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Setting:
    """One setting: what it is, its range, and every place it can be given."""

    name: str
    type: type  # str, int, float or bool
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the value must be more than ``low``
    rule: str = ""  # the sentence for a value out of range (made from the bounds if "")
    optional: bool = False  # None is allowed (and the default): "not set"
    convert: Callable[[Any], Any] | None = None  # normalises, or raises ValueError
    generation: bool = False  # a field of GenerationSettings: per tab, saved with a session
    flag: bool = False  # ``--name`` on ``kvchat`` and ``kvchat ask``
    label: str = ""  # its field in the tab's settings dialog ("" for none)
    api: str = ""  # its field in a chat completion request ("" for none)

    @property
    def env(self) -> str:
        return "KVCHAT_" + self.name.upper()

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def out_of_range(self) -> str:
        if self.rule:
            return self.rule
        more = "more than" if self.low_open else "at least"
        low = None if self.low is None else f"{more} {_number(self.low)}"
        high = None if self.high is None else f"at most {_number(self.high)}"
        return "must be " + " and ".join(part for part in (low, high) if part) + "."

    def check(self, value: Any, source: str) -> Any:
        """``value`` checked and normalised; :class:`ConfigError` says ``source = value: why``."""
        try:
            return self._check(value)
        except EntryError as error:
            entry = f"{toml_string(str(error.key))[:40]} = {literal(error.value)[:40]}"
            raise ConfigError(f"{source}.{entry}: {error}", str(error)) from None
        except ValueError as error:
            shown = literal(value)
            shown = shown if len(shown) <= 40 else shown[:36] + "..."
            raise ConfigError(f"{source} = {shown}: {error}", str(error)) from None

    def _check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.convert is not None:
            return self.convert(value)
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError("expected true or false.")
            return value
        if self.type is str:
            if not isinstance(value, str):
                raise ValueError("expected a string.")
            return value
        if isinstance(value, bool) or not isinstance(
            value, (int, float) if self.type is float else int
        ):
            raise ValueError(
                "expected a number." if self.type is float else "expected a whole number."
            )
        if not math.isfinite(value) or self._outside(value):
            raise ValueError(self.out_of_range())
        if self.type is float:
            return float(value)
        return value if self.high is not None else _bounded(int(value))

    def _outside(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return True
        return self.high is not None and value > self.high

    def parse_text(self, text: str, source: str) -> Any:
        """The value of ``text`` (a variable, a dialog field), checked; ConfigError if not."""
        stripped = text.strip()
        if self.optional and not stripped:
            return None
        what = {bool: "true or false", int: "a whole number", float: "a number"}.get(self.type)
        if what and not stripped:
            raise ConfigError(f"{source} is empty: give {what}.")
        value: Any = text
        try:
            if self.type is bool and self.convert is None:
                value = {
                    "1": True,
                    "true": True,
                    "yes": True,
                    "0": False,
                    "false": False,
                    "no": False,
                }[stripped.lower()]
            elif self.type is int and self.convert is None:
                value = int(stripped)
            elif self.type is float:
                value = float(stripped)
        except (KeyError, ValueError):
            raise ConfigError(f"{source} must be {what}, not {stripped[:40]!r}.") from None
        return self.check(value, source)


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _bounded(value: int) -> int:
    if value > MAX_NUMBER:
        raise ValueError("is too large.")
    return value


_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*((?:[kmgt]i?)?b?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_size(value: int | str) -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1.5G`` or a plain integer."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4GiB or a number of bytes.")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative.")
        return _bounded(value)
    match = _SIZE.fullmatch(str(value))
    if not match:
        raise ValueError("expected a size such as 4GiB, 512MB or a number of bytes.")
    whole, fraction, unit = match.group(1), match.group(2) or "0", match.group(3).lower()
    scale = _UNITS[unit[:1]]
    if "i" in unit:
        scale = 1024 ** ("kmgt".index(unit[0]) + 1)
    try:
        number = ascii_int(whole) + ascii_int(fraction[:9]) / 10 ** len(fraction[:9])
    except ValueError:
        raise ValueError("is larger than any memory.") from None
    return _bounded(int(number * scale))


def literal(value: Any) -> str:
    """``value`` as a TOML literal (for messages)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return toml_string(value if isinstance(value, str) else repr(value))


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, control characters escaped."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
