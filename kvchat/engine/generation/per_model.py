"""The generation core of each loaded model, made on first use, and what its first turn
would pay once, paid ahead (:func:`warm_up`)."""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from kvchat.engine.generation.batch import merges
from kvchat.engine.generation.core import GenerationCore

_cores: dict[int, GenerationCore] = {}  # by id(model), dropped when the model goes
_cores_lock = threading.Lock()
# every core made, while it lives: at exit, weakref's own handler may have emptied _cores
_made: weakref.WeakSet[GenerationCore] = weakref.WeakSet()


def core_for(lm: Any) -> GenerationCore:
    """The core of loaded model ``lm`` (made on first use; one per model). A sharded
    model's (one with a ``group``) runs its loop on the caller's thread."""
    with _cores_lock:
        core = _cores.get(id(lm.model))
        if core is None or core.model is not lm.model:
            core = GenerationCore(
                lm.model,
                threaded=getattr(lm, "group", None) is None,
                fast_path=getattr(lm, "fast_path", None),
            )
            _cores[id(lm.model)] = core
            _made.add(core)
            weakref.finalize(lm.model, _cores.pop, id(lm.model), None)
        return core


def warm_up(lm: Any) -> None:
    """Pay now, while a user reads or types, what loaded model ``lm``'s first turn would
    pay once: whether its rows merge into one batch (:func:`.batch.merges`, a probe of a
    few short forward passes; in a fresh process it made the first 32-token prompt of
    demo:qwen2.5-0.5b take 0.72-0.78 s against 0.20 s for the same tokens a turn later).
    Not on a sharded model: its core never merges, and its ranks run only the same steps."""
    if getattr(lm, "group", None) is None:
        merges(lm.model)


@atexit.register
def _end_threads() -> None:
    """At interpreter exit, end every core's loop thread (a daemon, idle for up to 30 s
    after its last step): one still holding MLX's state as the process exits can abort it
    ("terminate called without an active exception", ml-explore/mlx#3126; seen at the end
    of a test run with four idle cores)."""
    with _cores_lock:
        cores = list(_made)
    for core in cores:
        core.end()
