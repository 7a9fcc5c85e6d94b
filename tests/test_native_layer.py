"""Whole decoder layers in one native call (packed.c's ``layer``, layer.h): the numpy step
takes it for models whose matrices the packed kernels read, rows on plain caches; each
row's logits and new keys and values are mlx-lm's own, a row's figures do not depend on
the rows beside it, and bad arguments are refused in a sentence."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvchat.engine import cpu
from kvchat.engine.cpu import decode, native, step_weights
from tests.test_cpu_batch import LLAMA3, assert_same_content, prefilled, tiny

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.skipif(native.module("packed") is None, reason="the native kernels were not built"),
]

SHAPES = {
    "llama3-rope": ("llama", LLAMA3),
    "traditional-rope": ("llama", {"rope_traditional": True}),
    "qwen2-biases": ("qwen2", {}),
}


def packed_twins(model_type: str, bits: int, **extra):
    """A tiny model of mlx-lm's class with its matrices packed (``nn.quantize``, float32
    scales) and the fast path, and its untouched twin holding the same packed arrays, which
    mlx computes in float32 too."""
    model, stock = tiny(model_type, **extra)
    for m in (model, stock):
        nn.quantize(m, group_size=32, bits=bits)
    fast = cpu.prepare(model)
    assert isinstance(fast, cpu.FastPath) and fast.step is None, fast
    return model, stock


@pytest.fixture
def whole_calls(monkeypatch):
    """Each whole-layer call's (layers, rows), one entry a call."""
    calls: list[tuple[int, int]] = []
    real = decode._whole

    def spy(packed, run, *rest):
        calls.append((len(run), len(run[0][3])))  # run[0][3]: the first layer's caches
        return real(packed, run, *rest)

    monkeypatch.setattr(decode, "_whole", spy)
    return calls


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_whole_layers_decode_as_mlx_lm(shape, bits, whole_calls):
    """Rows of different lengths, one of several new tokens (a short prompt joining the
    step), one on an empty cache: two steps through the whole-layer call give mlx-lm's own
    logits within 1e-4 and its keys and values within 1e-5, each cache grown by its
    row's tokens."""
    model_type, extra = SHAPES[shape]
    model, stock = packed_twins(model_type, bits, **extra)
    layers = len(model.model.layers)
    prompts = [[(i * 13) % 400 + 3 for i in range(14)], [], [(i * 7) % 300 + 5 for i in range(5)]]
    ours = [prefilled(model, p, "standard") if p else make_prompt_cache(model) for p in prompts]
    theirs = [prefilled(stock, p, "standard") if p else make_prompt_cache(stock) for p in prompts]
    for feeds in ([[7], [3, 9, 12, 40], [5]], [[11], [2], [60]]):
        wants = [stock(mx.array([f]), cache=c)[0, -1] for f, c in zip(feeds, theirs)]
        mx.eval(wants)
        whole_calls.clear()
        logits = cpu.decode_batch(model, feeds, ours)
        assert whole_calls == [(layers, len(feeds))]  # every layer and row in one call
        for b, want in enumerate(wants):
            assert mx.allclose(logits[b], want, atol=1e-4, rtol=1e-4).item(), b
            for mine, twin in zip(ours[b], theirs[b]):
                assert mine.offset == twin.offset
                assert_same_content(mine, twin)
    assert [c[0].offset for c in ours] == [16, 5, 7]


def test_a_row_gets_the_same_figures_whatever_rows_are_beside_it(whole_calls):
    """Three rows decoded together, then each alone on a copy of its cache: the same
    logits bit for bit, and the same new keys and values. The longest row's attention
    reads enough to go over the cores alone (attend.h's SPREAD_AWAKE), the shorter rows'
    only beside it."""
    model, _ = packed_twins("qwen2", 4)
    prompts = [[(i * 11 + 3 * b) % 400 + 3 for i in range(n)] for b, n in enumerate((4, 13, 300))]
    tokens = [[21], [8], [99]]
    together = [prefilled(model, p, "standard") for p in prompts]
    alone = [prefilled(model, p, "standard") for p in prompts]
    batched = np.asarray(cpu.decode_batch(model, tokens, together))
    assert whole_calls == [(2, 3)]
    for b in range(3):
        one = np.asarray(cpu.decode_batch(model, [tokens[b]], [alone[b]]))
        assert np.array_equal(batched[b], one[0]), b
        for mine, single in zip(together[b], alone[b]):
            n = mine.offset
            assert np.array_equal(
                np.asarray(mine.keys[..., :n, :]), np.asarray(single.keys[..., :n, :])
            )
            assert np.array_equal(
                np.asarray(mine.values[..., :n, :]), np.asarray(single.values[..., :n, :])
            )


def test_a_cache_left_strided_by_its_prompt_changes_no_other_row(whole_calls):
    """A prompt of exactly 256 tokens in one piece fills the cache's first buffer, and
    mlx-lm's KVCache then holds the values as the update came, strided (keys too, where
    no RoPE copied them). The step reads such a cache as a contiguous copy, in the one
    native call with the others: the rows beside it get the figures they get alone, bit
    for bit (the step went layer by layer for the whole batch before: 2e-6 off), and the
    strided row's own are mlx-lm's."""
    model, stock = packed_twins("qwen2", 4)
    prompts = [[(i * 11) % 400 + 3 for i in range(256)], [(i * 7) % 300 + 5 for i in range(40)]]
    together = [prefilled(model, p, "standard") for p in prompts]
    assert not all(np.asarray(c.values).flags.c_contiguous for c in together[0])
    alone = prefilled(model, prompts[1], "standard")
    twin = prefilled(stock, prompts[0], "standard")
    whole_calls.clear()
    batched = np.asarray(cpu.decode_batch(model, [[21], [8]], together))
    assert whole_calls == [(len(model.model.layers), 2)]
    assert np.array_equal(batched[1], np.asarray(cpu.decode_batch(model, [[8]], [alone]))[0])
    want = stock(mx.array([[21]]), cache=twin)[0, -1]
    assert mx.allclose(mx.array(batched[0]), want, atol=1e-4, rtol=1e-4).item()
    assert together[0][0].offset == 257


def test_a_row_on_a_quantized_cache_keeps_the_layer_by_layer_step(whole_calls):
    """The native call reads plain caches; a row on a quantized cache goes layer by layer
    through numpy and the attention kernel, apart from the plain row, which keeps its call:
    each gets mlx-lm's figures."""
    model, stock = packed_twins("llama", 4, **LLAMA3)
    prompt = [(i * 5) % 400 + 3 for i in range(9)]
    kinds = ["standard", "quantized:8"]
    ours = [prefilled(model, prompt, k) for k in kinds]
    theirs = [prefilled(stock, prompt, k) for k in kinds]
    wants = [stock(mx.array([[4]]), cache=c)[0, -1] for c in theirs]
    whole_calls.clear()  # (the plain cache's prompt went through it)
    logits = cpu.decode_batch(model, [[4], [4]], ours)
    assert whole_calls == [(len(model.model.layers), 1)]
    for got, want in zip(logits, wants):
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


# the row beside a decoding row: its cache kind, its new tokens, and the whole-layer call
# the decoding row gets (layers, rows): alone, or with the short prompt (21 tokens)
BESIDE = {
    "quantized:8": ("quantized:8", 1, 1),
    "a prompt of 20 tokens": ("standard", 20, 2),
    "300 tokens": ("standard", 300, 1),
}


@pytest.mark.parametrize("beside", BESIDE)
def test_a_row_keeps_the_whole_layer_call_whatever_rows_are_beside_it(beside, whole_calls):
    """A decoding row beside a row the whole-layer call cannot take with it (a quantized
    cache; more new tokens than its products take together, as a short prompt folded
    into the step makes) gets its call all the same, in a step of its own rows: its
    figures are the ones it gets alone, bit for bit (3e-6 off when the whole step went
    layer by layer)."""
    model, _ = packed_twins("qwen2", 4)
    prompt = [(i * 7) % 300 + 5 for i in range(40)]
    other = [(i * 11) % 400 + 3 for i in range(30)]
    kind, n, rows = BESIDE[beside]
    fed = [(i * 3) % 200 + 4 for i in range(n)]
    together = [prefilled(model, other, kind), prefilled(model, prompt, "standard")]
    alone = prefilled(model, prompt, "standard")
    whole_calls.clear()
    batched = np.asarray(cpu.decode_batch(model, [fed, [8]], together))
    assert whole_calls == [(len(model.model.layers), rows)]
    assert np.array_equal(batched[1], np.asarray(cpu.decode_batch(model, [[8]], [alone]))[0])
    assert together[0][0].offset == 30 + len(fed) and together[1][0].offset == 41


def test_float32_matrices_keep_their_own_kernels():
    """A float32 model's layers go through rows.c and BLAS (their products' own routes),
    not the packed kernels' whole-layer call."""
    model, _ = tiny("llama")
    cpu.prepare(model)
    read = step_weights.gather(model.model, [])
    assert read is not None and all(layer.whole is None for layer in read.layers)


def test_the_step_reads_new_weights_when_a_layer_gets_them():
    """What the step reads is made once a model and kept while its modules hold the same
    arrays: a layer given a new packed matrix, or a norm a new weight, is read anew."""
    model, _ = packed_twins("qwen2", 4)
    first = step_weights.gather(model.model, [])
    assert step_weights.gather(model.model, []) is first
    down = model.model.layers[1].mlp.down_proj
    down.update({"weight": down.weight ^ mx.array(0x11111111, dtype=mx.uint32)})
    second = step_weights.gather(model.model, [])
    assert second is not first
    held = second.layers[1].whole.matrices[6][0]
    assert np.array_equal(held, np.asarray(down.weight))
    assert not np.array_equal(held, first.layers[1].whole.matrices[6][0])
    norm = model.model.layers[0].post_attention_layernorm
    norm.weight = norm.weight * 2
    third = step_weights.gather(model.model, [])
    assert np.array_equal(third.layers[0].mlp_norm[0], 2 * second.layers[0].mlp_norm[0])
    assert step_weights.gather(model.model, []) is third


def test_bad_arguments_are_refused_in_a_sentence():
    """Matrices of the wrong shapes or count, new keys of the wrong shape, in any layer of
    a call: ValueError, and x unchanged (no layer ran)."""
    model, _ = packed_twins("qwen2", 4)
    read = step_weights.gather(model.model, [])
    attn = model.model.layers[0].self_attn
    x = np.ones((1, 128), dtype=np.float32)
    before = x.copy()
    cos = np.ones((1, 16), dtype=np.float32)
    kernels = native.module("packed")

    def spec(layer, matrices=None, biases=None, new_k=None):
        whole = layer.whole
        return (
            whole.matrices if matrices is None else matrices,
            whole.biases if biases is None else biases,
            layer.attention_norm,
            layer.mlp_norm,
            cos,
            cos * 0,
            False,
            attn.n_heads,
            float(attn.scale),
            [None],
            [None],
            [0],
            np.empty((1, 2, 32), dtype=np.float32) if new_k is None else new_k,
            np.empty((1, 2, 32), dtype=np.float32),
        )

    first, second = read.layers
    m = second.whole.matrices
    swapped = (m[1], m[0], *m[2:])
    with pytest.raises(
        ValueError, match=r"the q matrix is \(64, 128\), the layer wants \(128, 128\)"
    ):
        kernels.layers(x, [1], [spec(first), spec(second, matrices=swapped)])
    with pytest.raises(ValueError, match="seven matrices and seven biases"):
        kernels.layers(x, [1], [spec(first, m[:6], second.whole.biases[:6])])
    with pytest.raises(ValueError, match=r"new_k and new_v must be \(tokens, kv heads, dim\)"):
        kernels.layers(x, [1], [spec(first, new_k=np.empty((1, 2, 16), dtype=np.float32))])
    with pytest.raises(ValueError, match="counts must be at least 1 and add up to the tokens"):
        kernels.layers(x, [2], [spec(first)])
    assert np.array_equal(x, before)
    kernels.layers(x, [1], [spec(first), spec(second)])  # right: x changes
    assert not np.array_equal(x, before)
