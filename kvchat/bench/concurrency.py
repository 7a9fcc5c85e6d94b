"""Conversations at once: ``kvchat serve`` and ``mlx_lm.server`` under the same load, and
the generation core in process.

:func:`concurrency`: for each load (1, 2, 4 and 8 clients at once by default),
each client a three-turn chat (a first message of about ``first_tokens``
tokens, then two short follow-ups; greedy, streamed), against each server on
the same model folder. Both servers run side by side and take turns load by
load, ``rounds`` times over (a shared machine's noise falls on both alike);
each row keeps its best round. Measured: the aggregate tokens per second of the
replies (the tokens each server's usage reports, else the reply re-tokenised) over
the load's wall time, and the median time to the first token of turn 2.

:func:`in_process`: the same question without HTTP, through :class:`Session`
and the model's generation core: one session's follow-up alone, then
``sessions`` sessions' follow-ups at once, taking turns ``rounds`` times
(best of each): aggregate tokens per second over the wall time, aggregate decode tokens
per second (each reply's tokens over its time from first token to last, summed), and
the median time to first token. On a shared machine only the ratios mean something.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import make_text, rounded_ratio
from .servers import SERVERS, in_turn, side_by_side, stream_turn

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

LOADS = (1, 2, 4, 8)


def concurrency(
    model: str,
    out: Path,
    first_tokens: int = 340,
    max_tokens: int = 64,
    loads: tuple[int, ...] = LOADS,
    rounds: int = 1,
) -> dict:
    """Each server's rows, one per load (the best of ``rounds``), and the ratios the issue
    asks about."""
    from kvchat.engine.models.model import load_model

    lm = load_model(model)
    tokenizer, folder = lm.tokenizer, lm.path
    del lm  # the servers hold the weights

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rows: dict[str, dict[int, dict]] = {label: {} for label in SERVERS}
    with side_by_side(model, folder, out, "conc") as servers:
        for r in range(rounds):
            for n in loads:
                for label in in_turn(r):
                    row = _load(
                        servers[label].url,
                        n,
                        first_tokens,
                        max_tokens,
                        tokenizer,
                        count,
                        run=f"{n}-{r}-{SERVERS.index(label)}",  # as long for both
                    )
                    rows[label][n] = _best(rows[label].get(n), row)
    return {
        "model": model,
        "first_tokens": first_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "servers": rows,
        "ratios": _ratios(rows, loads),
    }


def _best(old: dict | None, new: dict) -> dict:
    """The better figure of each column (the highest aggregate, the lowest time)."""
    if old is None:
        return new
    best = dict(old)
    best["aggregate_tps"] = max(old["aggregate_tps"], new["aggregate_tps"])
    times = [t for t in (old["turn2_ttft_median_s"], new["turn2_ttft_median_s"]) if t]
    best["turn2_ttft_median_s"] = min(times) if times else None
    best["seconds"] = min(old["seconds"], new["seconds"])
    return best


def _load(
    url: str, clients: int, first_tokens: int, max_tokens: int, tokenizer, count, run: str
) -> dict:
    def converse(k: int) -> tuple[int, float | None]:
        article = make_text(tokenizer, first_tokens, seed=k + 1)
        messages = [{"role": "system", "content": f"You are assistant {k} of run {run}."}]
        generated, second = 0, None
        for t, text in enumerate(
            [f"Please read this.\n\n{article}", "What is it about?", "And in one word?"]
        ):
            messages.append({"role": "user", "content": text})
            result = stream_turn(url, messages, max_tokens)
            messages.append({"role": "assistant", "content": result["reply"]})
            told = result["completion_tokens"]
            generated += told if told is not None else count(result["reply"])
            if t == 1:
                second = result["ttft_s"]
        return generated, second

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(converse, range(clients)))
    seconds = time.perf_counter() - started
    ttfts = [s for _, s in done if s is not None]
    return {
        "clients": clients,
        "seconds": round(seconds, 2),
        "generated_tokens": sum(g for g, _ in done),
        "aggregate_tps": round(sum(g for g, _ in done) / seconds, 1),
        "turn2_ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
    }


def _ratios(rows: dict[str, dict[int, dict]], loads: tuple[int, ...]) -> dict:
    most, one = max(loads), min(loads)
    ours, theirs = rows["kvchat serve"], rows["mlx_lm.server"]
    return {
        f"kvchat_aggregate_{most}_vs_{one}": rounded_ratio(
            ours[most]["aggregate_tps"], ours[one]["aggregate_tps"]
        ),
        f"kvchat_turn2_ttft_{most}_vs_{one}": rounded_ratio(
            ours[most]["turn2_ttft_median_s"], ours[one]["turn2_ttft_median_s"]
        ),
        f"aggregate_kvchat_vs_mlx_lm_at_{most}": rounded_ratio(
            ours[most]["aggregate_tps"], theirs[most]["aggregate_tps"]
        ),
        f"turn2_ttft_kvchat_vs_mlx_lm_at_{most}": rounded_ratio(
            ours[most]["turn2_ttft_median_s"], theirs[most]["turn2_ttft_median_s"]
        ),
    }


def in_process(
    model: str, sessions: int = 8, first_tokens: int = 120, max_tokens: int = 24, rounds: int = 3
) -> dict:
    """One session's follow-up alone against ``sessions`` follow-ups at once, in turns."""
    from kvchat.engine.models.model import load_model

    return {"model": model} | crowd(load_model(model), sessions, first_tokens, max_tokens, rounds)


def crowd(
    lm: LoadedModel, sessions: int, first_tokens: int, max_tokens: int, rounds: int
) -> dict[str, Any]:
    """:func:`in_process`'s figures on a loaded model."""
    from kvchat.engine.conversation.events import GenerationSettings, TurnDone
    from kvchat.engine.conversation.session import Session

    settings = GenerationSettings(max_tokens=max_tokens, ignore_eos=True)
    chats = [
        Session(lm, system=f"You are assistant {k}.", settings=settings)
        for k in range(sessions + 1)
    ]

    def turn(session: Session, text: str) -> tuple[float, int, float]:
        done = None
        for event in session.send(text):
            if isinstance(event, TurnDone):
                done = event
        if done is None:
            raise RuntimeError("a turn ended without its TurnDone")
        return done.stats.ttft_s, len(done.tokens), done.stats.gen_tps

    def together(group: list[Session], text: str) -> dict[str, Any]:
        results: list[tuple[float, int, float]] = [(0.0, 0, 0.0)] * len(group)

        def run(i: int) -> None:
            results[i] = turn(group[i], text)

        started = time.perf_counter()
        _threads(run, len(group))
        seconds = time.perf_counter() - started
        return {
            "generated_tokens": sum(n for _, n, _ in results),
            "aggregate_tps": sum(n for _, n, _ in results) / seconds,
            # each reply's tokens over its time from first token to last, summed: the
            # replies decode side by side (same length, started within a step)
            "decode_tps": sum(d for _, _, d in results),
            "ttft_median_s": statistics.median(t for t, _, _ in results),
        }

    first = [
        f"Please read this.\n\n{make_text(lm.tokenizer, first_tokens, seed=k + 1)}"
        for k in range(sessions + 1)
    ]
    _threads(lambda k: turn(chats[k], first[k]), sessions + 1)
    alone: list[dict[str, Any]] = []
    many: list[dict[str, Any]] = []
    for r in range(rounds):
        text = f"What is part {r + 1} about?"
        alone.append(together(chats[:1], text))
        many.append(together(chats[1:], text))
    alone_tps = round(max(a["aggregate_tps"] for a in alone), 2)
    alone_ttft = round(min(a["ttft_median_s"] for a in alone), 4)
    alone_decode = round(max(a["decode_tps"] for a in alone), 2)
    many_decode = round(max(m["decode_tps"] for m in many), 2)
    many_tps = round(max(m["aggregate_tps"] for m in many), 2)
    many_ttft = round(min(m["ttft_median_s"] for m in many), 4)
    return {
        "sessions": sessions,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "generated_tokens": {
            "alone": [a["generated_tokens"] for a in alone],
            "together": [m["generated_tokens"] for m in many],
        },
        "alone": {"aggregate_tps": alone_tps, "decode_tps": alone_decode, "ttft_s": alone_ttft},
        "together": {
            "aggregate_tps": many_tps,
            "decode_tps": many_decode,
            "ttft_median_s": many_ttft,
        },
        "aggregate_ratio": rounded_ratio(many_tps, alone_tps),
        "decode_ratio": rounded_ratio(many_decode, alone_decode),
        "ttft_ratio": rounded_ratio(many_ttft, alone_ttft),
    }


def _threads(fn: Callable[[int], Any], n: int) -> None:
    """``fn(0) … fn(n - 1)`` at once, one thread each (an error in one is raised here)."""
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(fn, range(n)))
