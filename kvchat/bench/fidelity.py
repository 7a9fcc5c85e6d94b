"""How much a lossy cache kind changes the model's predictions, llama.cpp-style.

A held-out text (the demo corpus's last section, which the demo model never
trained on) runs through the model once per cache kind, in chunks, so that every
chunk attends to the earlier ones through the cache as a conversation would. At
each position the next-token distribution is compared with the one the
``standard`` cache gives: the KL divergence KL(standard ‖ kind) (mean and 99th
percentile), how often the most likely token is the same (top-1 agreement), and
the perplexity of the text under each kind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvchat.engine.caches.families import FAMILIES
from kvchat.engine.caches.kinds import CacheKind, make_cache, parse_kind
from kvchat.engine.conversation.template import encode
from kvchat.engine.models.demo import corpus_parts
from kvchat.engine.models.model import LoadedModel

# standard and every quantized kind the kind picker offers (quantized:8 ... rotated:4)
DEFAULT_KINDS = (
    "standard",
    *(n for f in FAMILIES.values() if f.quantized for n in f.offered_names()),
)
CHUNK = 32  # tokens per forward pass: later chunks read the earlier ones from the cache


@dataclass(frozen=True)
class Fidelity:
    """One kind's figures against ``standard`` over ``tokens`` predicted positions."""

    kind: str
    tokens: int
    kld_mean: float
    kld_p99: float
    top1_agreement: float
    perplexity: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def heldout_text() -> str:
    return corpus_parts()[1]


def logprobs(lm: LoadedModel, tokens: list[int], kind: CacheKind, chunk: int = CHUNK) -> np.ndarray:
    """Log-probabilities of the next token at every position of ``tokens`` (float64, one
    row per position), computed through a fresh cache of ``kind`` ``chunk`` tokens at a time."""
    cache = make_cache(lm.model, kind)
    rows = []
    for start in range(0, len(tokens), chunk):
        logits = lm.model(mx.array(tokens[start : start + chunk])[None], cache=cache)[0]
        out = logits.astype(mx.float32) - mx.logsumexp(
            logits.astype(mx.float32), axis=-1, keepdims=True
        )
        rows.append(np.array(out, dtype=np.float64))
    return np.concatenate(rows)


def evaluate(
    lm: LoadedModel,
    kinds: list[str] | tuple[str, ...] = DEFAULT_KINDS,
    text: str | None = None,
    max_tokens: int = 1024,
) -> list[Fidelity]:
    """The figures of each kind (``standard`` first, its KLD zero) on ``text``.

    Raises :class:`~kvchat.engine.caches.kinds.CacheKindError` for a kind that does not apply.
    """
    parsed = [parse_kind(k) for k in kinds]
    tokens = encode(lm, text if text is not None else heldout_text())[: max_tokens + 1]
    if len(tokens) < 2:
        raise ValueError("The text is too short to predict anything.")
    reference = logprobs(lm, tokens[:-1], parse_kind("standard"))
    targets = np.array(tokens[1:])
    p = np.exp(reference)
    out = []
    for kind in [parse_kind("standard"), *(k for k in parsed if k.name != "standard")]:
        lp = reference if kind.name == "standard" else logprobs(lm, tokens[:-1], kind)
        kld = np.maximum((p * (reference - lp)).sum(axis=-1), 0.0)
        nll = -lp[np.arange(len(targets)), targets]
        out.append(
            Fidelity(
                kind=kind.name,
                tokens=len(targets),
                kld_mean=float(kld.mean()),
                kld_p99=float(np.percentile(kld, 99)),
                top1_agreement=float((lp.argmax(-1) == reference.argmax(-1)).mean()),
                perplexity=float(np.exp(nll.mean())),
            )
        )
    return out
