"""The probe that decides whether a model's rows merge into one batch cache
(:func:`kvchat.engine.generation.batch.merges`), on a backend whose float32 matrix
products are less precise for a batch than for one row.

MLX runs a batch's float32 products in TF32 on NVIDIA and M5-class GPUs
(``MLX_ENABLE_TF32``, on by default) and one row's in full float32. On the H200 on
2026-11-28 the probe therefore refused the demo models: `doctor` said "one forward pass
a row", and 8 clients decoded no faster than one. Here the demo model's linear layers
are replaced, as ``nn.quantize`` replaces them, by ones that round their inputs and
weights to TF32's 10-bit mantissa when they get more than one row, which is what that
backend does to the model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvchat.engine.generation.batch import merge, merges

TF32 = 0xFFFFE000  # sign, exponent and the mantissa's top 10 bits of a float32


def tf32(x: mx.array) -> mx.array:
    return mx.view(mx.view(x, mx.uint32) & TF32, mx.float32)


class BatchTF32(nn.Module):
    """A linear layer whose products are rounded to TF32 for batches of two rows or more."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] < 2:
            return self.linear(x)
        out = tf32(x) @ tf32(self.linear.weight).T
        return out + self.linear.bias if "bias" in self.linear else out


def batch_tf32(model: nn.Module) -> nn.Module:
    swap = lambda _, m: BatchTF32(m) if isinstance(m, nn.Linear) else m  # noqa: E731
    model.update_modules(
        tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    )
    return model


def _logprobs(model, prompts):
    caches = [make_prompt_cache(model) for _ in prompts]
    for prompt, cache in zip(prompts, caches):
        model(mx.array([prompt]), cache=cache)
    batch = [merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    logits = model(mx.array([[5]] * len(prompts)), cache=batch)[:, -1]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_rows_merge_where_a_batch_multiplies_at_lower_precision_than_one_row(demo_model):
    model, _ = load(str(demo_model.path))
    batch_tf32(model)
    # the replaced layers bite: a row in a batch differs from the same row alone
    one = _logprobs(model, [[1, 2, 3]])[0]
    two = _logprobs(model, [[1, 2, 3], [4]])[0]
    assert mx.abs(one - two).max().item() > 1e-3
    # yet the batch's mask is honoured, so the rows merge
    assert merges(model)


def test_a_model_whose_attention_ignores_the_batch_mask_still_decodes_apart(arch):
    model, _ = load(str(arch("gemma2").path))
    assert not merges(model)
    assert not merges(batch_tf32(load(str(arch("gemma2").path))[0]))
