"""The CPU fast path per model: which models get the numpy decoding step and why not,
mlx-lm's RoPE variants through it, and its batched form (B sequences, one token each,
each with its own caches) against mlx-lm's own step."""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.engine import cpu
from kvchat.engine.caches.kinds import CacheKindError, make_cache, parse_kind
from kvchat.engine.cpu import decode, native, rope
from kvchat.engine.generation.paths import decoding_path
from kvchat.engine.models.model import load_model
from tests.test_cpu_fastpath import TINY  # the same tiny llama-family shape

LLAMA3 = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
}


def tiny(model_type: str, **extra):
    """A random float32 model of mlx-lm's own class, and an untouched twin (same weights)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    args = module.ModelArgs.from_dict({**TINY, **extra, "model_type": model_type})
    mx.random.seed(3)
    model, stock = module.Model(args), module.Model(args)
    model.set_dtype(mx.float32)
    stock.load_weights(tree_flatten(model.parameters()))
    return model, stock


@pytest.fixture(scope="module")
def llama3():
    model, stock = tiny("llama", **LLAMA3)
    fast = cpu.prepare(model)
    assert isinstance(fast, cpu.FastPath) and fast.step is None, fast
    assert type(model.model.layers[0].self_attn.rope).__name__ == "Llama3RoPE"
    return model, stock


def prefilled(model, tokens: list[int], kind: str) -> list:
    cache = make_cache(model, parse_kind(kind))
    model(mx.array(tokens)[None], cache=cache)
    return cache


@pytest.mark.cpu_only
def test_llama3_rope_decodes_through_the_numpy_step(llama3, monkeypatch):
    model, stock = llama3
    calls = []
    real = decode.hidden
    monkeypatch.setattr(decode, "hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = [(i * 29) % 500 + 3 for i in range(40)]
    ours, theirs = prefilled(model, prompt, "standard"), prefilled(stock, prompt, "standard")
    token = 7
    for _ in range(6):
        got = model(mx.array([[token]]), cache=ours)[0, -1]
        want = stock(mx.array([[token]]), cache=theirs)[0, -1]
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
        token = int(mx.argmax(want).item())
    assert len(calls) == 6
    assert ours[0].offset == theirs[0].offset == 46


KINDS = ["standard", "concatenate", "quantized:8", "rotated:4"]


@pytest.mark.cpu_only
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_batched_step_equals_mlx_lm_row_by_row(llama3, rows):
    """B rows of different lengths and cache kinds: logits within 1e-4 of mlx-lm's own
    step on each row's cache (for a rotated cache, which mlx-lm's attention cannot read,
    kvchat's attention with mlx's arithmetic); each cache grows by its row's token, its
    content the single-row numpy step's."""
    model, stock = llama3
    prompts = [[(i * 31 + b * 7) % 500 + 3 for i in range(5 + 9 * b)] for b in range(rows)]
    kinds = [KINDS[b % len(KINDS)] for b in range(rows)]
    tokens = [11 + b for b in range(rows)]
    batched = [prefilled(model, p, k) for p, k in zip(prompts, kinds)]
    single = [prefilled(model, p, k) for p, k in zip(prompts, kinds)]
    model.model.fast.on = False
    try:
        peers = [model if k.startswith("rotated") else stock for k in kinds]
        theirs = [prefilled(m, p, k) for m, p, k in zip(peers, prompts, kinds)]
        wants = [m(mx.array([[t]]), cache=c)[0, -1] for m, t, c in zip(peers, tokens, theirs)]
        mx.eval(wants)
    finally:
        model.model.fast.on = True

    logits = cpu.decode_batch(model, [[t] for t in tokens], batched)
    assert logits.shape == (rows, TINY["vocab_size"]) and logits.dtype == mx.float32
    for b, want in enumerate(wants):
        assert mx.allclose(logits[b], want, atol=1e-4, rtol=1e-4).item(), kinds[b]
        one = cpu.decode_batch(model, [[tokens[b]]], [single[b]])
        assert mx.allclose(one[0], want, atol=1e-4, rtol=1e-4).item(), kinds[b]
        for ours, alone in zip(batched[b], single[b]):
            assert ours.offset == alone.offset == len(prompts[b]) + 1
            assert_same_content(ours, alone)


def assert_same_content(ours, alone) -> None:
    """Keys and values as held (dequantized for a quantized cache: within one step of
    quantization, as numpy's rounding may differ in the last bit before quantizing)."""
    n = ours.offset
    for held_a, held_b in ((ours.keys, alone.keys), (ours.values, alone.values)):
        if hasattr(ours, "bits"):
            packed_a, packed_b = ([p[..., :n, :] for p in held] for held in (held_a, held_b))
            a = mx.dequantize(*packed_a, group_size=ours.group_size, bits=ours.bits)
            b = mx.dequantize(*packed_b, group_size=ours.group_size, bits=ours.bits)
            step = mx.max(packed_a[1]).item()
            assert mx.allclose(a, b, atol=2 * step).item()
        else:
            a, b = held_a[..., :n, :], held_b[..., :n, :]
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()


@pytest.mark.cpu_only
def test_batched_step_declines_and_changes_nothing(llama3):
    model, _ = llama3
    standard = prefilled(model, [5, 6, 7], "standard")
    rotating = prefilled(model, [5, 6, 7], "rotating:64")
    assert cpu.decode_batch(model, [[1], [2]], [standard, rotating]) is None
    assert standard[0].offset == 3 and rotating[0].offset == 3
    fast = model.model.fast
    fast.on = False
    try:
        assert cpu.decode_batch(model, [[1]], [standard]) is None
    finally:
        fast.on = True
    assert standard[0].offset == 3
    assert cpu.decode_batch(model, [[1]], [standard]).shape == (1, TINY["vocab_size"])


@pytest.mark.parametrize(
    "model_type,extra,reason",
    [
        ("gemma2", {"query_pre_attn_scalar": 32}, "model type 'gemma2'"),
        ("qwen3", {}, "model type 'qwen3'"),
        (
            "llama",
            {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
            "layer 1: sliding-window attention",
        ),
    ],
)
def test_models_without_the_numpy_step_say_why(model_type, extra, reason):
    model, stock = tiny(model_type, **extra)
    fast = cpu.prepare(model)
    assert fast.step.startswith(reason), fast.step
    assert fast.describe() == f"on for linear layers only: no numpy decoding step, {fast.step}"
    assert cpu.decode_batch(model, [[1]], [make_cache(model, parse_kind("standard"))]) is None
    tokens = mx.array([[(i * 37) % 500 + 3 for i in range(12)]])
    assert mx.allclose(model(tokens), stock(tokens), atol=5e-5, rtol=5e-5).item()


@pytest.mark.cpu_only
def test_a_packed_mode_no_kernel_reads_stays_mlxs_and_leaves_the_step_out():
    """mxfp4 layers keep mlx-lm's own class and kernels; the model decodes through
    mlx-lm's modules (the same logits as its untouched twin) and says why."""
    model, stock = tiny("llama")
    for m in (model, stock):
        nn.quantize(m, group_size=32, bits=4, mode="mxfp4")
    fast = cpu.prepare(model)
    assert fast.kept == ("mxfp4",)
    assert fast.step == (
        "its mxfp4 layers run on MLX's own kernels (the CPU fast path does not read this mode)"
    )
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    assert cpu.held(model).startswith("mxfp4: MLX's own kernels")
    assert cpu.decode_batch(model, [[1]], [make_cache(model, parse_kind("standard"))]) is None
    tokens = mx.array([[(i * 37) % 500 + 3 for i in range(12)]])
    assert mx.allclose(model(tokens), stock(tokens), atol=1e-4, rtol=1e-4).item()


@pytest.mark.cpu_only
def test_rotated_caches_are_refused_where_attention_cannot_rotate():
    model, _ = tiny("gemma2", query_pre_attn_scalar=32)
    cpu.prepare(model)
    with pytest.raises(
        CacheKindError,
        match=r"'rotated:4' cannot apply to this model: "
        r"layer 0's attention \(Attention\) does not rotate",
    ):
        make_cache(model, parse_kind("rotated:4"))


@pytest.mark.cpu_only
def test_switched_off_a_model_keeps_rotated_caches_with_mlx_arithmetic(demo_model, monkeypatch):
    monkeypatch.setenv(cpu.ENV, "0")
    off = load_model("demo")
    assert off.fast_path is None and off.fast_path_line() == f"off ({cpu.ENV}=0)"
    tokens = demo_model.tokenizer.encode("Rotated keys, read back by mlx's own attention.")
    got = {}
    for lm in (off, demo_model):
        cache = make_cache(lm.model, parse_kind("rotated:4"))
        first = lm.model(mx.array(tokens[:-1])[None], cache=cache)
        last = lm.model(mx.array(tokens[-1:])[None], cache=cache)
        got[lm is off] = mx.concatenate([first, last], axis=1)
    assert mx.allclose(got[True], got[False], atol=1e-4, rtol=1e-4).item()


def test_doctor_names_the_model_and_its_fast_path(demo_model):
    result = CliRunner().invoke(app, ["doctor", "--json", "--model", "demo"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    line, path = report["cpu_fastpath"], report["batch_decoding"]
    if mx.default_device() == mx.cpu:
        assert line == "demo: on (numpy decoding step, attention, SwiGLU and linear layers)"
        assert path == (
            "demo: CPU fast path: its batched numpy step decodes every row at once, each on "
            "its own cache (the model's decoding step runs whole in numpy; "
            f"{native.route()})"  # its phrases: tests/test_fused_kernels.py
        )
    else:
        assert line == "demo: off (MLX runs on the GPU: its own kernels are used)"
        assert path == (
            "demo: MLX: rows merged into mlx-lm's batch caches, one forward pass a step "
            "(CPU fast path off (MLX runs on the GPU: its own kernels are used))"
        )


@pytest.mark.cpu_only
def test_doctor_says_why_a_batch_decodes_through_mlx(demo_model, monkeypatch):
    """With the numpy step switched off, the batch's rows merge into mlx-lm's batch caches."""
    monkeypatch.setattr(demo_model.fast_path, "on", False)
    assert decoding_path(demo_model) == (
        "MLX: rows merged into mlx-lm's batch caches, one forward pass a step "
        "(CPU fast path switched off for this model)"
    )


def test_an_unknown_rope_is_refused_by_name():
    """A RoPE module the step does not know is named in the reason, not computed wrongly."""

    class Unknown:
        pass

    assert rope.rope_form(Unknown()) == "its RoPE (Unknown) is not one the numpy step computes"


@pytest.mark.cpu_only
def test_step_of_several_tokens_a_row_equals_mlx_lm_forward_pass(demo_model):
    """Rows of several tokens (a short prompt joining a decoding step) beside rows of one,
    on caches of different lengths, one of them empty: each row's logits after its last
    token within 1e-4 of mlx-lm's own forward pass of that row's tokens on a twin cache,
    and every cache's keys and values within 1e-5 of the twin's."""
    from mlx_lm.models import qwen2

    model = demo_model.model
    assert demo_model.fast_path.decodes
    stock = qwen2.Model(model.args)
    stock.load_weights(tree_flatten(model.parameters()))
    prompts = [[], [(i * 13) % 200 + 3 for i in range(9)], [(i * 7) % 300 + 5 for i in range(20)]]
    prompts.append([17, 4, 99])
    feeds = [[5, 81, 12, 40, 7], [33], [8, 61, 2, 90, 14, 3, 27], [19, 6]]
    ours = [prefilled(model, p, "standard") if p else make_prompt_cache(model) for p in prompts]
    theirs = [prefilled(stock, p, "standard") if p else make_prompt_cache(stock) for p in prompts]
    wants = [stock(mx.array([f]), cache=c)[0, -1] for f, c in zip(feeds, theirs)]
    mx.eval(wants)

    logits = cpu.decode_batch(model, feeds, ours)
    assert logits.shape == (len(feeds), model.args.vocab_size)
    for b, want in enumerate(wants):
        assert mx.allclose(logits[b], want, atol=1e-4, rtol=1e-4).item(), b
        for mine, twin in zip(ours[b], theirs[b]):
            assert mine.offset == twin.offset == len(prompts[b]) + len(feeds[b])
            assert_same_content(mine, twin)


@pytest.mark.cpu_only
def test_several_tokens_a_row_only_on_a_plain_cache(llama3):
    """A row of several tokens on a cache the step cannot extend by several (quantized
    here) is declined, every cache left as it was."""
    model, _ = llama3
    standard = prefilled(model, [5, 6, 7], "standard")
    quantized = prefilled(model, [5, 6, 7], "quantized:8")
    assert cpu.decode_batch(model, [[1], [2, 3]], [standard, quantized]) is None
    assert [c.offset for c in standard] == [c.offset for c in quantized] == [3] * len(standard)
