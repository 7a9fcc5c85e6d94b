"""Mixture-of-experts layers on the CPU (kvchat/engine/cpu/experts.py): a tiny mlx-lm
``qwen3_moe`` model, its experts packed by mlx-lm's own ``quantize_model``, replies
greedily through kvchat's expert layers exactly as through mlx's ``gather_qmm``, and a
decoding step reads only the experts its token chose."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model

from kvchat.engine.cpu import FastPath, experts
from kvchat.engine.models import demo

MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
PROMPT = list(range(5, 45))  # 40 tokens: 80 choices, so mlx-lm's SwitchGLU sorts them


@pytest.fixture(scope="module", params=["q4", "float32"])
def moe(request, tmp_path_factory):
    """The tiny model (float32, or packed to 4 bits in memory by mlx-lm, float32 scales)
    with kvchat's expert layers, and its FastPath (on: kvchat's; off: mlx's own)."""
    folder = tmp_path_factory.mktemp("moe")
    tokenizer = demo.train_tokenizer()
    config = demo.model_config(MOE, tokenizer)
    demo.write_model(folder, config, tokenizer)
    model, _ = mlx_lm.load(str(folder))
    if request.param == "q4":
        model, _ = quantize_model(model, config, 64, 4)
    fast = FastPath()
    assert experts.replace(model, fast) == MOE["num_hidden_layers"]
    return model, fast


def greedy(model, n: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)
    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens


def test_the_layers_keep_mlx_lms_parameters(moe):
    model, _ = moe
    layer = model.model.layers[0].mlp.switch_mlp
    assert isinstance(layer, experts.Experts)
    names = {k for k, _ in tree_flatten(model.parameters()) if ".switch_mlp." in k}
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in names
    assert len(names) == 2 * 3 * (3 if "scales" in layer.gate_proj else 1)


def test_greedy_replies_equal_mlxs_own_and_cached_equals_uncached(moe):
    model, fast = moe
    fast.on = False
    want = greedy(model, 16)
    fast.on = True
    got = greedy(model, 16)
    assert got == want
    whole = model(mx.array([PROMPT + got[:-1]]))[0, len(PROMPT) - 1 :]
    assert mx.argmax(whole, axis=-1).tolist() == got


def test_outputs_agree_with_gather_qmm_for_every_row_count(moe):
    model, fast = moe
    layer = model.model.layers[1].mlp.switch_mlp
    rng = np.random.default_rng(0)
    for rows in (1, 2, 7, 8, 64):
        x = mx.array(rng.standard_normal((1, rows, MOE["hidden_size"]), dtype=np.float32))
        chosen = mx.array(rng.permuted(np.tile(np.arange(8), (rows, 1)), axis=1)[:, :2][None])
        fast.on = False
        want = np.asarray(layer(x, chosen))
        fast.on = True
        got = np.asarray(layer(x, chosen))
        assert got.shape == want.shape == (1, rows, 2, MOE["hidden_size"])
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_decoding_step_reads_only_the_experts_its_token_chose(moe):
    model, fast = moe
    fast.on = True
    layer = model.model.layers[0].mlp
    fresh = experts.Experts(layer.switch_mlp, fast)
    layer.update_modules({"switch_mlp": fresh})
    x = mx.array(np.random.default_rng(1).standard_normal((1, 1, 128), dtype=np.float32))
    fresh(x, mx.array([[[6, 3]]]))
    assert sorted(fresh.views.made) == sorted((p, e) for e in (3, 6) for p in range(3))


@pytest.mark.parametrize("suffix", ["q4", "q8", "bf16"])
def test_experts_stored_as_mlx_community_models_are(suffix, tmp_path):
    """The demo's writer packs from bfloat16 (bfloat16 scales and biases, as
    mlx_lm.convert makes them from a bfloat16 checkpoint), or keeps bfloat16: the same
    products as gather_qmm's (gather_mm's) on float32 rows."""
    tokenizer = demo.train_tokenizer()
    demo.write_model(tmp_path, demo.model_config(MOE, tokenizer), tokenizer, suffix)
    model, _ = mlx_lm.load(str(tmp_path))
    stock = model.model.layers[0].mlp.switch_mlp
    held = stock.gate_proj["scales" if suffix != "bf16" else "weight"]
    assert held.dtype == mx.bfloat16
    layer = experts.Experts(stock, FastPath())
    x = mx.array(np.random.default_rng(2).standard_normal((1, 5, 128), dtype=np.float32))
    chosen = mx.array([[[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]]])
    want = np.asarray(stock(x, chosen).astype(mx.float32))
    got = np.asarray(layer(x, chosen))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
