"""The packed-weight kernels (packed.c) and their numpy fallback against MLX's own
dequantization, in float64: every bit width, group size and scale type MLX's affine mode
makes, float16 and bfloat16 weights, row counts from one to a prompt's; a row's result
the same, bit for bit, alone or among others."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvchat.engine.cpu import native, stored

pytestmark = pytest.mark.cpu_only

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
SCALES = (mx.float32, mx.float16, mx.bfloat16)
ROWS = (1, 2, 7, 8, 64)
OUT = 13  # not a multiple of the kernel's 4 weight rows a tile
TOLERANCE = 1e-5


def kernels():
    module = native.built("packed")
    if module is None:
        pytest.skip("kvchat's native kernels were not built (no C compiler at install)")
    return module


def quantized(bits: int, group: int, scale: mx.Dtype) -> nn.QuantizedLinear:
    """A layer of ``OUT`` rows of 3 groups (``in`` a multiple of the group, not of 8 groups),
    its scales and biases in ``scale``."""
    mx.random.seed(bits * 1000 + group)
    layer = nn.QuantizedLinear.from_linear(
        nn.Linear(3 * group, OUT, bias=False), group_size=group, bits=bits
    )
    layer.scales = layer.scales.astype(scale)
    layer.biases = layer.biases.astype(scale)
    return layer


def reference(layer: nn.QuantizedLinear) -> np.ndarray:
    """The layer's weight in float64, dequantized by MLX from float32 scales and biases
    (MLX dequantizes a float16-scaled group in float16, which rounds)."""
    weight = mx.dequantize(
        layer.weight,
        layer.scales.astype(mx.float32),
        layer.biases.astype(mx.float32),
        group_size=layer.group_size,
        bits=layer.bits,
    )
    return np.array(weight, dtype=np.float64)


def error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def rows(n: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def switch_to(module, way: str) -> None:
    """Products in 8-bit integers (``integers``, where the CPU has AVX-512 VNNI), in the
    float tiles (``floats``), or in AVX2's own kernels (``avx2``, as CPUs with AVX2 but not
    AVX-512 run them); skipped where the CPU has no such way."""
    if module.integer(way == "integers") != (way == "integers"):
        pytest.skip("this CPU has no AVX-512 VNNI: 4 and 8-bit products run in the float tiles")
    if module.avx2(way == "avx2") != (way == "avx2"):
        pytest.skip("this CPU has no AVX2, FMA and F16C")


@contextlib.contextmanager
def kept(module):
    """The kernels' switches (integer, lookup, avx2) as they were, once the block is over."""
    before = module.integer(), module.lookup(), module.avx2()
    try:
        yield
    finally:
        module.integer(before[0])
        module.lookup(before[1])
        module.avx2(before[2])


def ways(name: str, *names: str):
    """A fixture named ``name`` that runs its tests each way of ``names`` (switch_to), the
    settings restored after."""

    @pytest.fixture(params=names, name=name)
    def fixture(request):
        module = kernels()
        with kept(module):
            switch_to(module, request.param)
            yield request.param

    return fixture


path = ways("path", "integers", "floats", "avx2")  # 4 and 8-bit codes: every way
tiles = ways("tiles", "floats", "avx2")  # what only the float tiles read: 16-bit weights


def test_doctor_names_the_way_products_run(path):
    """``kvchat doctor``'s phrase for the kernels names the way they run on this CPU."""
    said = {
        "integers": "native kernels (dequantized in registers; 4 and 8-bit in 8-bit integers, "
        "AVX-512 VNNI)",
        "floats": "native kernels (dequantized in registers)",
        "avx2": "native kernels (dequantized in registers, AVX2)",
    }
    assert stored.kernels() == said[path]


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_affine_product(bits, group, scale, path):
    """Each row count's product is within 1e-5 of float64's, and each row is the same bit
    for bit as when it is multiplied alone."""
    module = kernels()
    layer = quantized(bits, group, scale)
    weight, matrix = reference(layer), stored.stored(layer)
    assert matrix is not None and matrix.form == "affine"
    x = rows(max(ROWS), 3 * group)
    alone = np.concatenate([matrix.product(x[i : i + 1]) for i in range(len(x))])
    for n in ROWS:
        out = np.empty((n, OUT), dtype=np.float32)
        module.affine_t(*matrix_args(matrix), x[:n], out)
        assert error(out, x[:n].astype(np.float64) @ weight.T) <= TOLERANCE
        assert np.array_equal(out, alone[:n])
    assert np.array_equal(matrix.product(x[:8]), alone[:8])
    assert matrix.product(x[:0]).shape == (0, OUT)
    assert matrix.gather(np.zeros(0, dtype=np.int64)).shape == (0, 3 * group)


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("group", GROUPS)
def test_four_bit_codes_scaled_as_on_other_cpus(group, scale):
    """The float tiles' 4-bit codes scaled, as on CPUs without AVX-512 (in the tiles' own
    code, and in AVX2's kernel where the CPU has AVX2), rather than looked up in their
    groups' tables: within 1e-5 of float64 for each row count, each row the same bit for
    bit as alone, and the tables' figures to float32 rounding (other ways, not one under
    other names)."""
    module = kernels()
    layer = quantized(4, group, scale)
    weight, matrix = reference(layer), stored.stored(layer)
    x = rows(max(ROWS), 3 * group, seed=group)
    want = x.astype(np.float64) @ weight.T
    got = {}
    with kept(module):
        module.integer(False)
        for way in ("tables", "scaled", "avx2"):
            module.lookup(way == "tables")
            if module.avx2(way == "avx2") != (way == "avx2"):
                continue  # no AVX2 on this CPU
            alone = np.empty((len(x), OUT), dtype=np.float32)
            for i in range(len(x)):
                module.affine_t(*matrix_args(matrix), x[i : i + 1], alone[i : i + 1])
            for n in ROWS:
                out = np.empty((n, OUT), dtype=np.float32)
                module.affine_t(*matrix_args(matrix), x[:n], out)
                assert error(out, want[:n]) <= TOLERANCE, way
                assert np.array_equal(out, alone[:n]), way
            got[way] = alone
    for way in set(got) - {"tables"}:
        assert not np.array_equal(got["tables"], got[way])
        assert np.abs(got["tables"] - got[way]).max() <= 1e-6 * np.abs(want).max()


def matrix_args(matrix: stored.Stored) -> tuple:
    assert matrix.scales is not None and matrix.biases is not None
    kind = stored.SCALE_KINDS[matrix.scale_form]
    return matrix.data, matrix.scales, matrix.biases, kind, matrix.bits, matrix.group_size


@pytest.mark.parametrize("bits", [4, 8])
def test_products_in_integers(bits, path):
    """A 4 or 8-bit product in integers is as close to float64 as the float tiles' (a quarter of
    the tolerance), and not the float tiles' figures under another name; a group whose x
    has an infinity gives NaN, as the float tiles' inf − inf does; an outlier of 1e4 among
    values of 1e-3 (a large activation) loses nothing the tolerance sees; x of zeros, 0."""
    module = kernels()
    layer = quantized(bits, 64, mx.bfloat16)
    weight, matrix = reference(layer), stored.stored(layer)
    x = rows(8, 192, seed=4) * np.float32(1e-3)
    x[1, 70] = 1e4
    x[2] = 0
    x[3, 5] = np.inf
    out = np.empty((8, OUT), dtype=np.float32)
    module.affine_t(*matrix_args(matrix), x, out)
    finite = [0, 1, 2, 4, 5, 6, 7]
    want = x[finite].astype(np.float64) @ weight.T
    for i, row in enumerate(finite):
        if row != 2:
            assert error(out[row], want[i]) <= TOLERANCE / 4
    assert not out[2].any()
    assert not np.isfinite(out[3]).all()
    if module.integer(path != "integers") == (path == "integers"):
        return  # no other way on this CPU
    other = np.empty_like(out)
    module.affine_t(*matrix_args(matrix), x, other)
    assert not np.array_equal(out[finite], other[finite])
    assert np.abs(out[finite] - other[finite]).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_affine_gather(bits, scale, tiles):
    """Rows gathered (an embedding's lookup) are the dequantized rows, in any order, repeated
    (and a whole matrix widened, as a long prompt's products widen tiles of it)."""
    kernels()
    layer = quantized(bits, 64, scale)
    ids = np.array([12, 0, 5, 12], dtype=np.int64)
    got = stored.stored(layer).gather(ids)
    assert error(got, reference(layer)[ids]) <= 1e-6
    assert error(stored.stored(layer).widened(0, OUT), reference(layer)) <= 1e-6


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("bits", BITS)
def test_fallback_agrees(bits, native_on, monkeypatch):
    """With the kernels switched off (or not built) numpy's tiles give the same figures, for
    decoding's rows and a prompt's."""
    monkeypatch.setenv(native.ENV, native_on)
    for group, scale in zip(GROUPS, SCALES, strict=True):
        layer = quantized(bits, group, scale)
        matrix, weight = stored.stored(layer), reference(layer)
        for n in (1, 3, stored.KERNEL_ROWS + 5):
            x = rows(n, 3 * group, seed=n)
            assert error(matrix.product(x), x.astype(np.float64) @ weight.T) <= TOLERANCE
        assert error(matrix.gather(np.array([3, 1])), weight[[3, 1]]) <= 1e-6


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("width", [16, 200, 203])
def test_half_weights(dtype, width, tiles):
    """float16 and bfloat16 weights as stored: products within 1e-5, row by row the same bit
    for bit, rows gathered exactly; subnormal, infinite and zero float16 values widened."""
    module = kernels()
    mx.random.seed(width)
    layer = nn.Linear(width, OUT, bias=False)
    weight = layer.weight * 0.02
    if dtype == mx.float16:
        weight[0, :3] = mx.array([3e-7, 0.0, -6e-8])  # subnormal in float16
    layer.weight = weight.astype(dtype)
    matrix = stored.stored(layer)
    assert matrix is not None and matrix.form == str(dtype).split(".")[-1]
    want = np.array(layer.weight.astype(mx.float32), dtype=np.float64)
    x = rows(max(ROWS), width)
    alone = np.concatenate([matrix.product(x[i : i + 1]) for i in range(len(x))])
    for n in ROWS:
        out = np.empty((n, OUT), dtype=np.float32)
        module.half_t(matrix.data, stored.SCALE_KINDS[matrix.form], x[:n], out)
        assert error(out, x[:n].astype(np.float64) @ want.T) <= TOLERANCE
        assert np.array_equal(out, alone[:n])
    ids = np.array([0, 12, 0], dtype=np.int64)
    assert np.array_equal(matrix.gather(ids), want[ids].astype(np.float32))
    special = np.array([[0x7C00, 0xFC00, 0x0001, 0x8000] * 4], dtype=np.uint16)
    widened = np.empty((1, 16), dtype=np.float32)
    module.half_rows(special, 1, np.zeros(1, dtype=np.int64), widened)
    assert np.array_equal(widened, special.view(np.float16).astype(np.float32))


def test_refused():
    """Shapes and formats the kernels do not read are refused, not misread."""
    module = kernels()
    matrix = stored.stored(quantized(4, 64, mx.float32))
    w, scales, biases, kind, bits, group = matrix_args(matrix)
    out = np.empty((1, OUT), dtype=np.float32)
    with pytest.raises(ValueError, match="bits"):
        module.affine_t(w, scales, biases, kind, 7, group, rows(1, 192), out)
    with pytest.raises(ValueError, match="shapes"):
        module.affine_t(w, scales, biases, kind, bits, group, rows(1, 190), out)
    with pytest.raises(TypeError, match="uint16"):
        module.affine_t(w, scales, biases, 1, bits, group, rows(1, 192), out)
    with pytest.raises(IndexError):
        module.affine_rows(w, scales, biases, kind, bits, group, np.array([OUT]), rows(1, 192))


def held(form: tuple, out: int, width: int) -> stored.Stored:
    """A weight of ``out`` rows by ``width``: ``(bits, group, scale dtype)`` packed, or
    ``(dtype,)`` float16 / bfloat16."""
    mx.random.seed(out * 100 + width + len(form))
    layer = nn.Linear(width, out, bias=False)
    if len(form) == 1:
        layer.weight = (layer.weight * 0.02).astype(form[0])
        matrix = stored.stored(layer)
    else:
        bits, group, scale = form
        packed = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
        packed.scales, packed.biases = packed.scales.astype(scale), packed.biases.astype(scale)
        matrix = stored.stored(packed)
    assert matrix is not None and matrix.form != "float32"
    return matrix


Q4, Q8, BF16 = (4, 64, mx.bfloat16), (8, 64, mx.bfloat16), (mx.bfloat16,)
# each case's matrices, their rows (a layer's q, k and v: k and v smaller, as under GQA;
# none a multiple of the kernel's 4 weight rows, some fewer than 4) and their input width
SHARED = {
    "q4": ((Q4, Q4, Q4), (13, 5, 3), 192),
    "q8": ((Q8, Q8), (13, 5), 192),
    "bf16": ((BF16, BF16, BF16), (13, 5, 3), 203),  # 203: values past the last whole chunk
    "mixed": (
        (Q4, (3, 32, mx.float32), (8, 128, mx.float16), (mx.float16,), BF16, (2, 64, mx.bfloat16)),
        (13, 5, 3, 2, 9, 7),
        384,
    ),
    "threads": ((Q4, Q8, BF16), (517, 130, 67), 512),  # enough work for OpenMP's threads
}


@pytest.mark.parametrize("n", [1, 8, 11])
@pytest.mark.parametrize("case", SHARED)
def test_products_of_one_x_equal_each_alone(case, n, path):
    """Several weights times the same rows in one call (``products_t``: q, k and v; gate and
    up) give each weight's own product, bit for bit, whatever their formats and sizes."""
    module = kernels()
    forms, sizes, width = SHARED[case]
    matrices = [held(form, out, width) for form, out in zip(forms, sizes, strict=True)]
    x = rows(n, width, seed=n)
    outs = [np.full((n, m.out_features), np.nan, dtype=np.float32) for m in matrices]
    module.products_t([m.kernel_args for m in matrices], x, outs)
    for matrix, out in zip(matrices, outs, strict=True):
        assert np.array_equal(out, matrix.product(x))
        for i in range(n):  # and each row as when it is multiplied alone
            assert np.array_equal(out[i : i + 1], matrix.product(x[i : i + 1]))
    together = stored.products(matrices, x)
    assert together is not None
    assert all(np.array_equal(a, b) for a, b in zip(together, outs, strict=True))


def test_products_refused():
    """A call of several products with a wrong shape, count or matrix is refused whole."""
    module = kernels()
    matrices = [held(Q4, 8, 128), held(BF16, 4, 128)]
    args, x = [m.kernel_args for m in matrices], rows(2, 128)
    with pytest.raises(ValueError, match="shapes"):
        module.products_t(args, x, [np.empty((2, 8), np.float32), np.empty((2, 5), np.float32)])
    with pytest.raises(ValueError, match="one out each"):
        module.products_t(args, x, [np.empty((2, 8), np.float32)])
    with pytest.raises(ValueError, match="one out each"):
        module.products_t(args * 5, x, [np.empty((2, 8), np.float32)] * 10)
    with pytest.raises(TypeError, match="tuple"):
        module.products_t([args[0][:3]], x, [np.empty((2, 8), np.float32)])
