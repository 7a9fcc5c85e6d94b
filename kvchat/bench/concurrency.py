"""Conversations at once: ``kvchat serve`` and ``mlx_lm.server`` under the same load.

For 1, 2, 4 and 8 clients at once, each a three-turn chat (a first message of
about ``first_tokens`` tokens, then two short follow-ups; greedy, streamed),
against each server on the same model folder, in the same run: the aggregate
tokens per second of the replies (counted with the model's tokenizer, the same
for both) over the load's wall time, and the median time to the first token of
turn 2. On a shared machine only the ratios mean something.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import make_text
from .serve import kvchat_serve, mlx_lm_server, stream_turn

LOADS = (1, 2, 4, 8)


def concurrency(
    model: str,
    out: Path,
    first_tokens: int = 340,
    max_tokens: int = 64,
    loads: tuple[int, ...] = LOADS,
) -> dict:
    """Each server's rows, one per load, and the ratios the issue asks about."""
    from kvchat.engine.models.model import load_model

    lm = load_model(model)
    tokenizer, folder = lm.tokenizer, lm.path
    del lm  # the servers hold the weights

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    servers = {
        "kvchat serve": lambda: kvchat_serve(model, out / "kvchat-conc.log"),
        "mlx_lm.server": lambda: mlx_lm_server(folder, out / "mlx_lm-conc.log"),
    }
    rows: dict[str, dict[int, dict]] = {}
    for label, start in servers.items():
        server = start()
        try:
            stream_turn(server.url, [{"role": "user", "content": "Warm up."}], 4)
            rows[label] = {
                n: _load(
                    server.url, n, first_tokens, max_tokens, tokenizer, count, run=f"{label}-{n}"
                )
                for n in loads
            }
        finally:
            server.stop()
    return {
        "model": model,
        "first_tokens": first_tokens,
        "max_tokens": max_tokens,
        "servers": rows,
        "ratios": _ratios(rows, loads),
    }


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
            generated += count(result["reply"])
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

    def ratio(a, b):
        return round(a / b, 2) if a and b else None

    return {
        f"kvchat_aggregate_{most}_vs_{one}": ratio(
            ours[most]["aggregate_tps"], ours[one]["aggregate_tps"]
        ),
        f"kvchat_turn2_ttft_{most}_vs_{one}": ratio(
            ours[most]["turn2_ttft_median_s"], ours[one]["turn2_ttft_median_s"]
        ),
        f"aggregate_kvchat_vs_mlx_lm_at_{most}": ratio(
            ours[most]["aggregate_tps"], theirs[most]["aggregate_tps"]
        ),
        f"turn2_ttft_kvchat_vs_mlx_lm_at_{most}": ratio(
            ours[most]["turn2_ttft_median_s"], theirs[most]["turn2_ttft_median_s"]
        ),
    }
