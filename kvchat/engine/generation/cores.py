"""The generation core of each loaded model, made on first use."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kvchat.engine.generation.core import GenerationCore

_cores: dict[int, GenerationCore] = {}  # by id(model), dropped when the model goes
_cores_lock = threading.Lock()


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
            weakref.finalize(lm.model, _cores.pop, id(lm.model), None)
        return core
