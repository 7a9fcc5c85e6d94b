"""Weights as stored on the CPU: packed (4- and 8-bit) and bfloat16 models keep the arrays
``mlx_lm.load`` made (no float32 copy), compute through the fast path in float32 (their
activations and KV caches float32), match MLX's own forward, and cache exactly: cached =
uncached, resumed from disk = live, a batch of 8 = each alone, token for token."""

from __future__ import annotations

import importlib
import json
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import convert
from mlx_lm.models import qwen2
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwitchLinear
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine import cpu
from kvchat.engine.caches.kinds import make_cache, parse_kind
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.engine.cpu import decode, linear, native, stored
from kvchat.engine.generation.per_model import core_for
from kvchat.engine.models.model import load_model
from tests.helpers import start_together, turn
from tests.test_cpu_fastpath import ARCHITECTURES, TINY

pytestmark = pytest.mark.cpu_only

VARIANTS = ("q4", "q8", "bf16")
GREEDY = GenerationSettings(max_tokens=10, temp=0.0, ignore_eos=True)
PROMPT = "The cache keeps keys and values of every token."
FORCED = [(i * 53) % 200 + 5 for i in range(8)]


@pytest.fixture(scope="module")
def variants(demo_model, tmp_path_factory):
    """The demo's 4-bit, 8-bit (bfloat16 scales) and bfloat16 copies, and a 4-bit copy with
    float32 scales (``mlx_lm.convert`` of the float32 demo), each loaded as a user's model
    is."""
    folder = tmp_path_factory.mktemp("stored") / "q4-f32"
    convert(str(demo_model.path), str(folder), quantize=True, q_bits=4, q_group_size=64)
    models = {name: load_model(f"demo@{name}") for name in VARIANTS}
    models["q4-f32"] = load_model(str(folder))
    for lm in models.values():
        assert isinstance(lm.fast_path, cpu.FastPath) and lm.fast_path.step is None
    return models


@pytest.fixture
def on(variants):
    """Every variant's fast path on for a test, whatever the test before left."""
    yield
    for lm in variants.values():
        lm.fast_path.on = True


@pytest.mark.parametrize("name", [*VARIANTS, "q4-f32"])
def test_loaded_weights_are_the_files_arrays_never_float32(variants, name):
    """Every parameter the layers hold has the dtype and shape the checkpoint stores (the
    packed uint32 arrays and their scales, or bfloat16): no float32 copy of a packed or
    16-bit weight, before and after computing; and kvchat's layers hold them."""
    lm = variants[name]
    files = sorted(lm.path.glob("model*.safetensors"))
    saved = {k: (v.dtype, v.shape) for f in files for k, v in mx.load(str(f)).items()}

    def held():
        return {k: (v.dtype, v.shape) for k, v in tree_flatten(lm.model.parameters())}

    assert held() == saved
    floats = {dtype for dtype, _ in saved.values() if dtype != mx.uint32}
    assert floats == ({mx.float32} if name == "q4-f32" else {mx.bfloat16})
    packed = name.startswith("q")
    kinds = {type(m) for m in lm.model.modules()}
    if packed:
        assert {linear.CpuQuantizedLinear, linear.CpuQuantizedEmbedding} <= kinds
        assert {dtype for k, (dtype, _) in saved.items() if k.endswith(".weight")} >= {mx.uint32}
    else:
        assert {linear.CpuLinear, linear.CpuEmbedding} <= kinds
    assert not kinds & {nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding}
    session = Session(lm, settings=GREEDY)
    turn(session, "Hello there.")
    assert held() == saved
    assert {c.keys.dtype for c in session.cache} == {mx.float32}  # activations float32


def test_16_bit_norms_and_embeddings_give_float32(variants):
    """A bfloat16 model's embedding rows come widened, exactly, and its norms promote: a
    prefill through the fast path leaves float32 keys and values in the cache."""
    lm = variants["bf16"]
    embed = lm.model.model.embed_tokens
    ids = mx.array([[3, 17, 2047]])
    rows = embed(ids)
    assert rows.dtype == mx.float32
    assert mx.array_equal(rows, embed.weight[ids].astype(mx.float32)).item()
    cache = make_cache(lm.model, parse_kind("standard"))
    lm.model(mx.array(lm.tokenizer.encode(PROMPT))[None], cache=cache)
    assert {(c.keys.dtype, c.values.dtype) for c in cache} == {(mx.float32, mx.float32)}


def float32_twin(lm) -> nn.Module:
    """mlx-lm's own model holding ``lm``'s weights as float32 values (packed ones through
    ``mx.dequantize``, its scales and biases widened first): the reference in float32."""
    flat = dict(tree_flatten(lm.model.parameters()))
    wide = {}
    for name, value in flat.items():
        layer, _, kind = name.rpartition(".")
        if kind != "bias" and flat.get(f"{layer}.weight", value).dtype == mx.uint32:
            if kind in ("scales", "biases"):
                continue
            module = dict(lm.model.named_modules())[layer]
            scales, biases = (flat[f"{layer}.{p}"].astype(mx.float32) for p in ("scales", "biases"))
            value = mx.dequantize(
                value, scales, biases, group_size=module.group_size, bits=module.bits
            )
        wide[name] = value.astype(mx.float32)
    twin = qwen2.Model(lm.model.args)
    twin.load_weights(list(wide.items()))
    return twin


def forced_run(model: nn.Module, tokens: list[int]) -> mx.array:
    """The logits of a prefill of ``tokens`` then of each FORCED token, one a step."""
    cache = make_cache(model, parse_kind("standard"))
    steps = [model(mx.array(tokens)[None], cache=cache)]
    steps += [model(mx.array([[t]]), cache=cache) for t in FORCED]
    return mx.concatenate(steps, axis=1)


@pytest.mark.parametrize("name", [*VARIANTS, "q4-f32"])
def test_fast_path_computes_what_mlx_computes_in_float32(variants, on, name, monkeypatch):
    """The numpy decoding step and kvchat's layers on weights as stored give the logits of
    mlx-lm's own modules holding the same values in float32, step after step."""
    lm = variants[name]
    calls = []
    real = decode.hidden
    monkeypatch.setattr(decode, "hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = lm.tokenizer.encode(PROMPT)
    got = forced_run(lm.model, tokens)
    assert len(calls) == len(FORCED)  # every single-token step was the numpy step's
    assert got.dtype == mx.float32
    want = forced_run(float32_twin(lm), tokens)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_packed_decoding_step_equals_mlxs_own_forward(variants, on):
    """With float32 scales MLX's own packed forward (the fast path switched off:
    ``quantized_matmul``, mx.dequantize for the embedding) computes in float32 too: the
    same logits, and the same greedy tokens."""
    lm = variants["q4-f32"]
    tokens = lm.tokenizer.encode(PROMPT)
    fast = forced_run(lm.model, tokens)
    lm.fast_path.on = False
    stock = forced_run(lm.model, tokens)
    assert stock.dtype == mx.float32
    assert mx.allclose(fast, stock, atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(mx.argmax(fast, -1), mx.argmax(stock, -1)).item()


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_replies_equal_uncached_and_resume_from_disk(variants, on, home, name):
    """Each turn's greedy reply on the cache the conversation built equals a fresh
    session's over the same history; a session saved and loaded again continues as the
    live one does, from its cache."""
    lm = variants[name]
    session = Session(lm, system="Be brief.", settings=GREEDY)
    for text in ["Hello there.", "What is a cache?"]:
        history = [dict(m) for m in session.messages]
        done = turn(session, text)
        fresh = Session(lm, settings=GREEDY, messages=history)
        want = turn(fresh, text)
        assert done.tokens == want.tokens and len(done.tokens) == GREEDY.max_tokens
        assert len(history) == 1 or done.stats.reused_tokens > 0
    store.save(session, f"stored-{name}")
    loaded = store.load(f"stored-{name}", lm)
    assert loaded.resumed_from_disk and loaded.notice is None
    resumed, live = turn(loaded.session, "Why is it fast?"), turn(session, "Why is it fast?")
    assert resumed.tokens == live.tokens
    assert resumed.stats.rebuilt is None and resumed.stats.reused_tokens > 0


QUESTIONS = ["What is a cache?", "Tell me about the sea.", "Why is the sky blue?", "Hi."]


@pytest.mark.parametrize("name", VARIANTS)
def test_a_batch_of_eight_equals_each_alone(variants, on, name, monkeypatch):
    """Eight conversations decoding together through one generation core (the batched
    numpy step, the weights read once for all rows) reply token for token as each alone."""
    lm = variants[name]
    rows = []
    real = decode.hidden
    monkeypatch.setattr(
        decode, "hidden", lambda b, t, *a, **k: rows.append(len(t)) or real(b, t, *a, **k)
    )
    texts = QUESTIONS * 2
    alone = [turn(Session(lm, settings=GREEDY), t) for t in texts]
    sessions = [Session(lm, settings=GREEDY) for _ in texts]
    together: list = [None] * len(texts)

    def run(i: int) -> None:
        together[i] = turn(sessions[i], texts[i])

    core = core_for(lm)
    start_together(core, [threading.Thread(target=run, args=(i,)) for i in range(len(texts))])
    assert max(rows) == len(texts)  # the numpy step took all eight rows at once
    for one, many in zip(alone, together):
        assert many.tokens == one.tokens
        assert many.stats.batch_size == len(texts)


def test_doctor_and_the_model_say_how_the_weights_are_held(variants):
    kernels = stored.kernels()
    assert variants["q4"].weights == f"4-bit, groups of 64, kept packed, {kernels}"
    assert variants["q8"].weights == f"8-bit, groups of 64, kept packed, {kernels}"
    assert variants["bf16"].weights == f"bfloat16, kept as stored, {kernels}"
    # the sidebar's few words (80 columns)
    assert [variants[v].weights_brief for v in ("q4", "q8", "bf16")] == [
        "4-bit packed",
        "8-bit packed",
        "bfloat16",
    ]
    result = CliRunner().invoke(app, ["doctor", "--json", "--model", "demo@q4"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["weights"] == f"demo@q4: 4-bit, groups of 64, kept packed, {kernels}"
    assert report["cpu_fastpath"] == (
        "demo@q4: on (numpy decoding step, attention, SwiGLU and linear layers)"
    )


def test_a_decoding_step_never_widens_a_whole_weight(variants, on, monkeypatch):
    """Where the native kernels are built, a decoding step reads packed weights in place:
    no weight row is widened in memory (the numpy tiles are the prompt's route)."""
    if native.module("packed") is None:
        pytest.skip("kvchat's native packed kernels were not built (or KVCHAT_NATIVE=0)")
    lm = variants["q4"]
    cache = make_cache(lm.model, parse_kind("standard"))
    lm.model(mx.array(lm.tokenizer.encode(PROMPT))[None], cache=cache)
    widened = []
    monkeypatch.setattr(stored.Stored, "widened", lambda *a: widened.append(a) or None)
    logits = lm.model(mx.array([[5]]), cache=cache)
    assert logits.shape[:2] == (1, 1) and not widened


def test_a_lone_short_prompt_never_reaches_mlxs_packed_head(variants, on, monkeypatch):
    """A short prompt goes whole into the numpy step, alone as in a batch: its logits are
    the last token's, through numpy; MLX's quantized_matmul never multiplies by the tied
    output projection (3 GFLOP/s on the CPU)."""
    lm = variants["q4"]
    calls = []
    real = nn.QuantizedEmbedding.as_linear
    monkeypatch.setattr(nn.QuantizedEmbedding, "as_linear", lambda *a: calls.append(1) or real(*a))
    done = turn(Session(lm, settings=GREEDY), "Hello there.")
    assert len(done.tokens) == GREEDY.max_tokens and not calls


def test_embedding_rows_are_dequantized_as_mlx_does(variants):
    """A packed embedding's lookup: the rows mx.dequantize gives, in float32."""
    embed = variants["q4-f32"].model.model.embed_tokens
    ids = np.array([[0, 5, 2047], [9, 9, 1]])
    got = embed(mx.array(ids))
    want = mx.dequantize(
        embed.weight[mx.array(ids)],
        embed.scales[mx.array(ids)],
        embed.biases[mx.array(ids)],
        group_size=embed.group_size,
        bits=embed.bits,
    )
    assert got.dtype == mx.float32 and mx.allclose(got, want, atol=1e-6).item()


@pytest.mark.parametrize("form", ["bf16", "q4"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_computes_in_float32_on_weights_as_stored(architecture, form):
    """Tiny random models of mlx-lm's own classes with bfloat16 weights, or 4-bit ones
    with bfloat16 scales: through kvchat's layers (the numpy step where the model has
    one) a chunked prefill and a decoding step give the logits of a twin holding the same
    values widened to float32, and leave float32 keys in the cache."""
    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    args = module.ModelArgs.from_dict(
        {**TINY, **ARCHITECTURES[architecture], "model_type": architecture}
    )
    mx.random.seed(0)
    model, twin = module.Model(args), module.Model(args)
    model.set_dtype(mx.bfloat16)
    if form == "q4":
        for m in (model, twin):
            nn.quantize(m, group_size=32, bits=4)
    twin.load_weights(tree_flatten(model.parameters()))
    twin.set_dtype(mx.float32)  # floats widened exactly; packed weights stay packed
    fast = cpu.prepare(model)
    assert isinstance(fast, cpu.FastPath) and not fast.kept
    tokens = mx.array([[(i * 37) % 500 + 3 for i in range(24)]])
    logits = {}
    for name, m in (("ours", model), ("twin", twin)):
        cache = make_prompt_cache(m)
        parts = [m(tokens[:, :16], cache=cache), m(tokens[:, 16:], cache=cache)]
        logits[name] = mx.concatenate([*parts, m(mx.array([[7]]), cache=cache)], axis=1)
        if name == "ours":
            keys = [c.keys for c in cache if isinstance(getattr(c, "keys", None), mx.array)]
            assert keys and {k.dtype for k in keys} == {mx.float32}
    assert logits["ours"].dtype == mx.float32
    assert mx.allclose(logits["ours"], logits["twin"], atol=5e-5, rtol=5e-5).item()


def test_the_weights_line_counts_every_form_and_the_experts():
    """A mixture of experts whose experts alone are packed: the line names both forms, the
    one holding most bytes first."""
    module = importlib.import_module("mlx_lm.models.qwen3_moe")
    args = module.ModelArgs.from_dict(
        {**TINY, **ARCHITECTURES["qwen3_moe"], "model_type": "qwen3_moe"}
    )
    model = module.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(
        model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, SwitchLinear)
    )
    assert isinstance(cpu.prepare(model), cpu.FastPath)
    assert cpu.held(model) == (
        f"bfloat16, kept as stored (also 4-bit, groups of 32, kept packed), {stored.kernels()}"
    )
