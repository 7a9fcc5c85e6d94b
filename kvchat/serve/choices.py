"""Several replies to one request (``n`` > 1): the prompt is evaluated once, into the
request's session; each other reply decodes in a fork of it (a copy of its cache), all
of them together in the generation core.

Reply ``i`` is sampled with the request's ``seed`` + ``i`` (when it gives one), so reply
0 is the reply the same request with ``n`` = 1 gets, and seeded replies differ from one
another at a temperature above 0. The session keeps reply 0; the forks go with the
request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from kvchat.engine.conversation.turn import prime
from kvchat.engine.generation.threads import clear_mlx_at_thread_end

if TYPE_CHECKING:
    from kvchat.engine.conversation.events import Turn
    from kvchat.engine.conversation.session import Session

T = TypeVar("T")


def fork_replies(session: Session, prompt: list[int], n: int) -> tuple[list[Session], int, int]:
    """Evaluate ``prompt`` (its tokens, as the next turn renders them) but its last token
    into ``session``'s cache and make ``n`` - 1 forks of it, each with the session's
    settings and its own seed. Returns the forks, the prompt tokens the cache held before
    and the tokens evaluated."""
    kept, evaluated = prime(session.lm, session.keeper, prompt, session.settings.prefill_step)
    forks = []
    seed = session.settings.seed
    for i in range(1, n):
        fork = session.fork_prefix(session.messages, tokens=prompt)
        fork.settings = replace(session.settings, seed=None if seed is None else seed + i)
        fork.tools, fork.report_logprobs = session.tools, session.report_logprobs
        forks.append(fork)
    return forks, kept, evaluated


def read_together(
    sessions: list[Session], turns: list[Turn], read: Callable[[int, Session, Turn], T]
) -> list[T]:
    """``read(i, sessions[i], turns[i])`` for every reply: the first on this thread, the
    others on threads of their own, so that they decode together. A reply that fails stops
    the others; its error is raised once all have ended."""
    results: list[T | None] = [None] * len(sessions)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = read(i, sessions[i], turns[i])
        except BaseException as exc:  # raised on the request's thread below
            errors.append(exc)
            for session in sessions:
                session.stop()

    def threaded(i: int) -> None:
        clear_mlx_at_thread_end()
        one(i)

    threads = [
        threading.Thread(target=threaded, args=(i,), name=f"kvchat-reply-{i}", daemon=True)
        for i in range(1, len(sessions))
    ]
    for thread in threads:
        thread.start()
    one(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
