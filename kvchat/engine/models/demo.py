"""Built-in demo models: a small trained model and random-weight shapes, real files.

``--model demo`` (and ``demo:<shape>``, each optionally ``@q4``, ``@q8`` or ``@bf16``
for 4- or 8-bit or bfloat16 weights, as ``mlx_lm.convert`` makes them) needs no
download. On first use a
model folder in mlx-lm's format (config.json, safetensors weights, tokenizer
files) is built into the cache dir, and from then on it is loaded like any
other model with ``mlx_lm.load``.

``demo`` itself is trained: its weights ship in ``demo_weights/``, made by
:mod:`kvchat.engine.models.demo_train` from the bundled corpus, so it writes words and
ends its turns. The other shapes have seeded random weights and speak nonsense,
but every cache behaviour, timing and file is real; they copy the architecture
(layers, heads, widths) of the models they are named after so that benchmarks on
them mean something; only the vocabulary is small.

Builds are deterministic: the same files, byte for byte, on every build.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvchat.engine.models.demo_build import VARIANTS, Progress, write_json, write_weights
from kvchat.engine.models.demo_template import CHAT_TEMPLATE
from kvchat.locations import models_dir

BUILD_VERSION = "v5"  # bump when a build changes, so old folders are not reused
PREFIX = "demo"
VOCAB_SIZE = 2048
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
CORPUS = Path(__file__).with_name("demo_corpus.txt")
TRAINED = Path(__file__).with_name("demo_weights")  # demo_train.py writes it
HELDOUT_TITLE = "On Learning a Language as an Adult"  # the corpus's last section, never trained on

# Qwen2's pre-tokenisation split (transformers' Qwen2Tokenizer), see train_tokenizer().
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3-30B-A3B's attention and depth, halved (the MoE shape and its dense twin share it).
QWEN3_HALF = {
    "num_hidden_layers": 24,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}

# Architecture of each demo shape; vocab_size and token ids come from the tokenizer.
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 16384,
    },
    "random": {},  # the demo's shape with random weights (filled in below): it never stops
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    # the active weights of qwen3-moe-2b as one dense model: its twin in the bench
    "qwen3-0.35b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **QWEN3_HALF,
        "intermediate_size": 3072,  # = 8 experts chosen x 384
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    # Qwen3-30B-A3B's layout at half the width, layers and experts: 2.0B weights, 0.35B
    # of them read per token (the attention, the router and 8 experts of 64 per layer)
    "qwen3-moe-2b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **QWEN3_HALF,
        "intermediate_size": 3072,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 384,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen2.5-3b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 36,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 11008,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
}


SHAPES["random"] = dict(SHAPES[PREFIX])


def corpus_parts() -> tuple[str, str]:
    """The corpus split into (the text the demo is trained on, the held-out last section)."""
    text = CORPUS.read_text(encoding="utf-8")
    cut = text.index("\n" + HELDOUT_TITLE + "\n")
    return text[:cut].strip() + "\n", text[cut:].strip() + "\n"


def demo_names() -> list[str]:
    """The demo shapes, smallest first."""
    return list(SHAPES)


def demo_specs() -> list[str]:
    """What ``--model`` accepts for each shape: ``demo``, ``demo:<shape>``; each may end
    in ``@q4``, ``@q8`` or ``@bf16`` for a copy with 4- or 8-bit or bfloat16 weights."""
    return [PREFIX if name == PREFIX else f"{PREFIX}:{name}" for name in SHAPES]


def parse_demo_spec(spec: str) -> str | None:
    """The shape a ``--model`` value names (with its ``@q4``/``@q8``/``@bf16``), or None
    when it is not a demo spec.

    Raises ValueError for an unknown shape or suffix, naming the valid specs.
    """
    base, _, bits = spec.partition("@")
    if base == PREFIX:
        name = PREFIX
    elif base.startswith(PREFIX + ":"):
        name = base.removeprefix(PREFIX + ":")
    else:
        return None
    if name not in SHAPES or bits not in VARIANTS:
        raise ValueError(
            f"Unknown demo model '{spec}'; use one of: {', '.join(demo_specs())}, "
            "optionally ending in @q4, @q8 or @bf16."
        )
    return f"{name}@{bits}" if bits else name


def demo_path(name: str) -> Path:
    """The folder a shape is built into (it may not exist yet)."""
    return models_dir() / f"{name.replace('@', '-')}-{BUILD_VERSION}"


def builds_weights(spec: str) -> bool:
    """Whether loading ``spec`` first computes and writes a demo model's weights: a demo
    not built yet, except the trained demo as shipped (its files are copied at once)."""
    try:
        name = parse_demo_spec(spec)
    except ValueError:
        return False
    return name is not None and name != PREFIX and not demo_path(name).is_dir()


def build_demo(name: str, progress: Progress | None = None) -> Path:
    """Build shape ``name`` once and return its folder; later calls reuse it.

    The folder appears atomically: it is built beside the target and renamed
    into place, so a crash leaves nothing half-written, and when two processes
    race the loser throws its copy away. ``<shape>@q4`` holds the same weights as
    ``<shape>`` cast to bfloat16 and quantized by mlx-lm to 4 bits (group size 64),
    as mlx-community models are; it is written a layer at a time, without a
    float32 copy (:mod:`kvchat.engine.models.demo_build`), ``progress(layers written,
    layers, what)`` saying first the bytes it will take and then how far it is.
    """
    shape, _, suffix = name.partition("@")
    if shape not in SHAPES or suffix not in VARIANTS:
        raise ValueError(f"Unknown demo shape '{name}'; use one of: {', '.join(SHAPES)}.")
    target = demo_path(name)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if shape == PREFIX:
            _copy_trained(scratch, suffix, progress)
        else:
            tokenizer = train_tokenizer()
            write_model(scratch, model_config(shape, tokenizer), tokenizer, suffix, progress)
        try:
            os.rename(scratch, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _copy_trained(folder: Path, suffix: str, progress: Progress | None) -> None:
    """Write the trained demo: its shipped weights (as variant ``suffix``), config and
    tokenizer, plus the tokenizer files every demo has."""
    config = json.loads((TRAINED / "config.json").read_text(encoding="utf-8"))
    _write_tokenizer(
        folder,
        Tokenizer.from_file(str(TRAINED / "tokenizer.json")),
        config["max_position_embeddings"],
    )
    if not suffix:
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(TRAINED / name, folder / name)
        return
    from mlx_lm.utils import load_model

    model, _ = load_model(TRAINED, lazy=True)
    config = write_weights(folder, model, config, VARIANTS[suffix], progress)
    write_json(folder / "config.json", config)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer trained on the shipped corpus, deterministically.

    Its normaliser and pre-tokeniser are Qwen2's: transformers 5 loads any
    ``qwen2`` checkpoint with its own Qwen2Tokenizer, which rebuilds exactly
    this pipeline around tokenizer.json's vocabulary, so the demo tokenises the
    same with transformers 4 and 5 and with either model type.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def model_config(shape: str | dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """The config.json of ``shape`` (a name in SHAPES, or such a dict for any mlx-lm
    architecture: tests build tiny models of other families this way) for ``tokenizer``."""
    return {
        **(SHAPES[shape] if isinstance(shape, str) else shape),
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id(PAD),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(PAD),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def write_model(
    folder: Path,
    config: dict[str, Any],
    tokenizer: Tokenizer,
    suffix: str = "",
    progress: Progress | None = None,
) -> None:
    """Write an mlx-lm model folder: tokenizer files, config.json, seeded random
    weights (mlx-lm's own initialisation, seed 0) stored as variant ``suffix``, with
    ``progress`` as :func:`~kvchat.engine.models.demo_build.write_weights` gives it."""
    _write_tokenizer(folder, tokenizer, config["max_position_embeddings"])
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))  # lazy: nothing computed yet
    config = write_weights(folder, model, config, VARIANTS[suffix], progress)
    write_json(folder / "config.json", config)


def _write_tokenizer(folder: Path, tokenizer: Tokenizer, max_length: int) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": PAD,
            "unk_token": None,
            "additional_special_tokens": [IM_START, IM_END],
            "model_max_length": max_length,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        folder / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]},
    )
