"""A long paste beside a streaming reply: does the reply keep coming while the paste goes in?

:func:`paste`: against ``kvchat serve`` and ``mlx_lm.server`` on the same model
folder, side by side and taking turns ``rounds`` times: client A asks a short
question and streams a reply of up to ``max_tokens`` tokens; once its first text
has come, client B sends a message of about ``paste_tokens`` tokens. Measured,
over the time B waits for its first token: A's longest wait between two pieces
of text and the pieces it got, and B's time to first token. Each row keeps its
best round (the shortest wait, the most pieces, the quickest paste); only the
ratios between the two servers mean something on a shared machine.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .common import make_text, rounded_ratio
from .servers import in_turn, side_by_side, stream_turn


def paste(
    model: str, out: Path, paste_tokens: int = 2000, max_tokens: int = 400, rounds: int = 1
) -> dict:
    """Each server's row (the best of ``rounds``) and the ratios between them."""
    from kvchat.engine.models.model import load_model

    lm = load_model(model)
    tokenizer, folder = lm.tokenizer, lm.path
    del lm  # the servers hold the weights
    rows: dict[str, dict] = {}
    with side_by_side(model, folder, out, "paste") as servers:
        for r in range(rounds):
            text = make_text(tokenizer, paste_tokens, seed=100 + r)  # the same for both
            for label in in_turn(r):
                row = _beside(servers[label].url, f"{r}-{label}", text, max_tokens)
                rows[label] = _best(rows.get(label), row)
    ours, theirs = rows["kvchat serve"], rows["mlx_lm.server"]
    return {
        "model": model,
        "paste_tokens": paste_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "servers": rows,
        "ratios": {
            "longest_wait_kvchat_vs_mlx_lm": rounded_ratio(
                ours["longest_wait_s"], theirs["longest_wait_s"]
            ),
            "paste_ttft_kvchat_vs_mlx_lm": rounded_ratio(
                ours["paste_ttft_s"], theirs["paste_ttft_s"]
            ),
        },
    }


def _beside(url: str, run: str, text: str, max_tokens: int) -> dict:
    """One round: A streams, B pastes once A's first text is in."""
    streaming: dict = {}
    first = threading.Event()

    def stream() -> None:
        messages = [{"role": "user", "content": f"Run {run}. Tell me a long story."}]
        streaming.update(stream_turn(url, messages, max_tokens, on_text=first.set))
        first.set()  # an answer with no text: B goes on all the same

    thread = threading.Thread(target=stream)
    thread.start()
    first.wait(600)
    pasted = stream_turn(url, [{"role": "user", "content": f"Read this.\n\n{text}"}], 8)
    thread.join()
    start = pasted["started"]
    return meanwhile(streaming["arrivals"], start, start + (pasted["ttft_s"] or pasted["total_s"]))


def meanwhile(arrivals: list[float], start: float, end: float) -> dict:
    """What the streaming reply's pieces (their ``arrivals``) did while the paste waited,
    from ``start`` to ``end``: its longest wait (each cut to that span), its pieces, and
    whether it had ended before."""
    waits = [min(b, end) - max(a, start) for a, b in zip(arrivals, arrivals[1:]) if b > start]
    return {
        "longest_wait_s": round(max([w for w in waits if w > 0], default=end - start), 3),
        "pieces_meanwhile": sum(1 for t in arrivals if start < t <= end),
        "paste_ttft_s": round(end - start, 3),
        "reply_ended_first": arrivals[-1] < end if arrivals else True,
    }


def _best(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {
        "longest_wait_s": min(old["longest_wait_s"], new["longest_wait_s"]),
        "pieces_meanwhile": max(old["pieces_meanwhile"], new["pieces_meanwhile"]),
        "paste_ttft_s": min(old["paste_ttft_s"], new["paste_ttft_s"]),
        "reply_ended_first": old["reply_ended_first"] or new["reply_ended_first"],
    }
