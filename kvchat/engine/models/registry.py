"""The models loaded in this process, shared by the sessions that use them. Imports no Textual.

Every holder (an open session, a front end keeping its default model ready,
a worker between loading a model and opening a session on it) takes a
reference with :meth:`ModelRegistry.acquire` or :meth:`ModelRegistry.retain`
and gives it back with :meth:`ModelRegistry.release`. A model nobody holds is
unloaded: the registry drops its references and returns the memory to the
system (``mx.clear_cache()``). The memory budget that models and caches share
is the pool's (:class:`kvchat.runtime.pool.SessionPool`), which asks :meth:`weight_bytes`.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from kvchat.engine.caches.trees import flatten
from kvchat.engine.models.demo_build import Progress

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel


def load_model(model_id: str, progress: Progress | None = None) -> LoadedModel:
    """:func:`kvchat.engine.models.model.load_model`, imported on the first load: it brings
    mlx-lm and transformers, which a front end need not wait for before it shows itself."""
    from kvchat.engine.models import model

    return model.load_model(model_id, progress)


@dataclass
class _Held:
    lm: LoadedModel
    holders: int
    weight_bytes: int


def weight_bytes(lm: LoadedModel) -> int:
    """Bytes of a model's parameters in memory."""
    return sum(v.nbytes for _, v in flatten(lm.model.parameters()) if isinstance(v, mx.array))


class ModelRegistry:
    """Loaded models by model id, with a count of holders each; thread-safe.

    ``loader`` turns a model id into a :class:`LoadedModel` (default
    :func:`~kvchat.engine.models.model.load_model`; it raises ``ModelLoadError``).
    Loads run one at a time, so two requests for one id load it once.
    """

    def __init__(self, loader: Callable[[str, Progress | None], LoadedModel] = load_model) -> None:
        self._loader = loader
        self._lock = threading.Lock()  # the table; never held through a load
        self._loading = threading.Lock()  # one load at a time
        self._models: dict[str, _Held] = {}

    def acquire(self, model_id: str, progress: Progress | None = None) -> LoadedModel:
        """The model ``model_id``, loaded now if no one holds it (``progress(done, total,
        what)`` as it builds and loads, see :func:`~kvchat.engine.models.model.load_model`);
        the caller holds it."""
        with self._loading:
            with self._lock:
                held = self._models.get(model_id)
                if held is not None:
                    held.holders += 1
                    return held.lm
            lm = self._loader(model_id, progress)
            with self._lock:
                self._models[model_id] = _Held(lm, 1, weight_bytes(lm))
            return lm

    def retain(self, lm: LoadedModel) -> LoadedModel:
        """Hold ``lm`` once more; a model loaded elsewhere is registered under its id."""
        with self._lock:
            held = self._models.get(lm.model_id)
            if held is None or held.lm is not lm:
                if held is not None:
                    raise ValueError(f"Another model is registered as {lm.model_id!r}.")
                held = _Held(lm, 0, weight_bytes(lm))
                self._models[lm.model_id] = held
            held.holders += 1
            return lm

    def release(self, lm: LoadedModel) -> bool:
        """Give back one hold on ``lm``; unload it when none is left. True if it was unloaded."""
        with self._lock:
            held = self._models.get(lm.model_id)
            if held is None or held.lm is not lm:
                return False
            held.holders -= 1
            if held.holders > 0:
                return False
            del self._models[lm.model_id]
        del held, lm
        gc.collect()  # sessions and widgets form cycles; the weights go only with them
        mx.clear_cache()
        return True

    def holders(self) -> dict[str, int]:
        """Each loaded model's id and how many hold it."""
        with self._lock:
            return {model_id: held.holders for model_id, held in self._models.items()}

    def get(self, model_id: str) -> LoadedModel | None:
        """The loaded model ``model_id``, or None; takes no hold."""
        with self._lock:
            held = self._models.get(model_id)
            return held.lm if held else None

    def weight_bytes(self) -> int:
        """Bytes of the weights of every loaded model."""
        with self._lock:
            return sum(held.weight_bytes for held in self._models.values())
