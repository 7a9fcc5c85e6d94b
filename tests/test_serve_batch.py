"""Issue 37 as a user of ``kvchat serve`` met it: four conversations sent at once, each
with its own ``X-Session-Id`` under the same system prompt, get the replies each gets
sent alone (on gpt_neox, a family whose rows merge into one batch cache on MLX's path)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from serve_helpers import Server, chat

from kvchat.batch_check import SYSTEM, words

pytestmark = pytest.mark.timeout(300)


def _ask(server: Server, text: str, name: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    reply, _, _ = chat(server.client, messages, max_tokens=48, extra_headers={"X-Session-Id": name})
    return reply


def _at_once(server: Server, texts: list[str], prefix: str) -> list[str]:
    """``texts`` sent 50 ms apart, each in a new named session: the later ones arrive
    while the first ones decode (before the fix, they started from those lent caches)."""
    got: dict[int, str] = {}

    def send(i: int) -> None:
        time.sleep(0.05 * i)
        got[i] = _ask(server, texts[i], f"{prefix}-{i}")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [got[i] for i in range(len(texts))]


def test_four_named_sessions_sent_at_once_reply_as_each_alone(arch, home):
    lm = arch("gpt_neox")
    rng = random.Random(37)
    texts = [*(words(rng.randint(3, 12), rng) for _ in range(3)), words(260, rng)]
    with Server(lm) as server:
        alone = [_ask(server, text, f"alone-{i}") for i, text in enumerate(texts)]
        for round_ in range(3):  # each round's new sessions start from the sessions before
            assert _at_once(server, texts, f"r{round_}") == alone, f"round {round_}"
