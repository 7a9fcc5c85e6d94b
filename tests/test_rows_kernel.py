"""The native few-row kernel (kvchat/engine/cpu/rows.c): its products equal numpy's for
every row count and shape it takes, bad arguments are refused and leave the output alone,
and the linear layers route 2 to 16 rows through it unless it is switched off."""

from __future__ import annotations

import numpy as np
import pytest

from kvchat.engine.cpu import linear

rows = pytest.importorskip(
    "kvchat.engine.cpu.rows", reason="the native kernel was not built (no C compiler)"
)


def reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 9, 15, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(896, 896), (4, 8), (7, 33), (130, 4864), (1, 5)])
def test_products_equal_numpys(count, n, k):
    """Row counts around the kernel's groups of 8; output rows around its tiles of 4 and
    input lengths around its vectors of 8 (the remainders computed one by one)."""
    rng = np.random.default_rng(count * 100_000 + n * 10 + k)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal((count, k), dtype=np.float32)
    out = np.full((count, n), np.nan, dtype=np.float32)
    rows.matmul_t(w, x, out)
    want = reference(w, x)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_each_row_is_computed_alone():
    """A row's result does not depend on the rows beside it: the same input row gives the
    same floats in a batch of 8 as in a batch of 2 (what batch-of-8 = alone needs)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 896), dtype=np.float32)
    x = rng.standard_normal((8, 896), dtype=np.float32)
    eight, two = np.empty((8, 64), np.float32), np.empty((2, 64), np.float32)
    rows.matmul_t(w, x, eight)
    rows.matmul_t(w, x[[5, 0]], two)
    assert np.array_equal(eight[5], two[0]) and np.array_equal(eight[0], two[1])


@pytest.mark.parametrize(
    "make,error,words",
    [
        (lambda w, x, o: (w.astype(np.float64), x, o), TypeError, "w must be a 2-D float32"),
        (lambda w, x, o: (w, x[:, ::2], o), ValueError, "not C-contiguous"),
        (lambda w, x, o: (w, x[:, :10].copy(), o), ValueError, "shapes do not match"),
        (lambda w, x, o: (w, x, o[:, :3]), ValueError, "not C-contiguous"),
        (lambda w, x, o: (w[None], x, o), TypeError, "w must be a 2-D float32"),
        (lambda w, x, o: (w, x, o.astype(np.float16)), TypeError, "out must be a 2-D float32"),
    ],
    ids=["float64", "strided", "lengths", "out shape", "3-D", "out dtype"],
)
def test_bad_arguments_are_refused_and_change_nothing(make, error, words):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((12, 16), dtype=np.float32)
    x = rng.standard_normal((3, 16), dtype=np.float32)
    out = np.full((3, 12), 7.0, dtype=np.float32)
    args = make(w, x, out)
    with pytest.raises(error, match=words):
        rows.matmul_t(*args)
    assert (out == 7.0).all()


def test_more_rows_than_the_kernel_takes_are_refused():
    w = np.ones((4, 8), np.float32)
    x, out = np.ones((65, 8), np.float32), np.zeros((65, 4), np.float32)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        rows.matmul_t(w, x, out)
    assert not out.any()


def test_a_read_only_output_is_refused():
    w, x = np.ones((4, 8), np.float32), np.ones((2, 8), np.float32)
    out = np.zeros((2, 4), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rows.matmul_t(w, x, out)
    assert not out.any()


@pytest.mark.cpu_only
def test_the_linear_layers_route_batched_rows_through_it_unless_switched_off(monkeypatch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 896), dtype=np.float32)
    x = rng.standard_normal((8, 896), dtype=np.float32)
    native = linear.product(w, x)
    assert linear.kernel() is rows.matmul_t
    monkeypatch.setenv("KVCHAT_NATIVE", "0")
    assert linear.kernel() is None
    blas = linear.product(w, x)
    assert np.allclose(native, blas, rtol=1e-5, atol=1e-4)
    assert np.allclose(native, reference(w, x), rtol=1e-5, atol=1e-4)


@pytest.mark.cpu_only
def test_the_step_knows_which_row_counts_the_kernel_takes(monkeypatch):
    """What the numpy step's attention asks (spread over the cores only beside the
    kernel's products, not BLAS's): 2 to KERNEL_ROWS rows, while the kernel is on."""
    taken = [n for n in range(1, 40) if linear.through_kernel(n)]
    assert taken == list(range(2, linear.KERNEL_ROWS + 1))
    monkeypatch.setenv("KVCHAT_NATIVE", "0")
    assert not any(linear.through_kernel(n) for n in range(1, 40))
