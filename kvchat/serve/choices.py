"""Several replies to one request (``n`` > 1): the prompt is evaluated once, into the
request's session; each other reply decodes in a fork of it (a copy of its cache), all
of them together in the generation core.

Reply ``i`` is sampled with the request's ``seed`` + ``i`` (when it gives one), so reply
0 is the reply the same request with ``n`` = 1 gets, and seeded replies differ from one
another at a temperature above 0 (:func:`reply_options`). The session keeps reply 0; the
forks go with the request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from kvchat.engine.conversation.turn import prime
from kvchat.engine.generation.threads import clear_mlx_at_thread_end

if TYPE_CHECKING:
    from kvchat.engine.conversation.events import Turn, TurnOptions
    from kvchat.engine.conversation.session import Session

T = TypeVar("T")


def fork_replies(
    session: Session, prompt: list[int], n: int, options: TurnOptions
) -> tuple[list[Session], int, int]:
    """Evaluate ``prompt`` (its tokens, as the next turn renders them) but its last token
    into ``session``'s cache, in chunks of the request's prefill step, and make ``n`` - 1
    forks of it. Returns the forks, the prompt tokens the cache held before and the tokens
    evaluated."""
    step = options.sampling(session.settings).prefill_step
    kept, evaluated = prime(session.lm, session.keeper, prompt, step)
    forks = [session.fork_prefix(session.messages, tokens=prompt) for _ in range(1, n)]
    return forks, kept, evaluated


def reply_options(options: TurnOptions, n: int) -> list[TurnOptions]:
    """What each of ``n`` replies asks: ``options``, reply ``i`` with the request's seed + ``i``
    (when it gives one)."""
    settings = options.settings
    if settings is None or settings.seed is None:
        return [options] * n
    seed = settings.seed
    return [replace(options, settings=replace(settings, seed=seed + i)) for i in range(n)]


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
