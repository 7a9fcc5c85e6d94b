"""The keymap: every key binding has an id, and ``[keymap]`` in ``config.toml`` gives an id
other keys (``send = "ctrl+s,enter"``).

The keymap is applied through Textual's own keymap (:meth:`App.set_keymap`), so the
footer shows the new keys; the help screen and the command palette read them through
:func:`keys_of`. An entry with an unknown id or a key Textual does not know is left
out, with a one-line notice, and the binding keeps its default keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from textual.binding import Binding
from textual.keys import Keys, format_key

MODIFIERS = frozenset({"ctrl", "alt", "shift", "meta", "super", "hyper"})
_NAMED = frozenset(k.value for k in Keys if "+" not in k.value and not k.value.startswith("<"))
MAX_KEY_CHARS = 200


def valid_key(key: str) -> bool:
    """Whether Textual can report ``key`` (``ctrl+s``, ``f5``, ``slash``, ``?``)."""
    *modifiers, base = key.split("+")
    if (
        not base
        or any(m not in MODIFIERS for m in modifiers)
        or len(set(modifiers)) < len(modifiers)
    ):
        return False
    if base in _NAMED or (len(base) == 1 and base.isprintable() and not base.isspace()):
        return True
    shown = format_key(base)  # a character's name, e.g. "slash" or "question_mark"
    return len(shown) == 1 and shown != base


def split_keys(keys: str) -> list[str]:
    return [key.strip() for key in keys.split(",")]


def normal_keys(keys: str) -> str:
    """``keys`` in Textual's normal form (``?`` as ``question_mark``), as Textual's
    bindings spell them (through the public ``Binding.make_bindings``)."""
    return ",".join(b.key for b in Binding.make_bindings([Binding(keys, "noop")]))


def keys_of(binding: Binding, keymap: Mapping[str, str]) -> list[str]:
    """The keys that trigger ``binding`` under ``keymap``."""
    return split_keys(keymap.get(binding.id or "", binding.key))


def check_keymap(
    entries: Iterable[tuple[str, str]], ids: Iterable[str]
) -> tuple[dict[str, str], list[str]]:
    """The usable entries (keys in Textual's normal form), and a phrase for each one
    left out: an unknown id, or keys that are not all valid."""
    known = set(ids)
    usable: dict[str, str] = {}
    problems: list[str] = []
    for binding_id, keys in entries:
        if binding_id not in known:
            problems.append(f"unknown id {_short(binding_id)}")
        elif len(keys) > MAX_KEY_CHARS or not all(valid_key(k) for k in split_keys(keys)):
            problems.append(f"{binding_id} = {_short(keys)} is not a key Textual knows")
        else:
            usable[binding_id] = normal_keys(keys)
    return usable, problems


def clashes(
    groups: Iterable[tuple[str, Iterable[Binding]]], keymap: Mapping[str, str]
) -> list[str]:
    """A phrase for each key ``keymap`` gives a binding that another binding of the same
    place keeps by default (Textual then drops that one's key; it does not say so)."""
    places: dict[str, list[Binding]] = {}
    for where, bindings in groups:
        places.setdefault(where, []).extend(bindings)
    found = []
    for bindings in places.values():
        kept = {key: b for b in bindings if b.id not in keymap for key in split_keys(b.key)}
        for binding in bindings:
            if binding.id is not None and binding.id in keymap:
                for key in split_keys(keymap[binding.id]):
                    if key in kept:
                        found.append(f"{key} was {kept[key].id}'s key; it now does {binding.id}")
    return found


def notice(problems: list[str], shown: int = 3) -> str:
    """One line for the problems ``check_keymap`` found."""
    more = len(problems) - shown
    text = "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")
    return f"Keymap entries left out (default keys kept): {text}."


def _short(text: str) -> str:
    shown = ascii(text)  # a file's text: no markup, no control characters
    return shown if len(shown) <= 40 else shown[:36] + "...'"


def keymap_table(groups: Iterable[tuple[str, Iterable[Binding]]]) -> str:
    """The Markdown table of every id, where it works, its default keys and what it does
    (docs/configuration.md's copy is checked against this)."""
    lines = ["| id | where | default keys | action |", "|---|---|---|---|"]
    for where, bindings in groups:
        for binding in bindings:
            keys = ", ".join(f"`{key}`" for key in split_keys(binding.key))
            lines.append(f"| `{binding.id}` | {where} | {keys} | {binding.description} |")
    return "\n".join(lines) + "\n"
