"""A soak: many short requests over many clients against one ``kvchat serve``.

:func:`soak` sends ``requests`` one-off chats (a short prompt each, a few tokens
back) from ``clients`` threads at once, as a busy local backend gets them, and
samples the server process's resident memory after every ``SAMPLE_EVERY``
requests. Its memory should be flat after the warm-up: RSS at the end against
RSS after the first ``SAMPLE_EVERY``. Every answer other than a 200 counts as an
error (a 429 too: with the default flags, the queue holds a burst of this size).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import rounded_ratio
from .servers import kvchat_serve

SAMPLE_EVERY = 200
MAX_TOKENS = 4


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (psutil where installed, else the kernel's
    ``/proc`` on Linux, else ``ps``)."""
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]  # optional
    except ImportError:
        status = Path(f"/proc/{pid}/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return int(out.stdout.strip()) * 1024
    return int(psutil.Process(pid).memory_info().rss)


def ask(url: str, text: str) -> int:
    """One non-streamed chat completion: the HTTP status."""
    body = json.dumps(
        {
            "model": "default_model",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def soak(
    model: str,
    out: Path,
    requests: int = 2000,
    clients: int = 32,
    sample_every: int = SAMPLE_EVERY,
) -> dict:
    """The soak's figures: RSS after the first ``sample_every`` requests, every
    ``sample_every`` after, at the end, and their ratio; requests per second; errors."""
    server = kvchat_serve(model, out / "kvchat-soak.log", out / "soak-home")
    pid = server.proc.pid
    lock = threading.Lock()
    done = 0
    samples: list[tuple[int, int]] = []  # (requests done, RSS bytes)
    statuses: Counter[str] = Counter()

    def one(i: int) -> None:
        nonlocal done
        try:
            status = str(ask(server.url, f"Client {i % clients}, request {i}: say hello."))
        except OSError as error:  # the connection failed: an error too
            status = type(error).__name__
        with lock:
            statuses[status] += 1
            done += 1
            if done % sample_every == 0 or done == requests:
                samples.append((done, rss_bytes(pid)))

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(requests)))
        seconds = time.perf_counter() - started
        end = rss_bytes(pid)
    finally:
        server.stop()
    warm = next((rss for n, rss in samples if n >= min(sample_every, requests)), end)
    mb = 1 << 20
    return {
        "model": model,
        "requests": requests,
        "clients": clients,
        "max_tokens": MAX_TOKENS,
        "seconds": round(seconds, 1),
        "requests_per_s": round(requests / seconds, 2),
        "errors": {k: v for k, v in statuses.items() if k != "200"},
        "rss_mb_after_warmup": round(warm / mb, 1),
        "rss_mb_at_end": round(end / mb, 1),
        "rss_end_vs_warmup": rounded_ratio(end, warm),
        "rss_mb_samples": [[n, round(rss / mb, 1)] for n, rss in samples],
    }
