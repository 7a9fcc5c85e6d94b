"""The native fused kernels (kvchat/engine/cpu/fused.c): SwiGLU and the step's attention
equal a float64 reference for every shape they take, a row's result does not depend on
the rows beside it, bad arguments are refused and leave the output alone, and the
decoding step reads a cache in place only where its buffers allow it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvchat.engine.cpu import decode, native

fused = pytest.importorskip(
    "kvchat.engine.cpu.fused", reason="the native kernels were not built (no C compiler)"
)


def silu_times(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        return (g64 / (1 + np.exp(-g64)) * u).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 5), (1, 8), (3, 4864), (144, 4864)])
def test_swiglu_equals_the_reference(shape):
    """Lengths around the vectors of 8 (the tail computed one by one), and enough rows
    to be spread over the cores; inputs far out on both sides of exp's range."""
    rng = np.random.default_rng(shape[0])
    g = (rng.standard_normal(shape, dtype=np.float32) * 30).astype(np.float32)
    u = rng.standard_normal(shape, dtype=np.float32)
    out = np.full(shape, np.nan, dtype=np.float32)
    fused.swiglu(g, u, out)
    want = silu_times(g, u)
    assert np.allclose(out, want, rtol=1e-6, atol=1e-30)
    assert (np.sign(out) == np.sign(want))[np.abs(want) > 1e-30].all()


def test_swiglu_refuses_bad_arguments_and_leaves_out_alone():
    g = np.ones((2, 8), np.float32)
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="same shape"):
        fused.swiglu(g, np.ones((2, 9), np.float32), out)
    with pytest.raises(TypeError, match="g must be a 2-D float32 array"):
        fused.swiglu(g.astype(np.float64), g, out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fused.swiglu(g, g, out)
    assert not out.any()


def reference(q, k, v, keys, values, spans, counts, scale):
    """Each new token's attention in float64: its query heads grouped by kv head, over its
    row's cache's first ``span`` keys and values, then the row's new ones up to its own."""
    heads, dim = q.shape[1:]
    kv_heads = k.shape[1]
    out = np.empty(q.shape, np.float64)
    first = 0
    for r, (span, count) in enumerate(zip(spans, counts)):
        cached_k = keys[r][0, :, :span] if span else np.zeros((kv_heads, 0, dim))
        cached_v = values[r][0, :, :span] if span else np.zeros((kv_heads, 0, dim))
        for i in range(first, first + count):
            new_k = k[first : i + 1].transpose(1, 0, 2)
            new_v = v[first : i + 1].transpose(1, 0, 2)
            all_k = np.concatenate([cached_k, new_k], axis=1).astype(np.float64)
            all_v = np.concatenate([cached_v, new_v], axis=1).astype(np.float64)
            grouped = q[i].reshape(kv_heads, heads // kv_heads, dim).astype(np.float64)
            scores = grouped @ all_k.swapaxes(-1, -2) * scale
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[i] = (weights @ all_v).reshape(heads, dim)
        first += count
    return out.astype(np.float32)


def inputs(rng, spans, counts, heads, kv_heads, dim, room=5):
    tokens = sum(counts)
    q = rng.standard_normal((tokens, heads, dim), dtype=np.float32)
    k, v = (rng.standard_normal((tokens, kv_heads, dim), dtype=np.float32) for _ in range(2))
    keys = [rng.standard_normal((1, kv_heads, s + room, dim), dtype=np.float32) for s in spans]
    values = [rng.standard_normal((1, kv_heads, s + room, dim), dtype=np.float32) for s in spans]
    return q, k, v, keys, values


LAYOUTS = [  # (spans, counts): each row's cached tokens and new tokens
    ([0], [1]),
    ([1, 7, 8, 9], [1, 1, 1, 1]),
    ([150, 3, 0, 300, 64, 1, 2, 33], [1, 18, 1, 5, 1, 2, 1, 1]),
    ([0, 40], [9, 21]),
    ([1500] * 3, [1, 3, 1]),
]


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(14, 2, 64), (8, 8, 8), (16, 2, 128), (24, 2, 16), (8, 1, 64)]
)
@pytest.mark.parametrize("spans,counts", LAYOUTS)
def test_attend_equals_the_reference(heads, kv_heads, dim, spans, counts):
    """Groups of 1 to 12 queries a kv head (over 8: two blocks), spans around the vectors
    of 8 and long enough to be spread over the cores, empty caches, rows of one token
    beside rows of several (a short prompt folded into a step: causal among them)."""
    rng = np.random.default_rng(heads * 1000 + dim + sum(spans) + len(counts))
    q, k, v, keys, values = inputs(rng, spans, counts, heads, kv_heads, dim)
    scale = dim**-0.5
    out = np.full(q.shape, np.nan, dtype=np.float32)
    given = [a if s else None for a, s in zip(keys, spans)]
    fused.attend(q, k, v, given, values, spans, counts, scale, out)
    want = reference(q, k, v, keys, values, spans, counts, scale)
    assert np.allclose(out, want, atol=2e-6)


def test_attend_computes_each_row_alone():
    """A row's floats are the same in a batch as alone (what batch-of-8 = alone needs)."""
    rng = np.random.default_rng(5)
    spans, counts = LAYOUTS[2]
    q, k, v, keys, values = inputs(rng, spans, counts, 14, 2, 64)
    together = np.empty_like(q)
    fused.attend(q, k, v, keys, values, spans, counts, 0.125, together)
    first = 0
    for r, (span, count) in enumerate(zip(spans, counts)):
        at = slice(first, first + count)
        alone = np.empty_like(q[at])
        fused.attend(q[at], k[at], v[at], [keys[r]], [values[r]], [span], [count], 0.125, alone)
        assert np.array_equal(alone, together[at])
        first += count


def test_attend_on_the_calling_thread_computes_the_same_floats():
    """``spread=False`` (the caller's products go through BLAS) keeps every task on the
    calling thread: the same floats as over the cores, for work large enough to spread."""
    rng = np.random.default_rng(9)
    spans, counts = [1500] * 3, [1, 3, 1]
    q, k, v, keys, values = inputs(rng, spans, counts, 14, 2, 64)
    spread, alone = np.full(q.shape, np.nan, np.float32), np.full(q.shape, np.nan, np.float32)
    fused.attend(q, k, v, keys, values, spans, counts, 0.125, spread, True)
    fused.attend(q, k, v, keys, values, spans, counts, 0.125, alone, False)
    assert not np.isnan(alone).any() and np.array_equal(spread, alone)
    assert np.allclose(alone, reference(q, k, v, keys, values, spans, counts, 0.125), atol=2e-6)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda a: a.update(spans=[9]), ValueError, "capacity ≥ span"),
        (lambda a: a.update(keys=[np.ones((1, 1, 9, 64), np.float32)]), ValueError, "kv heads"),
        (lambda a: a.update(keys=[np.ones((1, 2, 9, 64))]), TypeError, "keys must be a 4-D"),
        (lambda a: a.update(spans=[4, 4]), ValueError, "one entry a row"),
        (lambda a: a.update(spans=["4"]), TypeError, "integer"),
        (lambda a: a.update(counts=[1]), ValueError, "add up to the tokens"),
        (lambda a: a.update(counts=[0]), ValueError, "at least 1"),
        (lambda a: a.update(q=np.ones((2, 3, 64), np.float32)), ValueError, "multiple of kv"),
        (lambda a: a.update(out=np.zeros((2, 14, 60), np.float32)), ValueError, "q and out"),
    ],
)
def test_attend_refuses_bad_arguments_and_leaves_out_alone(change, error, message):
    rng = np.random.default_rng(2)
    q, k, v, keys, values = inputs(rng, [4], [2], 14, 2, 64, room=4)
    args = {"q": q, "k": k, "v": v, "keys": keys, "values": values, "spans": [4], "counts": [2]}
    args["out"] = np.zeros_like(q)
    change(args)
    with pytest.raises(error, match=message):
        fused.attend(
            *(args[n] for n in ("q", "k", "v", "keys", "values", "spans", "counts")),
            0.125,
            args["out"],
        )
    assert not args["out"].any()


def test_a_cache_is_read_where_it_is_and_a_strided_one_as_a_copy():
    """A plain cache's buffers go to the kernels where they are; a strided one's (a view into
    a wider array) as a contiguous copy of the same figures; a quantized cache is not
    theirs."""

    def grown(length):
        cache = KVCache()
        cache.update_and_fetch(*(mx.ones((1, 2, length, 32)) for _ in range(2)))
        return cache

    plain = grown(5)
    (keys, empty_keys), (values, empty_values) = decode._buffers([plain, KVCache()])
    assert np.shares_memory(keys, np.asarray(plain.keys))
    assert np.shares_memory(values, np.asarray(plain.values))
    assert empty_keys is None and empty_values is None
    strided = KVCache()
    wide = mx.arange(2 * 5 * 64, dtype=mx.float32).reshape(1, 2, 5, 64)
    strided.keys = strided.values = wide[..., :32]
    strided.offset = 5
    assert not np.asarray(strided.keys).flags.c_contiguous
    (keys,), (values,) = decode._buffers([strided])
    assert keys.flags.c_contiguous and values.flags.c_contiguous
    assert np.array_equal(keys, np.asarray(wide)[..., :32])
    assert not np.shares_memory(keys, np.asarray(wide))
    assert decode._plain(plain) and decode._plain(strided)
    assert not decode._plain(grown(5).to_quantized(group_size=32, bits=8))


@pytest.mark.cpu_only
def test_the_route_says_which_kernels_are_used(monkeypatch):
    assert native.module("fused") is fused
    assert native.route() == (
        "kvchat's native kernels: weights read once for 2 to 16 rows, fused attention, "
        "packed and 16-bit weights widened in registers, their layers whole in one call"
    )
    built = native.built
    with monkeypatch.context() as patched:  # only rows.c built: the phrase names it alone
        patched.setattr(native, "built", lambda name: built(name) if name == "rows" else None)
        assert native.route() == "kvchat's native kernels: weights read once for 2 to 16 rows"
    monkeypatch.setenv("KVCHAT_NATIVE", "0")
    assert native.module("fused") is None and native.module("rows") is None
    assert native.route() == "numpy and its BLAS (KVCHAT_NATIVE=0)"
