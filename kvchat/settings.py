"""Every setting kvchat has, declared once: :data:`SETTINGS`.

Each :class:`Setting` says its name (the ``config.toml`` key and the Python
name), type, range and default, its environment variable (``KVCHAT_<NAME>``),
whether ``kvchat`` and ``kvchat ask`` take it as a flag (``--top-k``), the
label of its field in the tab's settings dialog (F9) and the field of
``POST /v1/chat/completions`` that sets it. The config file's checks, the
dialog's fields, the commands' options, the session file's schema
(``store/schema.py``) and the server's request fields (``serve/schema.py``)
are all made from this table.

Where a value comes from, strongest first::

    command-line flag  >  KVCHAT_<NAME> variable  >  config.toml  >  default

:func:`apply_overrides` is the one merge: later layers win, ``None`` means
"not given". The generation settings (sampling and reply length) are also saved
with each session; when a session is resumed only the flags given on the
command line win over its saved values (the file and the environment are the
defaults of new sessions).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.safety import ascii_int

if TYPE_CHECKING:  # the engine (and mlx with it) is imported when a value is checked:
    # kvchat's entry point chooses the BLAS before anything imports mlx.core
    from kvchat.engine.conversation.events import GenerationSettings

MAX_NUMBER = 1 << 60  # no count, size or time kvchat takes comes near this


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


def _not_empty(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string.")
    if not value.strip():
        raise ValueError("must not be empty.")
    return value


def _kind(value: Any) -> str:
    from kvchat.engine.caches.kinds import CacheKindError, parse_kind

    if not isinstance(value, str):
        raise ValueError('expected a cache kind such as "standard" or "quantized:8".')
    try:
        return parse_kind(value).name
    except CacheKindError as error:
        raise ValueError(str(error)) from None


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


def _keymap(value: Any) -> tuple[tuple[str, str], ...]:
    """The ``[keymap]`` table as (id, keys) pairs: every value a string of keys."""
    if not isinstance(value, dict):
        raise ValueError(
            'expected a table of binding ids and keys, such as [keymap] then send = "ctrl+s".'
        )
    return tuple(value.items())


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "model",
        str,
        "demo",
        "The model of new tabs: demo, a Hugging Face id or a folder.",
        convert=_not_empty,
    ),
    Setting(
        "cache",
        str,
        "standard",
        "Cache kind, e.g. standard, quantized:8, rotating:4096.",
        convert=_kind,
    ),
    Setting("system", str, "", "System prompt for new sessions."),
    Setting(
        "max_tokens",
        int,
        512,
        "Longest reply, in tokens.",
        low=1,
        generation=True,
        flag=True,
        label="Max tokens",
        api="max_tokens",
    ),
    Setting(
        "temp",
        float,
        0.0,
        "Sampling temperature (0 = greedy).",
        low=0,
        high=5,
        rule="expected a temperature between 0 and 5.",
        generation=True,
        flag=True,
        label="Temperature",
        api="temperature",
    ),
    Setting(
        "top_p",
        float,
        1.0,
        "Nucleus sampling: keep the likeliest tokens up to this probability (1 = off).",
        low=0,
        high=1,
        low_open=True,
        rule="must be more than 0 and at most 1 (1: off).",
        generation=True,
        flag=True,
        label="Top-p",
        api="top_p",
    ),
    Setting(
        "top_k",
        int,
        0,
        "Sample from the k likeliest tokens only (0 = off).",
        low=0,
        generation=True,
        flag=True,
        label="Top-k",
        api="top_k",
    ),
    Setting(
        "min_p",
        float,
        0.0,
        "Drop tokens less likely than this fraction of the likeliest (0 = off).",
        low=0,
        high=1,
        generation=True,
        flag=True,
        label="Min-p",
        api="min_p",
    ),
    Setting(
        "repetition_penalty",
        float,
        1.0,
        "Divide the scores of recently seen tokens by this (1 = off).",
        low=0,
        high=10,
        low_open=True,
        generation=True,
        flag=True,
        label="Repetition penalty",
        api="repetition_penalty",
    ),
    Setting(
        "repetition_context_size",
        int,
        20,
        "How many recent tokens the repetition, presence and frequency penalties look at.",
        low=1,
        high=1 << 20,
        generation=True,
        flag=True,
        label="Penalty context",
        api="repetition_context_size",
    ),
    Setting(
        "presence_penalty",
        float,
        0.0,
        "Subtract this from the score of each token seen recently (0 = off).",
        low=-2,
        high=2,
        generation=True,
        flag=True,
        label="Presence penalty",
        api="presence_penalty",
    ),
    Setting(
        "frequency_penalty",
        float,
        0.0,
        "Subtract this from a token's score for each time it was seen recently (0 = off).",
        low=-2,
        high=2,
        generation=True,
        flag=True,
        label="Frequency penalty",
        api="frequency_penalty",
    ),
    Setting(
        "seed",
        int,
        None,
        "Seed of the sampler: the same seed gives the same reply (empty = random).",
        low=-(1 << 63),
        high=(1 << 64) - 1,
        optional=True,
        generation=True,
        flag=True,
        label="Seed",
        api="seed",
    ),
    Setting("theme", str, "kvchat-dark", "The colour theme.", convert=_not_empty),
    Setting("autosave", bool, True, "Save every tab after each reply."),
    Setting(
        "ttl",
        int,
        1800,
        "Seconds an idle session stays in memory before it is offloaded to disk (0: forever).",
        low=0,
        rule="must not be negative.",
    ),
    Setting(
        "memory_budget",
        int,
        0,
        "Bytes of prompt caches (and loaded models' weights) kept "
        "in memory before the least recently used caches are offloaded (0: no limit); "
        'the file may say "4GiB", "512MB" or a number of bytes.',
        convert=parse_size,
    ),
    Setting(
        "keymap",
        dict,
        (),
        '[keymap] table: binding id = keys, e.g. send = "ctrl+s".',
        convert=_keymap,
    ),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
KEYS: tuple[str, ...] = tuple(BY_NAME)
GENERATION: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.generation)
FLAGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.flag)
DIALOG: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.label)
API: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.api)

T = TypeVar("T")


def check(name: str, value: Any, source: str) -> Any:
    """``value`` for setting ``name`` checked; ConfigError names ``source`` (an unknown name too)."""
    if name not in BY_NAME:
        raise ConfigError(f"{source}: unknown setting; known settings: {', '.join(KEYS)}.")
    return BY_NAME[name].check(value, source)


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings given as ``KVCHAT_<NAME>`` variables, checked (the keymap has none)."""
    return {
        s.name: s.parse_text(environ[s.env], s.env)
        for s in SETTINGS
        if s.type is not dict and s.env in environ
    }


def apply_overrides(base: T, *layers: Mapping[str, Any]) -> T:
    """A copy of ``base`` (a Config or GenerationSettings) with each layer's values, later
    layers winning; ``None`` (not given) and names ``base`` has no field for are skipped.
    Values of known settings are checked (ConfigError names the flag)."""
    names = {f.name for f in fields(base)}  # type: ignore[arg-type]
    merged: dict[str, Any] = {}
    for layer in layers:
        for name, value in layer.items():
            if value is not None and name in names:
                merged[name] = (
                    BY_NAME[name].check(value, BY_NAME[name].option) if name in BY_NAME else value
                )
    return replace(base, **merged)  # type: ignore[type-var]


def model_fields(settings: tuple[Setting, ...], *, api: bool = False) -> dict[str, Any]:
    """pydantic fields (``create_model``'s keyword arguments) for ``settings``: named by
    their API field when ``api`` (then optional, None meaning "not given"), with their
    types and ranges."""
    from pydantic import Field

    out: dict[str, Any] = {}
    for s in settings:
        bounds: dict[str, Any] = {"gt" if s.low_open else "ge": s.low} if s.low is not None else {}
        if s.high is not None:
            bounds["le"] = s.high
        elif s.type is int:
            bounds["lt"] = 1 << 53
        optional = api or s.optional
        kind = (s.type | None) if optional else s.type
        out[s.api if api else s.name] = (kind, Field(None if api else s.default, **bounds))
    return out


def generation_of(config: Any, **extra: Any) -> GenerationSettings:
    """The generation settings of a :class:`~kvchat.config.Config` (new sessions start so)."""
    from kvchat.engine.conversation.events import GenerationSettings

    return GenerationSettings(**{s.name: getattr(config, s.name) for s in GENERATION}, **extra)


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
