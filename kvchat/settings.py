"""Every setting kvchat has, declared once: :data:`SETTINGS`.

Each :class:`~kvchat.declaration.Setting` says its name (the ``config.toml`` key and the Python
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

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.declaration import ConfigError, EntryError, Setting, parse_size

if TYPE_CHECKING:  # the engine (and mlx with it) is imported when a value is checked:
    # kvchat's entry point chooses the BLAS before anything imports mlx.core
    from kvchat.engine.conversation.events import GenerationSettings


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


def _keymap(value: Any) -> tuple[tuple[str, str], ...]:
    """The ``[keymap]`` table as (id, keys) pairs: every value a string of keys."""
    if not isinstance(value, dict):
        raise ValueError(
            'expected a table of binding ids and keys, such as [keymap] then send = "ctrl+s".'
        )
    for binding_id, keys in value.items():
        if not isinstance(keys, str) or not keys.strip():
            raise EntryError(
                binding_id, keys, 'expected keys as a string, such as "ctrl+s" or "f5,ctrl+r".'
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
