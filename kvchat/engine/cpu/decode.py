"""One decoding step of a llama-family model in numpy, for one or several sequences.

Decoding runs the model on one token at a time. Through mlx-lm's modules
with the numpy layers of this package, that step hands data between mlx and
numpy about a hundred times (every linear layer, attention and SwiGLU
evaluates its input), and each hand-off costs tens of microseconds of
synchronisation, which is as much as the arithmetic of a small model. Here
the whole step (RMSNorm, linear layers, rotary embedding, grouped-query
attention, SwiGLU) runs in numpy on mlx's own parameters as stored (the linear
layers' and the embedding's through :class:`~.stored.Stored`, never widened whole;
norms' weights and biases as float32 vectors) and on views of the caches' keys and
values; only the cache update stays mlx's: once every layer has read its cache, the
new keys and values go to ``cache.update_and_fetch`` in one evaluation, so the cache,
its ledger, trimming and saving see nothing new. A quantized cache is updated first, a
layer at a time, and read back dequantized (one hand-off a layer), so the token attends
to its own key as stored, as in mlx-lm.

:func:`hidden` takes B sequences, each with its own per-layer caches (of any
lengths) and one token or, on a plain ``KVCache``, several (a short prompt
folded into a decoding step): the linear layers multiply every row's tokens at
once (the weights stream once a step). Attention reads each row's cache and its
own new tokens (causal among them): the rows on plain caches all in one call of
the native kernel (fused.c, reading each cache where it is: :func:`_buffers`), the
others (quantized or rotated caches, or no kernel built) row by row in numpy
(:mod:`.step_attention`).
The rotary embedding's cosines and sines are the model's own RoPE module's
(whatever its variant: it is applied to ones and zeros at each row's offset).

Where the packed kernels read all of a layer's matrices (a 16-bit or packed model), the
rows on plain caches with at most WHOLE_TOKENS new tokens run each layer whole in native
code instead, with the layers after it that do too, in one call (``packed.layers``,
layer.h: norms, products, rotation, attention, SwiGLU and residuals, the same arithmetic
in C, rounded otherwise than the numpy step), which took qwen2.5-0.5b@q4's step on 2 cores
from 17 to 11-12 ms: the numpy glue between the products was a third of it. The other
rows of such a step go layer by layer apart (:func:`_groups`), so that which way a row
goes, and so its figures, never depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

from kvchat.engine.caches.rotated import RotatedKVCache
from kvchat.engine.cpu import native, step_attention, step_weights, stored
from kvchat.engine.cpu.attention import swiglu_rows
from kvchat.engine.cpu.linear import multiply_each, through_kernel
from kvchat.engine.cpu.rope import RopeForm, RopeKey, Turn, rotate, rotations
from kvchat.engine.cpu.step_weights import Layer, Linear, Norm

# caches whose single-token mask is None
CACHES = (KVCache, ConcatenateKVCache, QuantizedKVCache, RotatedKVCache)
# A step's tokens the whole-layer call takes at most: as many as the packed kernels
# multiply (beyond, a product widens its weights for BLAS)
WHOLE_TOKENS = stored.KERNEL_ROWS


def takes(cache: list[Any]) -> bool:
    """Every layer's cache is of a class the step reads."""
    return all(type(c) in CACHES for c in cache)


def _rms(x: np.ndarray, norm: Norm) -> np.ndarray:
    """RMSNorm of each row of ``x`` (rows × features)."""
    weight, eps = norm
    mean = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[-1])
    scale = np.float32(1) / np.sqrt(mean + np.float32(eps))
    out: np.ndarray = (x * scale[:, None]) * weight
    return out


def _linears(layers: Sequence[Linear], x: np.ndarray) -> list[np.ndarray]:
    """Each of ``layers`` applied to the same rows ``x`` (their products in one native
    call where the kernels take them all: :func:`~.linear.multiply_each`), biases added."""
    ys = multiply_each([layer.weights for layer in layers], x)
    for layer, y in zip(layers, ys):
        if layer.bias is not None:
            y += layer.bias  # the product's own fresh array
    return ys


def _mlp(layer: Layer, x: np.ndarray) -> np.ndarray:
    gate, up = _linears(layer.gate_up, x)
    return _linears((layer.down,), swiglu_rows(gate, up))[0]


def _plain(cache: Any) -> bool:
    """Whether the native kernels read ``cache`` (:func:`_buffers`): a plain cache, not
    quantized or rotated."""
    return type(cache) in (KVCache, ConcatenateKVCache)


def _buffers(caches: list[Any]) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """Plain caches' key and value buffers for the native kernels, C-contiguous: where
    they are, or None for an empty cache. A prompt that fills the first buffer exactly
    (256 tokens in one piece) leaves mlx-lm's KVCache holding the update as it came,
    strided, until its next update: then a contiguous copy, so that the row still goes in
    the one call with the others (layer by layer, every row of the step would get figures
    that differ from their own alone)."""
    keys: list[np.ndarray | None] = []
    values: list[np.ndarray | None] = []
    for cache in caches:
        held = cache.offset > 0
        keys.append(np.ascontiguousarray(np.asarray(cache.keys)) if held else None)
        values.append(np.ascontiguousarray(np.asarray(cache.values)) if held else None)
    return keys, values


def _attend(
    fused: ModuleType,
    attn: nn.Module,
    form: RopeForm,
    qkv: tuple[np.ndarray, np.ndarray, np.ndarray],
    at: list[slice],
    own: list[Any],
    turns: dict[tuple[RopeKey, int, int], Turn],
    spread: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's attention for rows on plain caches (their tokens at ``at`` in ``qkv``,
    their caches ``own``), all in one call of the native kernel, which reads each cache
    where it is (:func:`_buffers`; over the cores if ``spread``): each row's outputs
    ``(tokens, features)`` and rotated new keys and values ``(tokens, kv heads, head
    dim)``, one after another, for the caller to hand on. Their rotations go in one call
    too."""
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    counts = [span.stop - span.start for span in at]
    tables = [turns[form.key, c.offset, n] for c, n in zip(own, counts)]
    cos, sin = (np.concatenate([t[side] for t in tables])[:, None] for side in (0, 1))
    q, k, v = (np.concatenate([x[span] for span in at]) for x in qkv)
    n = len(q)
    q = rotate(q.reshape(n, heads, -1), form, cos, sin)  # rotate's copies are in C order
    k = rotate(k.reshape(n, kv_heads, -1), form, cos, sin)
    # C order for the kernel (a product of many rows comes transposed, see linear.product)
    v = np.ascontiguousarray(v.reshape(n, kv_heads, -1))
    spans = [c.offset for c in own]
    keys, values = _buffers(own)
    out = np.empty_like(q)
    fused.attend(q, k, v, keys, values, spans, counts, float(attn.scale), out, spread)
    return out.reshape(n, -1), k, v


def _whole(
    packed: ModuleType,
    run: list[tuple[nn.Module, RopeForm, Layer, list[Any]]],
    x: np.ndarray,
    counts: list[int],
    turns: dict[tuple[RopeKey, int, int], Turn],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive layers whole in one native call (``packed.layers``, see layer.h), each
    given as (its attention module, RoPE form, weights, every row's cache for it: plain
    caches, read where they are, see :func:`_buffers`), ``x`` updated in place: each
    layer's turned new keys and the values ``(tokens, kv heads, head dim)``, for the
    caller to hand on."""
    specs, out = [], []
    for attn, form, weights, own in run:
        assert weights.whole is not None
        tables = [turns[form.key, c.offset, n] for c, n in zip(own, counts)]
        cos, sin = tables[0] if len(tables) == 1 else (np.concatenate(t) for t in zip(*tables))
        kv_heads = attn.n_kv_heads
        dim = weights.qkv[1].weights.out_features // kv_heads
        shape = (len(x), kv_heads, dim)
        new = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        keys, values = _buffers(own)
        specs.append(
            (
                weights.whole.matrices,
                weights.whole.biases,
                weights.attention_norm,
                weights.mlp_norm,
                cos,
                sin,
                form.traditional,
                attn.n_heads,
                float(attn.scale),
                keys,
                values,
                [c.offset for c in own],
                *new,
            )
        )
        out.append(new)
    packed.layers(x, counts, specs)
    return out


def hidden(
    body: nn.Module,
    tokens: list[list[int]],
    caches: list[list[Any]],
    extra: tuple[nn.Module, ...] = (),
) -> np.ndarray | None:
    """The final hidden states ``(B, D)`` after the tokens ``tokens[b]`` of each of B
    sequences (the last token's), their keys and values appended to the row's own
    ``caches[b]``; or None, nothing changed, when numpy cannot take the parameters or
    caches (another dtype), or a row of several tokens has a cache other than mlx-lm's
    plain ``KVCache``."""
    several = [cache for row, cache in zip(tokens, caches) if len(row) > 1]
    if any(type(c) is not KVCache for cache in several for c in cache):
        return None
    if not tokens or any(not row for row in tokens):
        return None
    read = step_weights.gather(body, caches, extra)
    if read is None:
        return None
    groups = _groups(read, tokens, caches)
    if len(groups) == 1:
        return _step(body, read, tokens, caches)
    parts = [_step(body, read, [tokens[b] for b in g], [caches[b] for b in g]) for g in groups]
    out = np.empty((len(tokens), parts[0].shape[1]), dtype=np.float32)
    for group, part in zip(groups, parts):
        out[group] = part
    return out


def _groups(
    read: step_weights.Weights, tokens: list[list[int]], caches: list[list[Any]]
) -> list[list[int]]:
    """The rows (by index) in groups of one step each: those the whole-layer call takes
    (every cache plain, at most WHOLE_TOKENS tokens a group) apart from the others, which
    go layer by layer. Its norms, rotations and SwiGLU round otherwise than the numpy
    step's, so a row must get the whole-layer call beside any rows where it gets it
    alone: a row beside a quantized cache, or beside a short prompt folded into the step,
    got figures 3e-6 off its own. One group, the usual case, where all go the same way."""
    if native.module("packed") is None or not any(w.whole for w in read.layers):
        return [list(range(len(tokens)))]
    whole: list[list[int]] = [[]]
    other, used = [], 0
    for b, (row, cache) in enumerate(zip(tokens, caches)):
        if len(row) > WHOLE_TOKENS or not all(_plain(c) for c in cache):
            other.append(b)
            continue
        if used + len(row) > WHOLE_TOKENS:
            whole.append([])
            used = 0
        whole[-1].append(b)
        used += len(row)
    return [group for group in (*whole, other) if group]


def _step(
    body: nn.Module, read: step_weights.Weights, tokens: list[list[int]], caches: list[list[Any]]
) -> np.ndarray:
    """:func:`hidden`'s step for rows it checked."""
    layers = body.layers
    forms = [layer.self_attn.rope_form for layer in layers]
    counts = [len(row) for row in tokens]
    starts = np.cumsum([0, *counts])
    needed: dict[tuple[RopeKey, int, int], tuple[nn.Module, RopeForm]] = {}
    for cache, n in zip(caches, counts):
        for layer, form, c in zip(layers, forms, cache):
            needed.setdefault((form.key, c.offset, n), (layer.self_attn.rope, form))
    turns = rotations(needed)
    x = read.embedding.gather(np.asarray([t for row in tokens for t in row]))
    x = np.ascontiguousarray(x, dtype=np.float32)  # packed.layers', updated in place
    new: list[list[Turn | None]] = [[None] * len(layers) for _ in tokens]
    fused = native.module("fused")
    # whole layers in one native call: every row on a plain cache, as many tokens as the
    # packed kernels multiply (WHOLE_TOKENS), matrices they read
    packed = native.module("packed") if len(x) <= WHOLE_TOKENS else None
    spans_of = [slice(starts[b], starts[b + 1]) for b in range(len(tokens))]
    # attention over the cores only where the products are the native kernel's too:
    # BLAS's threads and OpenMP's would share them (see fused.c's SPREAD)
    spread = through_kernel(len(x))
    whole = [
        bool(packed and weights.whole and all(_plain(row[i]) for row in caches))
        for i, weights in enumerate(read.layers)
    ]
    for i, (layer, form, weights) in enumerate(zip(layers, forms, read.layers)):
        attn = layer.self_attn
        if whole[i]:  # with the layers after it that go whole too, in one call
            if i == 0 or not whole[i - 1]:
                assert packed is not None  # (whole says so)
                end = whole.index(False, i) if False in whole[i:] else len(layers)
                run = [
                    (layers[j].self_attn, forms[j], read.layers[j], [row[j] for row in caches])
                    for j in range(i, end)
                ]
                for j, (ks, vs) in enumerate(_whole(packed, run, x, counts, turns), i):
                    for b, part in enumerate(spans_of):
                        new[b][j] = ks[part].transpose(1, 0, 2), vs[part].transpose(1, 0, 2)
            continue
        q, k, v = _linears(weights.qkv, _rms(x, weights.attention_norm))
        rows: list[np.ndarray] = [np.empty(0)] * len(tokens)
        # rows on plain caches: the native kernel, all in one call
        quick = [b for b, row in enumerate(caches) if _plain(row[i])] if fused else []
        if fused is not None and quick:
            spans = [spans_of[b] for b in quick]
            own = [caches[b][i] for b in quick]
            outs, ks, vs = _attend(fused, attn, form, (q, k, v), spans, own, turns, spread)
            done = 0
            for b in quick:
                part = slice(done, done + counts[b])
                rows[b] = outs[part]
                new[b][i] = ks[part].transpose(1, 0, 2), vs[part].transpose(1, 0, 2)
                done = part.stop
        for b, (cache, n) in enumerate(zip(caches, counts)):
            if b in quick:
                continue
            turn = turns[form.key, cache[i].offset, n]
            at = slice(starts[b], starts[b + 1])
            if n == 1:
                one = (turn[0][0], turn[1][0])
                t = starts[b]
                out, kv = step_attention.one_token(attn, form, q[t], k[t], v[t], cache[i], one)
                rows[b] = out[None]
                new[b][i] = None if kv is None else (kv[0][:, None], kv[1][:, None])
            else:
                rows[b], new[b][i] = step_attention.several_tokens(
                    attn, form, q[at], k[at], v[at], cache[i], turn
                )
        mixed = np.concatenate(rows)
        if i == len(layers) - 1 and len(x) > len(tokens):  # only rows' last tokens go on
            x, mixed = x[starts[1:] - 1], mixed[starts[1:] - 1]
        x = x + _linears((weights.o,), mixed)[0]
        x = x + _mlp(weights, _rms(x, weights.mlp_norm))
    if len(x) > len(tokens):  # the last layer was whole: only rows' last tokens go on
        x = x[starts[1:] - 1]
    # The caches grow once all layers have read them: one evaluation for the step.
    mx.eval(
        [
            c.update_and_fetch(mx.array(kv[0][None]), mx.array(kv[1][None]))
            for cache, row in zip(caches, new)
            for c, kv in zip(cache, row)
            if kv is not None
        ]
    )
    return _rms(x, read.norm)
