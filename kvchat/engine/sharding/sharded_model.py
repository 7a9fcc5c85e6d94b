"""A model sharded over MLX distributed ranks, loaded by mlx-lm's ``sharded_load``.

Tensor parallel where the model class has ``shard()`` and its attention heads
divide over the ranks; pipeline (each rank a run of layers) where it has
``pipeline()``; a one-sentence :class:`ModelLoadError` otherwise. Every rank
calls :func:`load_sharded` with the same ``spec``; each ends with the same
tokenizer and its own part of the weights, as a :class:`ShardedModel` that the
rest of kvchat takes like any :class:`LoadedModel`.

The fingerprint gains the layout (``<fingerprint>+tensor2``), so a cache saved
by one layout is never taken for another's: :func:`layout_problem` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model
from mlx_lm.utils import load_tokenizer, sharded_load

from kvchat.engine.models.model import (
    LoadedModel,
    ModelLoadError,
    context_length,
    fingerprint,
    first_line,
    load_error,
    resolve_folder,
)

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ShardedModel(LoadedModel):
    """A :class:`LoadedModel` holding this rank's part of the weights."""

    group: Any = None  # the mx.distributed group it is sharded over
    mode: str = "tensor"  # or "pipeline"

    @property
    def world(self) -> int:
        return int(self.group.size())

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    @property
    def layout(self) -> str:
        """The world size and mode, in words: "2 ranks, tensor parallel"."""
        return f"{self.world} ranks, {self.mode} parallel"


def load_sharded(spec: str, group: Any) -> ShardedModel:
    """Load ``spec`` (as :func:`~kvchat.engine.models.model.load_model` takes it) sharded over
    ``group``; every rank of the group must call this together."""
    path = resolve_folder(spec)
    if not (path / "config.json").is_file():
        raise load_error(spec, "the folder has no config.json")
    try:
        probe, config = mlx_load_model(path, lazy=True, strict=False)
        mode = choose_mode(probe, config, group.size(), spec)
        if mode == "tensor":
            model, tokenizer, config = sharded_load(
                str(path), tensor_group=group, return_config=True
            )
        elif (path / INDEX_FILE).is_file():
            model, tokenizer, config = sharded_load(
                str(path), pipeline_group=group, return_config=True
            )
        else:
            model, tokenizer, config = _pipeline_one_file(path, group)
    except ModelLoadError:
        raise
    except Exception as exc:  # a broken folder fails in many ways; all mean the same here
        raise load_error(spec, first_line(exc)) from exc
    if any(type(c) is not KVCache for c in make_prompt_cache(model)):
        raise ModelLoadError(
            f"kvchat shards only models whose every layer keeps a plain KV cache, and "
            f"'{spec}' has sliding-window or recurrent layers; run it on one machine."
        )
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # CPU matmul runs float32 far faster (docs/architecture.md)
    base = fingerprint(spec, path)
    return ShardedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=spec,
        path=path,
        fingerprint=f"{base}+{mode}{group.size()}",
        context_length=context_length(config),
        weights=f"sharded over {group.size()} ranks ({mode} parallel)",
        group=group,
        mode=mode,
    )


def choose_mode(model: Any, config: dict[str, Any], world: int, spec: str) -> str:
    """ "tensor" or "pipeline" for ``model`` over ``world`` ranks, or ModelLoadError."""
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get(
        "num_attention_heads", 0
    )
    kv_heads = config.get("num_key_value_heads") or heads
    if hasattr(model, "shard") and heads and heads % world == 0 and kv_heads % world == 0:
        return "tensor"
    inner = getattr(model, "model", None)
    if hasattr(inner, "pipeline") and len(getattr(inner, "layers", ())) >= world:
        return "pipeline"
    raise ModelLoadError(
        f"'{spec}' cannot be sharded over {world} ranks: mlx-lm gives its architecture "
        f"({config.get('model_type', 'unknown')}) no tensor parallelism that its "
        f"{heads} attention heads divide into and no pipelining over that many layers."
    )


def _pipeline_one_file(path: Path, group: mx.distributed.Group) -> tuple[Any, Any, dict[str, Any]]:
    """What ``sharded_load`` does for a pipeline, for a checkpoint in one file (which it
    cannot split by its index): every rank reads the file, keeping only its own layers."""
    model, config = mlx_load_model(path, lazy=True, strict=False)
    model.model.pipeline(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(
        path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id")
    )
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank is ready
    return model, tokenizer, config


def layout(fingerprint_: str | None) -> str:
    """How a model with this fingerprint was run, in words."""
    _, plus, tail = (fingerprint_ or "").partition("+")
    if not plus:
        return "on one machine"
    mode = tail.rstrip("0123456789")
    return f"sharded over {tail[len(mode) :]} ranks ({mode} parallel)"


def layout_problem(saved: str | None, now: str) -> str | None:
    """Why a cache saved with fingerprint ``saved`` cannot serve ``now`` when only the
    layout (world size, sharding) differs; None when the layouts agree or the models differ."""
    if not saved or saved == now or saved.partition("+")[0] != now.partition("+")[0]:
        return None
    return f"it was saved {layout(saved)} and this run is {layout(now)}"
