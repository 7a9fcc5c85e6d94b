"""Constrained decoding for ``response_format`` (JSON, or JSON of a schema), by llguidance.

:class:`JsonConstraint` is an mlx-lm logits processor: before each sampled token
it asks llguidance's matcher which tokens may come next and masks the others
to minus infinity, and it feeds the matcher each token that was sampled. Once
the JSON is complete only an end token is allowed, so the reply is the JSON
alone. The engine calls it once per sampled token, in order; each call after
the first sees the previous sample as its tokens' last
(:mod:`kvchat.engine.generation`).
"""

from __future__ import annotations

import json
from copy import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import llguidance
import mlx.core as mx
import numpy as np

from .errors import ApiError

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

_tokenizers: dict[tuple, Any] = {}  # (model fingerprint, end tokens) -> llguidance's tokenizer


# Where a schema is silent, constrained output still ends: an integer has at most 15 digits
# and a string at most STRING_MAX characters (a model that never closes one stops there).
INTEGER_BOUND = 10**15 - 1
STRING_MAX = 4096


def closed(schema: Any) -> Any:
    """``schema`` with what lets constrained output run on forever bounded, as OpenAI's
    strict mode has it: an object that lists its properties takes only those unless it
    says ``additionalProperties`` itself; an integer without bounds gets ±:data:`INTEGER_BOUND`,
    a string without ``maxLength`` :data:`STRING_MAX`. Sub-schemas alike; a new schema."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "properties" in out and "additionalProperties" not in out:  # {"type": "object"}: any
        out["additionalProperties"] = False
    if "integer" in kinds:
        out.setdefault("minimum", -INTEGER_BOUND)
        out.setdefault("maximum", INTEGER_BOUND)
    if "string" in kinds and "enum" not in out and "const" not in out:
        out.setdefault("maxLength", STRING_MAX)
    return out


def schema_grammar(schema: dict, param: str) -> str:
    """The llguidance grammar of JSON that validates against ``schema`` (:func:`closed`)."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(closed(schema)), defaults={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise ApiError(
            400, f"'{param}' is not a JSON schema llguidance takes: {exc}.", param=param
        ) from None
    return _checked(text, param)


def lark_grammar(lark: str, param: str) -> str:
    """An llguidance grammar from Lark text (JSON schemas inline as ``%json {...}``)."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param)


def _checked(text: str, param: str) -> str:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        said = "; ".join(m.rstrip(".") for m in messages)
        raise ApiError(
            400, f"'{param}' is not a JSON schema llguidance takes: {said}.", param=param
        )
    return text


@dataclass(frozen=True)
class Opened:
    """A grammar that holds a reply from the moment its text holds ``marker`` (a tool
    call's opening) on: ``grammar`` is what may follow the marker."""

    marker: str
    grammar: str


class JsonConstraint:
    """An mlx-lm logits processor that allows only tokens continuing ``grammar``, after
    ``said`` (text the reply holds already, which the grammar must start with)."""

    def __init__(self, lm: LoadedModel, grammar_text: str, said: str = ""):
        self._matcher = llguidance.LLMatcher(_tokenizer(lm), grammar_text, log_level=0)
        if said:
            self._matcher.consume_tokens(lm.tokenizer.encode(said, add_special_tokens=False))
        self._started = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:  # the previous call's sample is the tokens' last
            self._matcher.consume_token(cast(int, tokens[-1].item()))
        self._started = True
        if self._matcher.is_error():
            return logits  # the matcher gave up (it says why); the reply goes on free
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        vocab = logits.shape[-1]
        allowed = np.pad(allowed[:vocab], (0, max(0, vocab - allowed.size)))
        return mx.where(mx.array(allowed), logits, -mx.inf)


class OpenedConstraint:
    """An mlx-lm logits processor that leaves the reply free until its text holds the
    ``opened`` marker, then holds the rest to ``opened.grammar`` (llama.cpp's lazy
    grammars): a tool call the model opens on its own comes out valid."""

    def __init__(self, lm: LoadedModel, opened: Opened):
        self._lm, self._opened = lm, opened
        self._reply: list[int] = []  # the tokens sampled so far
        self._started = False
        self._held: JsonConstraint | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._held is None and self._started:  # the previous call's sample is the last
            self._reply.append(cast(int, tokens[-1].item()))
            said = self._after_marker()
            if said is not None:
                self._held = JsonConstraint(self._lm, self._opened.grammar, said)
        self._started = True
        return logits if self._held is None else self._held(tokens, logits)

    def _after_marker(self) -> str | None:
        """The text after the marker if the last token completed it, else None."""
        marker = self._opened.marker
        tail = self._lm.tokenizer.decode(self._reply[-len(marker) - 1 :])
        at = tail.find(marker)
        return None if at < 0 else tail[at + len(marker) :]


def constraint(lm: LoadedModel, grammar: str | Opened) -> JsonConstraint | OpenedConstraint:
    """The logits processor that holds a reply to ``grammar``."""
    if isinstance(grammar, Opened):
        return OpenedConstraint(lm, grammar)
    return JsonConstraint(lm, grammar)


def _tokenizer(lm: LoadedModel):
    """llguidance's view of ``lm``'s tokenizer, made once per model (it takes a while)."""
    key = (lm.fingerprint, tuple(sorted(lm.tokenizer.eos_token_ids)))
    found = _tokenizers.get(key)
    if found is None:
        backend = copy(lm.tokenizer.backend_tokenizer)  # Hugging Face's fast tokenizer
        backend.no_padding()
        backend.no_truncation()
        found = llguidance.LLTokenizer(
            backend.to_str(), eos_token=sorted(lm.tokenizer.eos_token_ids)
        )
        _tokenizers[key] = found
    return found
