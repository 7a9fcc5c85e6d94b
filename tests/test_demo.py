"""The built-in demo model: deterministic files in mlx-lm's format, a working
tokenizer and chat template, and a model that runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from helpers import turn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2
from tokenizers import Tokenizer

from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.engine.models import demo
from kvchat.safety import printable

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Tell me about caches."},
]


def file_hashes(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_build_is_deterministic_across_processes(demo_model, tmp_path):
    """A second build in a fresh process, into another cache dir, gives identical files."""
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path)}
    code = "from kvchat.engine.models.demo import build_demo; print(build_demo('demo'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    other = Path(out.stdout.strip())
    assert other.parent == tmp_path / "models"
    assert file_hashes(other) == file_hashes(demo_model.path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(file_hashes(other))


def test_racing_builds_agree(tmp_path):
    """Two processes building at once both end up with one complete folder."""
    env = {**os.environ, "KVCHAT_CACHE_DIR": str(tmp_path)}
    code = "from kvchat.engine.models.demo import build_demo; print(build_demo('demo'))"
    racers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {racer.communicate()[0].strip() for racer in racers}
    assert [racer.returncode for racer in racers] == [0, 0]
    folder = f"demo-{demo.BUILD_VERSION}"
    assert paths == {str(tmp_path / "models" / folder)}
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [folder]


def test_build_reuses_the_folder_and_leaves_no_scratch(demo_model):
    assert demo.build_demo("demo") == demo_model.path
    assert [p.name for p in demo_model.path.parent.iterdir() if p.name.startswith(".")] == []


def test_special_tokens_are_single_ids(demo_model):
    tokenizer = demo_model.tokenizer
    for token in demo.SPECIAL_TOKENS:
        ids = tokenizer.encode(f"a {token} b", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(token) in ids
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_a_turn_ends_at_im_end_or_a_new_header(demo_model):
    """<|im_start|> is an end token too: a reply never runs into a turn of its own."""
    ids = [demo_model.tokenizer.convert_tokens_to_ids(t) for t in (demo.IM_END, demo.IM_START)]
    assert demo_model.tokenizer.eos_token_ids == set(ids)
    assert json.loads((demo_model.path / "config.json").read_text())["eos_token_id"] == ids


def test_loaded_tokenizer_matches_tokenizer_json(demo_model):
    """transformers may wrap the file in a model-specific class; ids must not change."""
    raw = Tokenizer.from_file(str(demo_model.path / "tokenizer.json"))
    text = "  Hello,  world!\n\nThe café costs 3.50\t<|im_start|>user\n ok<|im_end|> naïve 12345"
    ids = demo_model.tokenizer.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text).ids
    assert demo_model.tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(demo_model):
    text = demo_model.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello there.<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n"
        "<|im_start|>user\nTell me about caches.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = demo_model.tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == without + "<|im_start|>assistant\n"
    ids = demo_model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == demo_model.tokenizer.encode(text, add_special_tokens=False)


def test_loads_with_mlx_lm_and_runs(demo_model):
    model, tokenizer = mlx_lm.load(str(demo_model.path))
    params = dict(tree_flatten(model.parameters()))
    assert {p.dtype for p in params.values()} == {mx.float32}
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(tokenizer.vocab))
    assert logits.shape[-1] == demo.VOCAB_SIZE
    assert mx.isfinite(logits).all().item()


def test_parse_demo_spec():
    assert demo.parse_demo_spec("demo") == "demo"
    assert demo.parse_demo_spec("demo:qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert demo.parse_demo_spec("mlx-community/Qwen2.5-0.5B-Instruct-4bit") is None
    assert demo.parse_demo_spec("./demo") is None
    assert demo.parse_demo_spec("demo@bf16") == "demo@bf16"
    assert demo.parse_demo_spec("demo:qwen2.5-0.5b@q4") == "qwen2.5-0.5b@q4"
    with pytest.raises(ValueError, match="demo:llama-3.2-1b"):
        demo.parse_demo_spec("demo:gpt-5")
    with pytest.raises(ValueError, match="@bf16"):
        demo.parse_demo_spec("demo@f16")


TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.mark.parametrize("suffix", ["bf16", "q4", "q8"])
def test_a_variant_holds_the_seeded_weights_as_mlx_stores_them(suffix, tmp_path):
    """A variant is written a layer at a time from the lazily initialised model: what
    mlx_lm.load reads back equals that model cast to bfloat16 (and, packed, what
    mx.quantize gives it), and no file holds a float32 array."""
    tokenizer = demo.train_tokenizer()
    config = {**demo.model_config("qwen2.5-0.5b", tokenizer), **TINY}
    demo.write_model(tmp_path, config, tokenizer, suffix)
    model, _ = mlx_lm.load(str(tmp_path))
    got = dict(tree_flatten(model.parameters()))
    mx.random.seed(0)
    arch = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    want = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(arch.parameters())}
    bits = demo.VARIANTS[suffix].bits
    for key, value in want.items():
        name = key.removesuffix(".weight")
        if bits and value.ndim == 2:
            packed = dict(zip(["weight", "scales", "biases"], mx.quantize(value, 64, bits)))
            for part, array in packed.items():
                assert mx.array_equal(got[f"{name}.{part}"], array), f"{name}.{part}"
        else:
            assert got[key].dtype == mx.bfloat16 and mx.array_equal(got[key], value), key
    files = [mx.load(str(f)) for f in tmp_path.glob("*.safetensors")]
    assert {v.dtype for f in files for v in f.values()} == (
        {mx.uint32, mx.bfloat16} if bits else {mx.bfloat16}
    )
    quantization = json.loads((tmp_path / "config.json").read_text()).get("quantization")
    assert quantization == ({"group_size": 64, "bits": bits, "mode": "affine"} if bits else None)


@pytest.mark.parametrize("suffix", ["", "q4"])
def test_a_build_says_first_the_bytes_it_writes_then_how_far_it_is(suffix, tmp_path):
    """Before it computes a layer, a build says how many bytes its weights take (from the
    lazy model: the shape and the variant); that is what the files hold, within 3% (their
    headers); then it counts the layers written."""
    from kvchat.engine.models.demo_build import stored
    from kvchat.units import human_bytes

    tokenizer = demo.train_tokenizer()
    config = {**demo.model_config("qwen2.5-0.5b", tokenizer), **TINY}
    calls: list[tuple[int, int, str, int]] = []  # and the weight files there were then

    def progress(done: int, total: int, what: str) -> None:
        calls.append((done, total, what, len(list(tmp_path.glob("*.safetensors")))))

    demo.write_model(tmp_path, config, tokenizer, suffix, progress)
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    mx.random.seed(0)
    weights, _ = stored(
        qwen2.Model(qwen2.ModelArgs.from_dict(config)), config, demo.VARIANTS[suffix]
    )
    announced = sum(value.nbytes for value in weights.values())
    assert announced <= on_disk < 1.03 * announced, (announced, on_disk)
    size = human_bytes(announced)
    assert calls == [
        (0, 2, f"layers written, 0 B of {size}", 0),
        (1, 2, calls[1][2], 0),
        (2, 2, f"layers written, {size} of {size}", 1),
    ]
    assert calls[1][2].startswith("layers written, ") and calls[1][2].endswith(f" of {size}")


BUILD = """
import sys, resource
from pathlib import Path
from kvchat.engine.models import demo
tokenizer = demo.train_tokenizer()
config = {**demo.model_config("qwen2.5-0.5b", tokenizer), **MEDIUM}
demo.write_model(Path(sys.argv[1]), config, tokenizer, "q4")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
# about 1 GB of float32 weights (243M), 0.14 GB at 4 bits
MEDIUM = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def test_a_packed_variant_is_built_in_a_fraction_of_its_float32_size(tmp_path):
    """The writer holds a layer in float32 at a time, never the model: building a 4-bit
    variant peaks well below the float32 model's size (the process itself included)."""
    code = BUILD.replace("MEDIUM", repr(MEDIUM))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    peak = int(out.stdout.split()[-1])
    model, _ = mlx_lm.load(str(tmp_path))
    float32 = 4 * sum(
        m.weight.size * 32 // m.bits if "scales" in m else m.weight.size
        for _, m in model.named_modules()
        if "weight" in m
    )
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert float32 > 0.95e9 and on_disk < 0.15 * float32
    assert peak < 0.5 * float32, f"{peak / 1e9:.2f} GB at peak for {float32 / 1e9:.2f} GB"


@pytest.mark.parametrize(
    "name", ["qwen2.5-0.5b", "llama-3.2-1b", "qwen3-0.35b", "qwen3-moe-2b", "qwen2.5-3b"]
)
def test_big_shapes_load_in_mlx_lm(name, tmp_path):
    """The shape-true configs are valid for mlx-lm: a one-layer copy builds and loads."""
    tokenizer = demo.train_tokenizer()
    config = {**demo.model_config(name, tokenizer), "num_hidden_layers": 1}
    demo.write_model(tmp_path, config, tokenizer)
    model, _ = mlx_lm.load(str(tmp_path))
    assert len(model.layers) == 1
    assert model.args.hidden_size == demo.SHAPES[name]["hidden_size"]
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, demo.VOCAB_SIZE)
    assert mx.isfinite(logits).all().item()


@pytest.mark.parametrize(
    "text", ["Hello!", "What should I pack for a trip?", "Tell me about bread."]
)
def test_the_trained_demo_writes_corpus_words(demo_model, text):
    """A turn on the trained demo gives printable text (no U+FFFD) made of the corpus's words,
    and ends its turn by itself."""
    session = Session(demo_model, settings=GenerationSettings(max_tokens=200))
    done = turn(session, text)
    reply = done.reply
    assert "\ufffd" not in reply and printable(reply) == reply
    assert done.tokens[-1] in demo_model.tokenizer.eos_token_ids, "it stopped by itself"
    words = re.findall(r"[a-z']+", reply.lower())
    known = set(re.findall(r"[a-z']+", demo.CORPUS.read_text(encoding="utf-8").lower()))
    assert len(words) >= 4, reply
    assert sum(w in known for w in words) >= 0.9 * len(words), reply


def test_a_follow_up_after_a_whole_reply_evaluates_only_new_tokens(demo_model):
    """Replies end with an end token and re-render to the tokens generated, so each
    follow-up evaluates just the new message and the template around it."""
    session = Session(demo_model, system="Be brief.", settings=GenerationSettings(max_tokens=200))
    turn(session, "Hello!")
    for text in ["Why is the sky blue?", "Thanks, that is really useful."]:
        before = list(session.ledger)
        done = turn(session, text)
        prompt = session.render(session.messages[:-1], True)
        previous = session.render(session.messages[:-2], False)  # up to the last reply's end
        assert prompt[: len(before)] == before
        assert done.stats.reused_tokens == len(before)
        assert done.stats.evaluated_tokens == len(prompt) - len(before)
        # all of the previous reply was reused: at most its closing <|im_end|>\n was not in
        # the cache yet (the end token is sampled, not fed)
        assert previous[: len(before)] == before and len(previous) - len(before) <= 2
        assert done.stats.generated_tokens < 200 and done.stats.rebuilt is None
