"""Shared pieces of the bench: the plan, the machine header, texts, turns, the profile."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import kvchat
from kvchat import blas

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel

DEFAULT_MODEL = "demo:qwen2.5-0.5b"
# kvchat's command in a fresh interpreter (the bench's servers, ranks and start-up runs)
KVCHAT = [sys.executable, "-c", "from kvchat.cli import main; main()"]
CORPUS = Path(__file__).parent.parent / "engine" / "models" / "demo_corpus.txt"
WINDOW = 1024  # the windowed kinds' size: half the kinds' history, so the window is passed

READ_PROMPT = "Please read the following article carefully. I will ask you about it next.\n\n"
SUMMARY_PROMPT = "Summarize the article"
FOLLOW_UP = (
    "Thanks. Looking back over everything above, which three details matter most, "
    "and why would the keeper bother to write them down?"
)

Log = Callable[[str], None]


def bench_kinds(quick: bool) -> list[str]:
    """The cache kinds the bench measures, from the families (as the kind picker's): every
    kind offered, those sized in tokens (rotating, chunked) at :data:`WINDOW` tokens
    instead. The quick run keeps ``standard`` and each quantized family at its fewest bits
    (``quantized:4``, ``rotated:4``): the kinds its targets read."""
    from kvchat.engine.caches.families import FAMILIES

    if quick:
        return ["standard", *(f"{f.name}:{min(f.sizes)}" for f in FAMILIES.values() if f.quantized)]
    return [
        name
        for f in FAMILIES.values()
        for name in ([f"{f.name}:{WINDOW}"] if f.min_size is not None else f.offered_names())
    ]


def bench_plan(quick: bool) -> dict[str, Any]:
    """Sizes of every experiment; ``quick`` keeps the whole run small."""
    return {
        "article_tokens": 2000 if quick else 4500,
        "classic_max_tokens": 16 if quick else 24,
        "sweep": [512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192],
        "follow_max_tokens": 8 if quick else 6,
        "cached_repeats": 3,
        "kinds_history": 2048,
        "kinds": bench_kinds(quick),
        "agree_tokens": 64,
        "persist_at": [2048, 4096],
        "blas_probe_tokens": 32 if quick else 64,
        "profile_repeats": 3,
        # the CPU fast path on and off (bench/cpu.py)
        "cpu_prefill": [512] if quick else [512, 2048],
        "cpu_decode": 32,
        "cpu_repeats": 1 if quick else 2,  # rounds of on and off, the best of each
        "cpu_history": 1024 if quick else 4096,
        "cpu_quant_bits": [4] if quick else [4, 8],
    }


# ------------------------------------------------------------------ machine


def machine() -> dict[str, Any]:
    """What the report runs on: CPU, cores, memory, mlx and its device, the BLAS."""
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # mlx.core's stubs leave it out
        "mlx_lm": package_version("mlx-lm"),
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "blas": blas.describe(),
        "kvchat": kvchat.__version__,
        "load_average_at_start": load,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# ------------------------------------------------------------------ text


def _paragraphs() -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


def make_text(tokenizer, tokens: int, seed: int) -> str:
    """Deterministic English-like text of about ``tokens`` tokens (corpus paragraphs, shuffled)."""
    paragraphs = _paragraphs()
    rng = random.Random(seed)
    out: list[str] = []
    count = 0
    while count < tokens:
        order = list(paragraphs)
        rng.shuffle(order)
        for p in order:
            n = len(tokenizer.encode(p + "\n\n", add_special_tokens=False))
            if count + n > tokens and out:
                # finish with part of a paragraph, cut at a word, to land close to the target
                words = p.split()
                lo, hi = 1, len(words)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    m = len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False))
                    lo, hi = (mid, hi) if count + m <= tokens else (lo, mid - 1)
                out.append(" ".join(words[:lo]))
                return "\n\n".join(out)
            out.append(p)
            count += n
            if count >= tokens:
                break
    return "\n\n".join(out)


# ------------------------------------------------------------------ helpers


def median(values: list[float]) -> float:
    """The median of ``values``, as a float."""
    return float(statistics.median(values))


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing or not finite or ``b`` is not positive."""
    if a is None or b is None or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def rounded_ratio(a: float | None, b: float | None) -> float | None:
    """:func:`ratio` rounded to two decimals, as the reports give it."""
    value = ratio(a, b)
    return None if value is None else round(value, 2)


def run_turn(session: Session, text: str) -> dict[str, Any]:
    """Send ``text``, drain the reply; return the stats as a dict plus the reply's token ids."""
    from kvchat.engine.conversation.session import TurnDone

    done = None
    for event in session.send(text):
        if isinstance(event, TurnDone):
            done = event
    assert done is not None
    stats = done.stats.to_dict()
    start = stats["prompt_tokens"]
    tokens = list(session.ledger[start : start + stats["generated_tokens"]])
    if len(tokens) != stats["generated_tokens"]:  # the ledger was cut (bounded kinds)
        tokens = list(session.lm.tokenizer.encode(done.reply, add_special_tokens=False))
    stats["tokens"] = tokens
    stats["reply"] = done.reply
    return stats


def bytes_per_token(cache: list[Any]) -> float:
    """Bytes one token takes across all layers: each layer's key and value buffers divided
    by the token slots they have (preallocated slots cost the same as used ones), so the
    figure is exact for standard, quantized and bounded kinds alike."""
    from kvchat.engine.caches.trees import flatten

    total = 0.0
    for layer in cache:
        arrays = [v for _, v in flatten(layer.state) if hasattr(v, "nbytes")]
        if not arrays or arrays[0].ndim < 2 or arrays[0].shape[-2] == 0:
            continue
        total += sum(a.nbytes for a in arrays) / arrays[0].shape[-2]
    return total


def eval_only_s(lm: LoadedModel, tokens: list[int]) -> float:
    """Seconds to evaluate only ``tokens`` from an empty cache and sample the first token."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from kvchat.engine.caches.kinds import make_cache, parse_kind

    cache = make_cache(lm.model, parse_kind("standard"))
    start = time.perf_counter()
    with mx.stream(generation_stream):
        if len(tokens) > 1:
            lm.model(mx.array(tokens[:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
        logits = lm.model(mx.array(tokens[-1:])[None], cache=cache)
        cast(int, mx.argmax(logits[0, -1]).item())
    return time.perf_counter() - start


@contextlib.contextmanager
def temp_home() -> Iterator[Path]:
    """A temporary ``KVCHAT_HOME``, so the user's saved sessions are never touched."""
    old = os.environ.get("KVCHAT_HOME")
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        os.environ["KVCHAT_HOME"] = tmp
        try:
            yield Path(tmp)
        finally:
            if old is None:
                os.environ.pop("KVCHAT_HOME", None)
            else:
                os.environ["KVCHAT_HOME"] = old


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# ------------------------------------------------------------------ profile


def profile_cached_turn(session: Session, text: str) -> dict[str, float]:
    """Split one cached turn's time to first token into its parts, outside the Session.

    Mirrors a turn (:func:`kvchat.engine.conversation.turn.run_turn`) on the session's
    cache keeper: render the transcript through the chat template (tokenising
    included), search the common prefix with the ledger and trim the cache to it,
    prefill the new tokens but the last, then feed the last one and sample the first
    reply token. Leaves the transcript as it found it, and the cache holding it.
    """
    import mlx.core as mx

    from kvchat.engine.conversation.events import GenerationSettings
    from kvchat.engine.conversation.maintenance import common_prefix
    from kvchat.engine.generation.per_model import core_for
    from kvchat.engine.generation.sampling import for_settings

    keeper = session.keeper
    messages = [*session.messages, {"role": "user", "content": text}]
    t0 = time.perf_counter()
    prompt = session.render(messages, True)
    t1 = time.perf_counter()
    n = min(common_prefix(keeper.ledger, prompt), len(prompt) - 1)
    t2 = time.perf_counter()
    kept, _ = keeper.rewind(n)
    assert kept == n, "the profile needs a trimmable cache"
    t3 = time.perf_counter()
    stop = threading.Event()
    step = session.settings.prefill_step
    for _ in keeper.prefill(prompt[n:-1], len(prompt) - n, step=step, stop=stop):
        pass
    t4 = time.perf_counter()
    sampler, processors = for_settings(GenerationSettings(temp=0.0))
    last = keeper.sequence(
        prompt[-1:], sampler=sampler, processors=processors, max_tokens=1, stop=stop
    )
    for _ in core_for(session.lm).run(last):
        pass
    t5 = time.perf_counter()
    mx.eval([c.state for c in keeper.cache])
    session.sync()  # the cache back to the transcript's tokens
    return {
        "render_s": t1 - t0,
        "prefix_search_s": t2 - t1,
        "trim_s": t3 - t2,
        "prefill_s": t4 - t3,
        "first_token_s": t5 - t4,
        "new_tokens": len(prompt) - n,
        "history_tokens": n,
    }


PROFILE_PARTS = {
    "render_s": "tokenising + chat template (whole transcript)",
    "prefix_search_s": "prefix search against the ledger",
    "trim_s": "trim the cache to the prefix",
    "prefill_s": "prefill of the new tokens (all but the last)",
    "first_token_s": "last prompt token + first sampled token",
}


def median_profile(profiles: list[dict[str, float]]) -> dict[str, Any]:
    """Each part of the cached-turn profiles' median, with their total, each share and the slowest part."""
    out: dict[str, Any] = {k: median([p[k] for p in profiles]) for k in PROFILE_PARTS}
    total = sum(out[k] for k in PROFILE_PARTS)
    out["total_s"] = total
    out["shares"] = {k: (out[k] / total if total > 0 else 0.0) for k in PROFILE_PARTS}
    out["new_tokens"] = profiles[0]["new_tokens"]
    out["history_tokens"] = profiles[0]["history_tokens"]
    slowest = max(PROFILE_PARTS, key=lambda k: out[k])
    out["slowest"] = slowest
    return out
