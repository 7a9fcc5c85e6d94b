"""Cache-kind names: the families, the sizes each takes and the ones the picker offers,
and :func:`parse_kind`, which turns a name (``quantized:4``) into a :class:`CacheKind`.

A family is one object (:class:`Family`): the parser, its error messages, the kind
picker's list and the kinds a new model is probed for are all made from
:data:`FAMILIES`. Adding a kind touches ``FAMILIES``, :meth:`CacheKind.make_layer`
and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvchat.engine.caches import fit
from kvchat.engine.caches.rotated import RotatedKVCache
from kvchat.safety import ascii_int

QUANT_GROUP_SIZE = 64  # the group size quantized caches use unless the head size needs 32


class CacheKindError(ValueError):
    """A kind name that is not understood, or a kind that cannot apply to a model."""


@dataclass(frozen=True)
class Family:
    """A family of cache kinds: its name, the sizes it takes and the ones the kind picker
    offers. A family takes no size (``standard``), one of a few ``sizes`` (bits a value:
    ``quantized:8``), or any size from ``min_size`` up (tokens: ``rotating:4096``)."""

    name: str
    description: str
    sizes: tuple[int, ...] = ()
    min_size: int | None = None
    offered: tuple[int, ...] = ()  # the sizes the picker lists (and the fit probe tries)
    quantized: bool = False  # stores ``size`` bits a value plus a scale and bias per group

    @property
    def takes_size(self) -> bool:
        return bool(self.sizes) or self.min_size is not None

    def offered_names(self) -> list[str]:
        return [f"{self.name}:{n}" for n in self.offered] if self.takes_size else [self.name]

    def usage(self) -> str:
        """How a name of this family is written, e.g. ``quantized:8|4``, ``rotating:N``."""
        if self.sizes:
            return f"{self.name}:{'|'.join(map(str, self.sizes))}"
        return f"{self.name}:N" if self.takes_size else self.name

    def check_size(self, size: int) -> None:
        if self.sizes and size not in self.sizes:
            choices = " or ".join(map(str, self.sizes))
            names = " or ".join(f"{self.name}:{n}" for n in self.sizes)
            raise CacheKindError(f"{self.name.capitalize()} caches take {choices} bits: {names}.")
        if self.min_size is not None and size < self.min_size:
            raise CacheKindError(
                f"{self.name}:N needs N of at least {self.min_size} tokens (got {size})."
            )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("standard", "full precision, grows with the conversation (the default)"),
        Family(
            "quantized",
            "quantized:8 or quantized:4: 8 or 4 bits a value plus a scale and bias "
            "per group of 64 (32 where the head size needs it)",
            sizes=(8, 4),
            offered=(8, 4),
            quantized=True,
        ),
        Family(
            "rotated",
            "rotated:8 or rotated:4: quantized after a fixed randomized Hadamard "
            "rotation, which spreads outliers (less loss at 4 bits, same bytes)",
            sizes=(8, 4),
            offered=(8, 4),
            quantized=True,
        ),
        Family(
            "rotating",
            "rotating:N keeps the system prompt and the last tokens, N in all",
            min_size=64,
            offered=(4096,),
        ),
        Family(
            "chunked",
            "chunked:N keeps about the last N tokens between turns",
            min_size=64,
            offered=(2048,),
        ),
        Family("concatenate", "full precision, no preallocation"),
    )
}

OFFERED_KINDS: tuple[str, ...] = tuple(n for f in FAMILIES.values() for n in f.offered_names())
"""The kinds the picker lists and a new model is probed for, in the picker's order."""


@dataclass(frozen=True)
class CacheKind:
    """A parsed cache-kind name: ``family`` plus its number, if it takes one."""

    family: str
    size: int | None = None

    @property
    def name(self) -> str:
        return self.family if self.size is None else f"{self.family}:{self.size}"

    def __str__(self) -> str:
        return self.name

    @property
    def description(self) -> str:
        return FAMILIES[self.family].description

    @property
    def quantized(self) -> bool:
        """Stores ``size`` bits a value plus a scale and bias per group (quantized, rotated)."""
        return FAMILIES[self.family].quantized

    @property
    def needs(self) -> tuple[str, ...]:
        """What this kind needs of MLX's backend beyond plain attention
        (:func:`kvchat.engine.caches.fit.backend_problem` finds out whether it has it)."""
        return (fit.QUANTIZED_ATTENTION,) if self.quantized else ()

    def make_layer(self, keep: int = 0, group_size: int = QUANT_GROUP_SIZE) -> Any:
        """One layer's empty cache of this kind.

        ``keep`` is how many leading tokens a rotating cache never evicts
        (the system prompt); ``group_size`` is a quantized cache's group.
        """
        if self.family == "standard":
            return KVCache()
        if self.family == "concatenate":
            return ConcatenateKVCache()
        size = self.size  # every other family takes one
        if size is None:
            raise CacheKindError(
                f"Cache kind {self.name!r} needs a size, "
                f"e.g. {FAMILIES[self.family].offered_names()[0]}."
            )
        if self.family == "quantized":
            return QuantizedKVCache(group_size=group_size, bits=size)
        if self.family == "rotated":
            return RotatedKVCache(group_size=group_size, bits=size)
        if self.family == "rotating":
            return RotatingKVCache(max_size=size, keep=min(keep, size // 2))
        if self.family == "chunked":
            return ChunkedKVCache(chunk_size=size)
        raise AssertionError(self.family)


def parse_kind(name: str | CacheKind) -> CacheKind:
    """Parse a kind name such as ``quantized:4``; raise :class:`CacheKindError`."""
    if isinstance(name, CacheKind):
        return name
    text = (name or "").strip().lower()
    family_name, _, arg = text.partition(":")
    family = FAMILIES.get(family_name)
    if family is None:
        valid = ", ".join(f.usage() for f in FAMILIES.values())
        raise CacheKindError(f"Unknown cache kind {name!r}; use one of: {valid}.")
    if not family.takes_size:
        if arg:
            raise CacheKindError(f"Cache kind {family.name!r} takes no number (got {name!r}).")
        return CacheKind(family.name)
    try:
        size = ascii_int(arg)
    except ValueError:
        raise CacheKindError(
            f"Cache kind {family.name!r} needs a number written with 0-9, "
            f"e.g. {family.offered_names()[0]}."
        ) from None
    family.check_size(size)
    return CacheKind(family.name, size)
