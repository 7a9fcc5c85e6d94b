"""Attention and SwiGLU for the CPU backend, computed with numpy.

On the Linux CPU backend mlx's element-wise ``exp`` is scalar (about 105 M
values/s on this kind of machine, against about 2 G/s for numpy's SIMD one),
and ``mx.fast.scaled_dot_product_attention`` repeats keys and values for
grouped-query attention before a matmul that does not go through BLAS. Here
the same arithmetic runs as numpy matmuls (numpy's own, current OpenBLAS) and
numpy's ``exp``:

- queries are grouped per key/value head, ``(B, Hkv, G·L, D)``, so keys and
  values are never repeated;
- the softmax subtracts the row maximum, exponentiates in place, and divides
  the ``(G·L, D)`` output rather than the ``(G·L, S)`` probabilities;
- query positions go in blocks of about 8 MiB of scores (at least 64
  positions), so the softmax's passes stay in the processor's cache, and under
  a causal mask a block skips the keys none of its positions can see (half of
  a prefill from empty) and masks only its own ``rows × rows`` corner: every
  earlier key is visible to all its positions (masking the whole block cost as
  much as its softmax at 8k tokens of history).

Both functions take and return ``mx.array``; where numpy cannot take the
input (another dtype, attention sinks, a trace inside ``mx.compile``) they
return ``None`` and the caller uses mlx-lm's own function.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvchat.engine.cpu import native, parallel

_NEG_INF = np.float32(-np.inf)


def as_numpy(x: mx.array) -> np.ndarray | None:
    """A float32 numpy view of ``x`` (evaluating it), or None if numpy cannot take it."""
    if x.dtype != mx.float32:
        return None
    try:
        return np.asarray(x)
    except (ValueError, RuntimeError, TypeError):  # a tracer inside mx.compile
        return None


def _mask5(mask: np.ndarray, n_kv: int, groups: int) -> np.ndarray:
    """A ``(b, h, L, S)``-broadcastable mask reshaped to the grouped ``(b, Hkv, G, L, S)``."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == n_kv * groups and groups > 1:
        return mask.reshape(mask.shape[0], n_kv, groups, *mask.shape[2:])
    return mask[:, :, None]


BLOCK_FLOATS = 1 << 21  # scores computed at once: 8 MiB, so a block's passes stay in cache
# ... but a block has at least this many query positions (or all of them): against a long
# history, blocks of fewer make thin matmuls and read every key and value once more each
# (44 new tokens over 8k cached: 32 ms a layer in three blocks, 22 ms in one).
BLOCK_ROWS = 64


def sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array | None:
    """``softmax(q·kᵀ·scale + mask)·v`` for ``(B, H, L, D)`` inputs, or None (see module doc).

    Query positions go in blocks whose scores fit in the processor's cache, and
    with a causal mask each block reads only the keys its last position can see.
    """
    if any(a.dtype != mx.float32 for a in (queries, keys, values)):
        return None
    try:
        mx.eval(queries, keys, values)  # one evaluation for the three (each costs a sync)
    except (ValueError, RuntimeError):  # a tracer inside mx.compile
        return None
    q, k, v = as_numpy(queries), as_numpy(keys), as_numpy(values)
    if q is None or k is None or v is None:
        return None
    mask_np = None
    if isinstance(mask, mx.array):
        mask_np = np.asarray(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32))
    elif mask is not None and mask != "causal":
        return None
    batch, n_q, length, dim = q.shape
    n_kv, span = k.shape[1], k.shape[2]
    groups = n_q // n_kv
    causal = mask == "causal" and length > 1
    mask5 = None if mask_np is None else _mask5(mask_np, n_kv, groups)

    q5 = q.reshape(batch, n_kv, groups, length, dim)
    out = np.empty((batch, n_kv, groups, length, v.shape[-1]), dtype=np.float32)
    step = max(min(length, BLOCK_ROWS), BLOCK_FLOATS // max(1, batch * n_q * span))
    for l0 in range(0, length, step):
        l1 = min(length, l0 + step)
        rows = l1 - l0
        seen = span - length + l1 if causal else span  # keys the block's last position sees
        grouped = q5[:, :, :, l0:l1].reshape(batch, n_kv, groups * rows, dim) * np.float32(scale)
        scores = np.matmul(grouped, k[:, :, :seen].swapaxes(-1, -2))  # (B, Hkv, G·rows, seen)
        scores5 = scores.reshape(batch, n_kv, groups, rows, seen)
        if causal:  # the block's own positions, the last ``rows`` keys, form its only future
            future = np.triu(np.ones((rows, rows), dtype=bool), k=1)
            np.copyto(scores5[..., seen - rows :], _NEG_INF, where=future)
        elif mask5 is not None:
            block = mask5[..., l0:l1, :] if mask5.shape[-2] == length else mask5
            if block.dtype == np.bool_:
                np.copyto(scores5, _NEG_INF, where=~block)
            else:
                scores5 += block
        gr = scores.shape[2]
        split = parallel.bounds(gr, parallel.parts(gr, batch * n_kv * seen))
        total = np.concatenate(
            parallel.run(_softmax_rows, [scores[:, :, a:b] for a, b in split]), axis=2
        )
        part = np.matmul(scores, v[:, :, :seen])
        part /= total
        out[:, :, :, l0:l1] = part.reshape(batch, n_kv, groups, rows, -1)
    return mx.array(out.reshape(batch, n_q, length, v.shape[-1]))


def _softmax_rows(scores: np.ndarray) -> np.ndarray:
    """Exponentiate ``scores`` in place less each row's maximum; return the row sums."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    sums: np.ndarray = scores.sum(axis=-1, keepdims=True)
    return sums


def swiglu(gate: mx.array, x: mx.array) -> mx.array | None:
    """``silu(gate) * x``, or None (see module doc); in parts over the cores for many rows."""
    g, u = as_numpy(gate), as_numpy(x)
    if g is None or u is None or g.shape != u.shape:
        return None
    g2, u2 = (a.reshape(-1, g.shape[-1]) if g.ndim else a.reshape(1, 1) for a in (g, u))
    return mx.array(swiglu_rows(g2, u2).reshape(g.shape))


def swiglu_rows(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` of float32 rows ``(n, features)``: in one pass by the native kernel
    (fused.c), else in numpy, in parts over the cores for many rows."""
    fused = native.module("fused")
    if (
        fused is not None
        and g.strides == u.strides
        and (g.flags.c_contiguous or g.flags.f_contiguous)
    ):
        # element-wise: any one layout of the three will do (a product of many rows
        # comes transposed, see linear.product), each seen as one row in memory order
        out = np.empty_like(g)
        fused.swiglu(*(a.ravel(order="K")[None] for a in (g, u, out)))
        return out
    out = np.empty(g.shape, dtype=np.float32)
    split = parallel.bounds(len(g), parallel.parts(len(g), g.shape[-1]))
    parallel.run(lambda r: _swiglu_rows(g[r[0] : r[1]], u[r[0] : r[1]], out[r[0] : r[1]]), split)
    return out


def _swiglu_rows(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    np.negative(g, out=out)
    with np.errstate(over="ignore"):  # exp(-g) = inf for very negative g: silu is then -0
        np.exp(out, out=out)
    out += np.float32(1)
    np.divide(g, out, out=out)
    out *= u
