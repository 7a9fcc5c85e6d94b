"""Tiny random-weight models of other mlx-lm architectures, for the
``arch`` fixture: each is built from mlx-lm's own model class with the demo tokenizer
(:func:`kvchat.engine.models.demo.model_config`), saved in mlx-lm's format and loaded through
``mlx_lm.load`` like any downloaded model: 2 layers, width 64."""

from __future__ import annotations

from pathlib import Path

from kvchat.engine.models import demo
from kvchat.engine.models.model import LoadedModel, load_model

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
ATTENTION = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
SHAPES = {
    "gemma2": {"model_type": "gemma2", **ATTENTION, "query_pre_attn_scalar": 32},
    # Phi-3's head size, 96: hidden 192 over 2 heads
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 192,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    },
    "mamba": {
        "model_type": "mamba",
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        **ATTENTION,
        "mamba_d_ssm": 64,
        "mamba_d_state": 8,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_chunk_size": 16,
    },
    # layer 0 slides over 16 tokens, layer 1 sees everything
    "gemma3_text": {
        "model_type": "gemma3_text",
        **ATTENTION,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    "lfm2": {
        "model_type": "lfm2",
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention"],
    },
}


# Families whose batches the stress harness (tests/batch_harness.py) checks besides
# SHAPES': the two that once changed a reply in a batch (issue 37) and the two the
# CPU fast path decodes in numpy (on MLX's path too when it is switched off).
BATCHED = {
    "gpt_neox": {
        "model_type": "gpt_neox",
        "num_attention_heads": 2,
        "layer_norm_eps": 1e-5,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **ATTENTION,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 1000000.0,
        "norm_topk_prob": True,
    },
    "llama": {"model_type": "llama", **ATTENTION},
    "qwen2": {"model_type": "qwen2", **ATTENTION, "rope_theta": 1000000.0},
}


def build(folder: Path, name: str) -> LoadedModel:
    """Write the tiny model of family ``name`` (in SHAPES or BATCHED) into ``folder`` and
    load it."""
    tokenizer = demo.train_tokenizer()
    folder.mkdir(parents=True)
    shape = {**TINY, **(SHAPES.get(name) or BATCHED[name])}
    demo.write_model(folder, demo.model_config(shape, tokenizer), tokenizer)
    return load_model(str(folder))
