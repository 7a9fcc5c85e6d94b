"""The CPU fast path: numpy attention, SwiGLU, linear layers and the decoding step match
mlx's own within float32 tolerance, caching stays exact with it, and it can be switched off
per model (16-bit and packed weights: tests/test_stored_weights.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from kvchat.engine import cpu
from kvchat.engine.caches.kinds import make_cache, parse_kind
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.engine.cpu import attention, decode, linear, parallel, quantized_reads
from kvchat.engine.cpu import rope as rope_module
from kvchat.engine.cpu.layers import MLP, Attention, Body
from kvchat.engine.cpu.linear import CpuEmbedding, CpuLinear, CpuOutput

pytestmark = pytest.mark.cpu_only

TOL = 2e-5


@pytest.fixture
def fast_path(demo_model):
    """The demo model's fast path on for a test, whatever the test before left."""
    demo_model.fast_path.on = True
    yield demo_model.fast_path
    demo_model.fast_path.on = True


def masks(length: int, span: int, heads: int):
    keep = mx.random.uniform(shape=(2, 1, length, span)) > 0.3
    keep[..., 0] = True  # every row keeps one key
    return {
        "none": None,
        "causal": "causal",
        "causal array": create_causal_mask(length, span - length),
        "additive per head": mx.random.normal((1, heads, length, span)),
        "bool": keep,
    }


@pytest.mark.parametrize("block", [(attention.BLOCK_FLOATS, attention.BLOCK_ROWS), (3000, 1)])
@pytest.mark.parametrize("ratio", [1, 2, 7])
@pytest.mark.parametrize("length,span", [(1, 1), (1, 300), (6, 6), (44, 500)])
def test_attention_matches_mlx(ratio, length, span, block, threads, monkeypatch):
    """Also in small blocks of query positions (several per call), as long prefills run."""
    monkeypatch.setattr(attention, "BLOCK_FLOATS", block[0])
    monkeypatch.setattr(attention, "BLOCK_ROWS", block[1])
    mx.random.seed(length * 1000 + span + ratio)
    kv_heads = 2
    heads = kv_heads * ratio
    q = mx.random.normal((2, heads, length, 64))
    k = mx.random.normal((2, kv_heads, span, 64))
    v = mx.random.normal((2, kv_heads, span, 64))
    for name, mask in masks(length, span, heads).items():
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = attention.sdpa(q, k, v, 0.125, mask)
        assert got.shape == want.shape and got.dtype == mx.float32, name
        assert mx.allclose(got, want, atol=TOL, rtol=TOL).item(), name


def test_attention_declines_what_it_cannot_take():
    q = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    assert attention.sdpa(q, q, q, 0.125, None) is None
    assert attention.swiglu(q, q) is None


@pytest.fixture(params=[1, 3], ids=["one thread", "three parts"])
def threads(request, monkeypatch):
    """Element-wise work on this thread alone, or in three parts on three threads."""
    monkeypatch.setattr(parallel, "cores", lambda: request.param)
    monkeypatch.setattr(parallel, "MIN_FLOATS", 1)
    return request.param


def test_swiglu_matches_mlx(threads):
    gate = mx.random.normal((3, 5, 100)) * 30  # exp overflows for large negative gates
    x = mx.random.normal((3, 5, 100))
    assert mx.allclose(attention.swiglu(gate, x), nn.silu(gate) * x, atol=1e-5).item()
    one = mx.array([-200.0, 0.5, 3.0])  # one row, fewer items than parts
    assert mx.allclose(attention.swiglu(one, one), nn.silu(one) * one, atol=1e-5).item()


def test_parts_cover_every_item_once():
    assert parallel.bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert parallel.bounds(2, 1) == [(0, 2)]
    assert parallel.run(lambda r: r * 2, [1, 2, 3, 4]) == [2, 4, 6, 8]


def test_loaded_model_gets_kvchat_layers_and_mlx_lm_is_untouched(demo_model, fast_path):
    """kvchat's layers take mlx-lm's places under the same parameter names; mlx-lm's own
    modules and functions stay as mlx-lm made them."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import activations, base, qwen2

    kinds = {type(m) for m in demo_model.model.modules()}
    assert {CpuLinear, CpuEmbedding, Attention, MLP, Body} <= kinds
    assert nn.Linear not in kinds and qwen2.Attention not in kinds
    stock = qwen2.Model(demo_model.model.args)
    assert {k for k, _ in tree_flatten(demo_model.model.parameters())} == {
        k for k, _ in tree_flatten(stock.parameters())
    }
    assert qwen2.scaled_dot_product_attention.__module__ == "mlx_lm.models.base"
    assert qwen2.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert (
        qwen2.swiglu is activations.swiglu and activations.swiglu.__module__ == activations.__name__
    )
    assert type(demo_model.model.model).__call__ is Body.__call__
    assert demo_model.weights == "float32"
    assert demo_model.fast_path.step is None


def logits_of(lm, tokens: list[int], kind: str = "standard") -> mx.array:
    cache = make_cache(lm.model, parse_kind(kind))
    out = lm.model(mx.array(tokens[:-1])[None], cache=cache)
    last = lm.model(mx.array(tokens[-1:])[None], cache=cache)
    return mx.concatenate([out, last], axis=1)


def test_on_and_off_compute_the_same_forward_pass(demo_model, fast_path, monkeypatch):
    tokens = demo_model.tokenizer.encode("The cache keeps keys and values of every token.")
    calls = []
    real = attention.sdpa
    monkeypatch.setattr(attention, "sdpa", lambda *a: calls.append(1) or real(*a))
    fast = logits_of(demo_model, tokens)
    assert calls, "the fast path ran"
    fast_path.on = False
    calls.clear()
    stock = logits_of(demo_model, tokens)
    assert not calls, "switched off, mlx-lm's own attention ran"
    assert mx.allclose(fast, stock, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("kind", ["quantized:8", "quantized:4", "rotated:4"])
def test_quantized_caches_take_numpy_attention(demo_model, fast_path, kind, monkeypatch):
    """Dequantized for numpy's attention (mlx's CPU quantized matmul runs at a few
    GFLOP/s): the logits of a prefill and a decoding step are mlx-lm's quantized
    attention's."""
    tokens = demo_model.tokenizer.encode("Quantized keys and values, read back in full.")
    calls = []
    real = attention.sdpa
    monkeypatch.setattr(attention, "sdpa", lambda *a: calls.append(1) or real(*a))
    logits = {}
    for on in (True, False):
        fast_path.on = on
        cache = make_cache(demo_model.model, parse_kind(kind))  # may probe the model first
        calls.clear()
        prefill = demo_model.model(mx.array(tokens[:-1])[None], cache=cache)
        assert len(calls) == (len(demo_model.model.layers) if on else 0), "every layer, on"
        last = demo_model.model(mx.array(tokens[-1:])[None], cache=cache)
        logits[on] = mx.concatenate([prefill, last], axis=1)
    assert mx.allclose(logits[True], logits[False], atol=1e-4, rtol=1e-4).item()


def decode_run(lm, kind: str, prompt: list[int], forced: list[int]):
    """Logits of each single-token step after ``prompt``: first fed ``forced`` tokens,
    then greedy ones; and the greedy tokens."""
    cache = make_cache(lm.model, parse_kind(kind))
    lm.model(mx.array(prompt)[None], cache=cache)
    steps, greedy, token = [], [], prompt[-1]
    for i in range(len(forced) + 8):
        logits = lm.model(mx.array([[token]]), cache=cache)[0, -1]
        steps.append(logits)
        token = forced[i] if i < len(forced) else int(mx.argmax(logits).item())
        if i >= len(forced):
            greedy.append(token)
    return mx.stack(steps), greedy


@pytest.mark.parametrize(
    "kind", ["standard", "concatenate", "quantized:8", "quantized:4", "rotated:4"]
)
def test_numpy_decoding_step_matches_mlx_lm(demo_model, fast_path, kind, monkeypatch):
    """The whole-model numpy step computes what mlx-lm's modules do, step after step
    (positions move on, the cache grows), and is skipped when the fast path is off."""
    assert isinstance(demo_model.model.model, Body)
    calls = []
    real = decode.hidden
    monkeypatch.setattr(decode, "hidden", lambda *a: calls.append(1) or real(*a))
    prompt = demo_model.tokenizer.encode("Keys and values of every token, cached.")
    forced = [(i * 53) % 200 + 5 for i in range(12)]
    fast, fast_tokens = decode_run(demo_model, kind, prompt, forced)
    assert len(calls) == len(forced) + 8
    fast_path.on = False
    calls.clear()
    stock, stock_tokens = decode_run(demo_model, kind, prompt, forced)
    assert not calls
    assert fast_tokens == stock_tokens
    # A quantized cache rounds each new key and value to its step: numpy's and mlx's,
    # equal to float32's last bits, can round to neighbouring steps, which moves later
    # logits (about 27 at most here) by up to a few hundredths; a key read from the
    # wrong place or position would move them by whole units.
    tolerance = 1e-4 if kind in ("standard", "concatenate") else 5e-2
    assert mx.allclose(fast, stock, atol=tolerance, rtol=1e-4).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_numpy_dequantize_is_mlxs_bit_for_bit(bits, group_size):
    x = mx.random.normal((1, 2, 300, 128)) * 3
    packed = mx.quantize(x, group_size=group_size, bits=bits)
    want = mx.dequantize(*packed, group_size=group_size, bits=bits)
    sliced = tuple(p[..., :257, :] for p in packed)  # as a cache hands them: cut to its offset
    got = quantized_reads.dequantized(sliced, group_size, bits)
    assert got.shape == (2, 257, 128)
    assert np.array_equal(got, np.asarray(want)[0, :, :257])


def test_numpy_decoding_step_from_an_empty_cache(demo_model, fast_path):
    logits = {}
    for on in (True, False):
        fast_path.on = on
        cache = make_cache(demo_model.model, parse_kind("standard"))
        steps = [demo_model.model(mx.array([[t]]), cache=cache) for t in (11, 12, 13)]
        logits[on] = mx.concatenate(steps, axis=1)
        assert cache[0].offset == 3
    assert mx.allclose(logits[True], logits[False], atol=1e-4, rtol=1e-4).item()


def ropes(dims: int, traditional: bool) -> dict:
    """mlx-lm's RoPE variants, as ``initialize_rope`` makes them for llama-family configs."""
    from mlx_lm.models.rope_utils import initialize_rope

    scalings = {
        "default": None,
        "linear": {"type": "linear", "factor": 2.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "yarn": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        "longrope": {
            "rope_type": "longrope",
            "original_max_position_embeddings": 64,
            "short_factor": [1.0] * (dims // 2),
            "long_factor": [1.5] * (dims // 2),
        },
        "dynamic": {"type": "dynamic", "factor": 2.0},
    }
    out = {}
    for name, scaling in scalings.items():
        if name == "longrope" and traditional:
            continue  # always the halves layout
        out[name] = initialize_rope(dims, 10000.0, traditional, scaling, 256)
    return out


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_numpy_rotary_embedding_matches_mlx(traditional, dims):
    """Every RoPE variant's own angles (and factor), at two offsets at once, and at five
    positions from one offset (as a forward pass of five tokens turns them)."""
    x = mx.random.normal((3, 64))
    five = mx.random.normal((5, 3, 64))
    for name, rope in ropes(dims, traditional).items():
        form = rope_module.rope_form(rope)
        assert not isinstance(form, str), name
        tables = rope_module.rotations(
            {(form.key, at, n): (rope, form) for at, n in ((37, 1), (300, 1), (37, 5))}
        )
        for offset in (37, 300):
            cos, sin = tables[form.key, offset, 1]
            got = rope_module.rotate(np.asarray(x), form, cos[0], sin[0])
            want = rope(x[None, :, None], offset=offset).reshape(3, 64)
            assert mx.allclose(mx.array(got), want, atol=1e-5).item(), (name, offset)
        cos, sin = tables[form.key, 37, 5]
        got = rope_module.rotate(np.asarray(five), form, cos[:, None], sin[:, None])
        want = rope(five.transpose(1, 0, 2)[None], offset=37)[0].transpose(1, 0, 2)
        assert mx.allclose(mx.array(got), want, atol=1e-5).item(), (name, "five")


def test_rotation_tables_are_kept_and_sliced_for_each_step():
    """A step's tables are slices of one table kept per RoPE form (made once, grown where
    a step goes past it), with the figures the module gives at those positions."""
    rope = nn.RoPE(32, base=10000.0)
    form = rope_module.rope_form(rope)
    assert not isinstance(form, str)
    far = rope_module.TABLE_STEP * 3 + 5
    got = {
        (offset, count): rope_module.rotations({(form.key, offset, count): (rope, form)})[
            form.key, offset, count
        ]
        for offset, count in ((3, 1), (4, 2), (far, 1))
    }
    assert got[3, 1][0].base is got[4, 2][0].base is not None  # the same kept table
    for (offset, count), (cos, sin) in got.items():
        assert cos.shape == sin.shape == (count, 16)
        assert cos.flags.c_contiguous and sin.flags.c_contiguous
        probe = np.zeros((count, 32), dtype=np.float32)
        probe[:, :16] = 1
        exact = np.asarray(rope(mx.array(probe)[None, None], offset=offset))[0, 0]
        assert np.allclose(cos, exact[:, :16], atol=1e-6), offset
        assert np.allclose(sin, exact[:, 16:], atol=1e-6), offset


def test_numpy_decoding_step_leaves_other_caches_to_mlx_lm(demo_model, fast_path, monkeypatch):
    kinds = ("rotating:64", "chunked:64")
    # made first: making a kind's cache may run the model once on a standard cache
    # (kvchat.engine.caches.fit's probes), which is the numpy step's to take
    caches = {kind: make_cache(demo_model.model, parse_kind(kind)) for kind in kinds}
    calls = []
    monkeypatch.setattr(decode, "hidden", lambda *a: calls.append(1))
    for kind, cache in caches.items():
        demo_model.model(mx.array([[5, 6]]), cache=cache)
        assert demo_model.model(mx.array([[7]]), cache=cache).shape[:2] == (1, 1)
        assert cache[0].offset == 3, kind
    assert not calls
    demo_model.model(mx.array([[7]]), cache=make_cache(demo_model.model, parse_kind("standard")))
    assert calls == [1]


@pytest.mark.parametrize("kind", ["standard", "concatenate", "quantized:8", "rotated:4"])
def test_cached_replies_equal_uncached_with_the_fast_path(demo_model, fast_path, kind):
    settings = GenerationSettings(max_tokens=12)
    session = Session(demo_model, kind=kind, system="Be brief.", settings=settings)
    for text in ["Hello there.", "What is a cache?", "Why is it fast?"]:
        history = [dict(m) for m in session.messages]
        done = [e for e in session.send(text) if isinstance(e, TurnDone)][0]
        fresh = Session(demo_model, kind=kind, settings=settings, messages=history)
        want = [e for e in fresh.send(text) if isinstance(e, TurnDone)][0]
        assert done.reply == want.reply
        if len(history) > 1:
            assert done.stats.reused_tokens > 0


@pytest.mark.parametrize("rows", [1, 5, linear.SKINNY_ROWS, linear.SKINNY_ROWS + 1])
def test_linear_layer_matches_mlx_for_every_row_count(rows, fast_path):
    """One row (gemv), a cached turn's few rows (the weight as the long side) and a
    prefill's many rows take three routes to the same product."""
    mx.random.seed(rows)
    stock = nn.Linear(48, 80)
    layer = CpuLinear(stock.weight, stock.bias, fast_path)
    x = mx.random.normal((1, rows, 48))
    want = x @ layer.weight.T + layer.bias
    got = layer(x)
    assert got.shape == (1, rows, 80)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


def test_output_projection_stays_lazy_for_a_prefill(demo_model, fast_path, monkeypatch):
    """A prefill evaluates only the cache: numpy must not compute its logits; a decoding
    step's rows of one token each are numpy's."""
    calls = []
    real = linear.multiply
    monkeypatch.setattr(linear, "multiply", lambda w, x: calls.append(len(x)) or real(w, x))
    embed = demo_model.model.model.embed_tokens
    assert isinstance(embed, CpuEmbedding)
    rows = mx.random.normal((1, 5, embed.weight.shape[1]))
    assert mx.allclose(embed.as_linear(rows), rows @ embed.weight.T, atol=1e-4).item()
    assert not calls
    batch = mx.random.normal((3, 1, embed.weight.shape[1]))
    assert mx.allclose(embed.as_linear(batch), batch @ embed.weight.T, atol=1e-4).item()
    assert calls == [3]
    stock = nn.Linear(8, 3)
    head = CpuOutput(stock.weight, stock.bias, fast_path)
    one = mx.random.normal((1, 1, 8))
    assert mx.allclose(head(one), one @ head.weight.T + head.bias, atol=1e-5).item()


def test_environment_switch_turns_it_off(tmp_path):
    env = {**os.environ, "KVCHAT_CPU_FASTPATH": "0"}
    script = (
        "import kvchat; from kvchat.engine.models.model import load_model; "
        "lm = load_model('demo'); print(lm.fast_path, lm.weights); "
        "print(lm.fast_path_line()); print(type(lm.model.model.layers[0].self_attn))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "None as stored (CPU fast path off)",
        "off (KVCHAT_CPU_FASTPATH=0)",
        "<class 'kvchat.engine.cpu.layers.Attention'>",  # with mlx's arithmetic: rotated caches
    ]


TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=512,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "llama": {},
    "qwen3": {},
    "gemma2": {
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 8,
    },
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32},
    "phi3": {"rope_scaling": None},
    "starcoder2": {"norm_epsilon": 1e-5},
    "gpt_neox": {
        "layer_norm_eps": 1e-5,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "use_parallel_residual": True,
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_computes_the_same_with_the_fast_path(architecture, fast_path):
    """Tiny random models of mlx-lm's own classes (sliding windows, soft-capping, partial
    rotary, experts): a chunked prefill and a decode step give the stock logits."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    config = {**TINY, **ARCHITECTURES[architecture], "model_type": architecture}
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    fast = cpu.prepare(model)
    assert isinstance(fast, cpu.FastPath)
    assert (fast.step is None) == (architecture == "llama"), fast.step
    tokens = mx.array([[(i * 37) % 500 + 3 for i in range(24)]])
    logits = {}
    for on in (True, False):
        fast.on = on
        cache = make_prompt_cache(model)
        parts = [
            model(tokens[:, :16], cache=cache),
            model(tokens[:, 16:], cache=cache),
            model(mx.array([[7]]), cache=cache),
        ]
        logits[on] = mx.concatenate(parts, axis=1)
    assert mx.allclose(logits[True], logits[False], atol=5e-5, rtol=5e-5).item()


def test_weight_views_are_kept_beside_the_modules_not_in_them():
    """A view is made once per array and made again when the array changes; nothing is
    written into the module (a norm is mlx-lm's own object), and a view goes with its
    module."""
    norm = nn.RMSNorm(8)
    first = linear.param_view(norm)
    assert first is not None and np.array_equal(first, np.ones(8, np.float32))
    assert linear.param_view(norm) is first
    assert set(vars(norm)) == set(vars(nn.RMSNorm(8)))  # no attribute added
    norm.update({"weight": mx.full((8,), 2.0)})
    assert np.array_equal(linear.param_view(norm), np.full(8, 2.0, np.float32))
    half = nn.RMSNorm(8)
    half.set_dtype(mx.bfloat16)
    widened = linear.param_view(half)  # a 16-bit vector: widened once, a float32 copy
    assert widened.dtype == np.float32 and np.array_equal(widened, np.ones(8, np.float32))
    assert linear.param_view(half) is widened
    matrix = nn.Linear(8, 8)
    matrix.set_dtype(mx.bfloat16)
    assert linear.param_view(matrix) is None  # a 16-bit matrix is never widened whole
    key = (id(norm), "weight")
    assert key in linear.VIEWS
    del norm
    gc.collect()
    assert key not in linear.VIEWS
