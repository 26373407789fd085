"""The fast CPU kernels of HardSwish, HardSigmoid, GlobalAveragePool and Flatten give exactly the bits of the
forms they replace (issue 24: fewer passes and Python layers, never other answers).

The float32 activations compute in float32, not as the references do (float64, rounded once; the op suite checks
them within its tolerance): their oracle here is the float32 formula the kernels always computed, through numpy's
public calls. GlobalAveragePool's oracle is np.mean over the flattened spatial axis (the kernel's pairwise sum and
its rounding); other dtypes must reach the reference itself. Inputs cover every class of value (random bit
patterns: NaN payloads, infinities, subnormals, signed zeros) and the clip boundaries.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from kiln.ir import Graph, evaluate
from kiln.runtime import Program
from kiln.runtime import plan as plan_module
from kiln.runtime import profile
from kiln.runtime.kernels import cpu
from kiln.runtime.kernels.cpu import pool
from op_harness import build_single

F32 = np.float32
RNG = np.random.default_rng(24)


@pytest.fixture(autouse=True)
def numpy_kernels(monkeypatch):
    """These are the numpy kernels' bit-for-bit tests: the native extension, which takes HardSwish,
    HardSigmoid and GlobalAveragePool with its own rounding, is off here (tests/runtime/test_native.py)."""
    from kiln.runtime.kernels.cpu import native
    monkeypatch.setattr(native, "_native", None)
FLOATS = (np.float16, np.float32, np.float64)


def edge_values(dtype, n: int = 20000) -> np.ndarray:
    """Specials, the clip boundaries of HardSwish (x = +-3), random bit patterns and ordinary values."""
    dt = np.dtype(dtype)
    fi = np.finfo(dt)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        special = np.array([0.0, -0.0, 1, -1, 3, -3, 6, -6, 0.5, -0.5, np.inf, -np.inf, np.nan, -np.nan, fi.max,
                            -fi.max, fi.tiny, -fi.tiny, fi.smallest_subnormal, -fi.smallest_subnormal, 1e30, -1e30],
                           dt)
    boundary = np.array([np.nextafter(dt.type(v), dt.type(d)) for v in (3, -3, 0) for d in (-10, 10)], dt)
    patterns = RNG.integers(0, np.iinfo(bits).max, n, dtype=bits, endpoint=True).view(dt)
    ordinary = (RNG.standard_normal(n) * 10.0 ** RNG.integers(-3, 4, n)).astype(dt)
    near = RNG.uniform(-3.5, 3.5, n).astype(dt)
    return np.concatenate([special, boundary, patterns, ordinary, near])


def same_bits(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def bound_kernel(op: str, x: np.ndarray, attrs: dict):
    g, _ = build_single(op, [x], attrs)
    node = g.nodes[0]
    return cpu.choose(node, node.schema.fill_attrs(node.attrs)), g


def hard_sigmoid_f32(x, alpha, beta):
    y = np.multiply(x, F32(alpha), out=np.empty(x.shape, x.dtype))
    y += F32(beta)
    np.clip(y, 0.0, 1.0, out=y)
    return y


def hard_swish_f32(x):
    y = np.multiply(x, F32(1.0 / 6.0), out=np.empty(x.shape, x.dtype))
    y += 0.5
    np.clip(y, 0.0, 1.0, out=y)
    y *= x
    return y


SHAPES = [(4, 5, 6), (1, 16, 9, 8), (3,), ()]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_hard_swish_bits(dtype, shape):
    values = edge_values(dtype)
    n = int(np.prod(shape))
    for start in range(0, values.size - n + 1, max(n, 1) * 7 + 1):  # several slices of the value pool
        x = values[start:start + n].reshape(shape)
        kernel, g = bound_kernel("HardSwish", x, {})
        want = hard_swish_f32(x) if x.dtype == F32 else evaluate(g, [x])[0]
        same_bits(kernel(x.copy()), want)
        if x.ndim >= 2:  # a transposed view
            xt = np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
            same_bits(kernel(xt), want)
    x = values[:4096].reshape(16, 256)
    before = x.copy()
    kernel(x)
    same_bits(x, before)  # the fresh kernel leaves its input alone


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("alpha,beta", [(0.2, 0.5), (1 / 6, 0.5), (-0.3, 0.1), (0.0, -0.0), (2.5, -0.0),
                                        (1e-3, 0.9999)])
def test_hard_sigmoid_bits_and_in_place(dtype, alpha, beta):
    x = edge_values(dtype).reshape(-1, 2)[:10000]
    kernel, g = bound_kernel("HardSigmoid", x, {"alpha": alpha, "beta": beta})
    want = hard_sigmoid_f32(x, alpha, beta) if x.dtype == F32 else evaluate(g, [x])[0]
    same_bits(kernel(x.copy()), want)
    if x.dtype == F32:
        assert kernel.fresh and set(kernel.inplace) == {0}
        buf = x.copy()
        out = kernel.inplace[0](buf)
        assert out is buf
        same_bits(out, want)
        frozen = x.copy()
        frozen.flags.writeable = False  # the variant falls back to a fresh result
        out = kernel.inplace[0](frozen)
        assert not np.shares_memory(out, frozen)
        same_bits(out, want)
        same_bits(kernel.inplace[0](np.array(x[3, 0])), want[3, 0])  # 0-d


def test_hard_sigmoid_runs_in_place_in_a_plan(monkeypatch):
    monkeypatch.setattr(plan_module, "INPLACE_MIN_BYTES", 0)
    g = Graph("hs")
    x = g.add_input("x", "float32", ["batch", 64])
    g.outputs = [g.op("HardSigmoid", g.op("Neg", x), alpha=0.25, beta=0.4)]
    program = Program(g)
    ins = program.plan.instructions[-1]
    assert ins.node.op == "HardSigmoid" and ins.inplace == 0
    feed = RNG.standard_normal((3, 64)).astype(F32) * 8
    same_bits(program.run([feed], as_list=True)[0], hard_sigmoid_f32(-feed, 0.25, 0.4))


def mean_oracle(x: np.ndarray) -> np.ndarray:
    """The kernel's former body: np.mean over the flattened spatial axis."""
    n, c = x.shape[:2]
    return x.reshape(n, c, -1).mean(axis=2).reshape((n, c) + (1,) * (x.ndim - 2))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 16, 56, 56), (2, 3, 9, 8), (1, 24, 14, 14), (3, 5, 7), (2, 4, 3, 5, 6),
                                   (1, 8, 1, 1), (1, 3, 130, 129)], ids=str)
@pytest.mark.parametrize("values", ["edges", "normal", "large", "offset"])
def test_global_average_pool_bits(dtype, shape, values):
    n = int(np.prod(shape))
    if values == "edges":
        x = RNG.choice(edge_values(dtype), n)
    elif values == "normal":
        x = RNG.standard_normal(n)
    elif values == "large":  # sums that overflow to inf
        x = RNG.standard_normal(n) * float(np.finfo(dtype).max) / 4
    else:  # a large common part: the rounding of each partial sum shows
        x = 1000 + RNG.random(n)
    x = x.astype(dtype).reshape(shape)
    kernel, g = bound_kernel("GlobalAveragePool", x, {})
    want = mean_oracle(x) if x.dtype != np.float16 else evaluate(g, [x])[0]
    same_bits(kernel(x), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_average_pool_layouts_and_empty_batch(dtype):
    x = RNG.standard_normal((2, 7, 9, 6)).astype(dtype)
    kernel, g = bound_kernel("GlobalAveragePool", x, {})
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # channels-last memory
    for view in (nhwc, nhwc[:1], x[:, ::2], x[:, :, ::2]):
        same_bits(kernel(view), mean_oracle(view))
    empty = np.zeros((0, 7, 9, 6), dtype)  # np.mean's reshape(n, c, -1) refused an empty batch
    same_bits(kernel(empty), g.nodes[0].schema.reference(empty))


def test_global_average_pool_count_division_matches_float64():
    """The kernel divides a float32 sum by a float32 count; np.mean divided by an np.intp count (float64 division
    rounded to float32): the same bits for counts below 2^24, on every class of numerator."""
    sums = RNG.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(F32)
    for count in (1, 3, 7, 49, 196, 3136, 12544, 50176, (1 << 24) - 1, 1 << 24):
        assert count <= pool._EXACT_COUNT
        with np.errstate(all="ignore"):
            got = np.true_divide(sums, F32(count))
            want = np.true_divide(sums, np.intp(count), out=np.empty_like(sums), casting="unsafe")
        same_bits(got, want)


FLATTENS = [((1, 240, 1, 1), 1), ((2, 3, 4, 5), 0), ((2, 3, 4, 5), 2), ((2, 3, 4, 5), 4), ((2, 3, 4, 5), -1),
            ((2, 3, 4, 5), -4), ((0, 3, 4), 1), ((3,), 0), ((3,), 1)]


@pytest.mark.parametrize("shape,axis", FLATTENS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_flatten_is_a_view(shape, axis, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    kernel, g = bound_kernel("Flatten", x, {"axis": axis})
    assert not kernel.__qualname__.startswith("reference_kernel")
    want = evaluate(g, [x])[0]
    got = kernel(x)
    same_bits(got, want)
    if x.size:
        assert np.shares_memory(got, x)  # a view, no copy
    if x.ndim > 1:
        xt = x.swapaxes(0, -1)  # not contiguous: reshape copies, as the reference's does
        same_bits(kernel(xt), g.nodes[0].schema.reference(xt, axis=axis))


def test_flatten_runs_its_fast_kernel():
    """Flatten had no CPU kernel: it ran the IR reference (two np.prod calls, about 10 us, and 'reference' in
    kiln bench --profile). Now its program binds the view kernel and the profiler calls it fast."""
    assert ("", "Flatten") in cpu.KERNELS
    assert profile._kernel_kind(("", "Flatten")) == "fast"
    g = Graph("flat")
    x = g.add_input("x", "float32", ["batch", 240, 1, 1])
    g.outputs = [g.op("Flatten", g.op("Relu", x), axis=1)]
    program = Program(g)
    ins = program.plan.instructions[-1]
    assert ins.node.op == "Flatten" and ins.kernel.__qualname__.split(".")[0] == "flatten"
    feed = RNG.standard_normal((2, 240, 1, 1)).astype(F32)
    out = program.run([feed], as_list=True)[0]
    same_bits(out, np.maximum(feed, F32(0)).reshape(2, 240))
