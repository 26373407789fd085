"""Reductions over every element on the GPU (runtime/kernels/cuda/reduce_all.py) against the op
references: dtypes, sizes around the vector width and block counts, NaN, strided inputs,
keepdims, and inside a captured CUDA graph.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes.shape_inference import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from kiln.runtime.kernels.cuda.reduce_all import reduce_all  # noqa: E402

RNG = np.random.default_rng(3)
SIZES = [1, 3, 15, 16, 17, 255, 4096 + 3, 1 << 20, 4_816_896]


def _data(n, dtype):
    if np.dtype(dtype).kind == "f":
        return RNG.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return RNG.integers(max(info.min, -1000), min(info.max, 1000), n).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8])
@pytest.mark.parametrize("n", SIZES)
def test_max_min_match_numpy(dtype, n):
    x = _data(n, dtype)
    for op, fn in (("max", np.max), ("min", np.min)):
        got = reduce_all(op, cp.asarray(x), False).get()
        assert got.dtype == x.dtype and got.shape == ()
        assert got == fn(x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("n", SIZES)
def test_sum_matches_a_float64_sum(dtype, n):
    x = _data(n, dtype)
    got = reduce_all("sum", cp.asarray(x), True).get()
    assert got.shape == (1,) and got.dtype == x.dtype
    want = x.astype(np.float64).sum() if x.dtype.kind == "f" else x.sum()
    np.testing.assert_allclose(got[0], want, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_nan_propagates_and_strided_inputs_work():
    x = RNG.standard_normal((64, 33)).astype(np.float32)
    x[7, 5] = np.nan
    assert np.isnan(reduce_all("max", cp.asarray(x), False).get())
    assert np.isnan(reduce_all("min", cp.asarray(x), False).get())
    y = cp.asarray(RNG.standard_normal((40, 50)).astype(np.float32))[::3, 1::2]
    assert reduce_all("max", y, False).get() == y.get().max()


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceSum"])
def test_ops_use_it_and_graphs_capture_it(op):
    g = Graph("r")
    x = g.add_input("x", "float32", [32, 3, 224, 224])
    r = g.op(op, g.op("Abs", x), keepdims=0)
    g.outputs = [g.op("Relu", g.op("Sub", x, r))]
    infer_shapes(g)
    p = CudaProgram(g, output="numpy", cuda_graphs=True)
    for _ in range(3):
        a = RNG.standard_normal((32, 3, 224, 224)).astype(np.float32)
        np.testing.assert_allclose(p.run([a], as_list=True)[0], evaluate(g, [a])[0], rtol=1e-5, atol=1e-4)
    assert p.captured_graphs() == 1 and p.fallback_ops == {}
