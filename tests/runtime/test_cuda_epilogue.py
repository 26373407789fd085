"""The CUDA backend's epilogue fusion, N-d convolution/pooling and shared cuDNN workspace (issue 8).

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module); on the device machine:
``python -m pytest tests/runtime/test_cuda_epilogue.py``. Every case is checked against the
reference evaluator, and, where a library path may or may not fuse (cuDNN engines, cublasLt
heuristics), the numbers must agree whichever way it went."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes.shape_inference import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from kiln.runtime.kernels.cuda import codegen, cudnn as kcudnn, linalg, nn as knn  # noqa: E402
from op_harness import build_single  # noqa: E402

RNG = np.random.default_rng(3)


def _r(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def _close(got, want, rtol=1e-4, atol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


@pytest.fixture
def conv_mode():
    before = kcudnn.mode()
    knn.CONV_CHOICES.clear()
    yield kcudnn.set_mode
    kcudnn.set_mode(before)
    knn.CONV_CHOICES.clear()


def _run_both(g, feeds, **kw):
    """Outputs of the fused program (eager and CUDA-graph replay) and of the reference."""
    want = evaluate(g.copy(), feeds)
    eager = CudaProgram(g.copy(), output="numpy", cuda_graphs=False, **kw)
    graphed = CudaProgram(g.copy(), output="numpy", cuda_graphs=True, **kw)
    a = eager.run(feeds, as_list=True)
    b = graphed.run(feeds, as_list=True)
    b2 = graphed.run(feeds, as_list=True)  # the replay
    assert graphed.graph_failures == {}, graphed.graph_failures
    return eager, want, a, b, b2


# ---------------------------------------------------------------- the generated kernel's out=
def test_generated_kernel_writes_in_place_when_asked():
    g = Graph("ew")
    x = g.add_input("x", "float32", [6, 8])
    b = g.add_input("b", "float32", [8])
    g.outputs = [g.op("Tanh", g.op("Add", x, b))]
    infer_shapes(g)
    ew = codegen.ElementwiseKernel(codegen.body_from_graph(g))
    xs, bs = cp.asarray(_r(6, 8)), cp.asarray(_r(8))
    want = cp.tanh(xs + bs).get()
    ptr = xs.data.ptr
    (out,) = ew(xs, bs, out=xs)
    assert out.data.ptr == ptr
    _close(xs.get(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="out="):
        ew(cp.asarray(_r(6, 8)), bs, out=cp.empty((6, 7), cp.float32))


# ---------------------------------------------------------------- Conv epilogues
def _conv_block(batch, residual: bool, relu: bool, bias: bool = True, nsp: int = 2):
    g = Graph("block")
    spatial = [9] * nsp
    x = g.add_input("x", "float32", [batch, 16] + spatial)
    w = g.add_initializer("w", _r(16, 16, *([3] * nsp), scale=0.1))
    inputs = [x, w] + ([g.add_initializer("b", _r(16))] if bias else [])
    y = g.op("Conv", *inputs, pads=[1] * (2 * nsp))
    if residual:
        y = g.op("Add", y, x)
    if relu:
        y = g.op("Relu", y)
    g.outputs = [y]
    infer_shapes(g)
    return g, [_r(batch, 16, *spatial)]


@pytest.mark.parametrize("mode", ["cudnn", "im2col"])
@pytest.mark.parametrize("residual,relu", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_epilogue(mode, residual, relu, bias, conv_mode):
    if mode == "cudnn" and not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    conv_mode(mode)
    g, feeds = _conv_block(2, residual, relu, bias)
    eager, want, a, b, b2 = _run_both(g, feeds)
    for got in (a, b, b2):
        _close(got[0], want[0])
    assert eager.fused_epilogues == 1 and eager.fallback_ops == {}
    steps = "+".join(s for s, on in (("residual", residual), ("relu", relu)) if on)
    assert eager.epilogues == {f"conv with {steps}": 1}
    if mode == "cudnn":
        assert {e["path"] for e in knn.CONV_CHOICES.values()} == {"cudnn"}
        for e in knn.CONV_CHOICES.values():  # whatever cuDNN fused is a prefix of what was asked
            assert set(e["fused"]) <= {"bias", "residual", "relu"}


def test_resnet_style_downsample_block(conv_mode):
    conv_mode("auto")
    g = Graph("down")
    x = g.add_input("x", "float32", ["batch", 8, 10, 10])
    w1 = g.add_initializer("w1", _r(16, 8, 3, 3, scale=0.1))
    b1 = g.add_initializer("b1", _r(16))
    w2 = g.add_initializer("w2", _r(16, 8, 1, 1, scale=0.3))
    main = g.op("Conv", x, w1, b1, pads=[1, 1, 1, 1], strides=[2, 2])
    short = g.op("Conv", x, w2, strides=[2, 2])
    g.outputs = [g.op("Relu", g.op("Add", main, short))]
    infer_shapes(g)
    for batch in (2, 9):  # im2col and (where it builds) cuDNN under the auto rule
        eager, want, a, b, b2 = _run_both(g, [_r(batch, 8, 10, 10)])
        for got in (a, b, b2):
            _close(got[0], want[0])
        assert eager.fused_epilogues == 1
        assert list(eager.epilogues) == ["conv with residual+relu"]


# ---------------------------------------------------------------- MatMul / Gemm epilogues
def _linear(kind: str, batch_dims=(3, 5), k=32, n=24, tail="Gelu"):
    g = Graph("linear")
    x = g.add_input("x", "float32", ["batch", *batch_dims[1:], k])
    if kind == "matmul":
        y = g.op("MatMul", x, g.add_initializer("w", _r(k, n, scale=0.2)))
    elif kind == "matmul_transposed":  # a Linear layer as traced: Transpose of the [n, k] weight
        y = g.op("MatMul", x, g.op("Transpose", g.add_initializer("w", _r(n, k, scale=0.2)), perm=[1, 0]))
    elif kind == "gemm":
        y = g.op("Gemm", x, g.add_initializer("w", _r(n, k, scale=0.2)), transB=1)
    else:
        raise ValueError(kind)
    y = g.op("Add", y, g.add_initializer("bias", _r(n)))
    if tail:
        y = g.op(tail, y)
    g.outputs = [y]
    infer_shapes(g)
    return g


@pytest.mark.parametrize("kind,tail,strategy", [
    ("matmul", "Gelu", "cublasLt bias + generated epilogue (Gelu)"),
    ("matmul_transposed", "Gelu", "cublasLt bias + generated epilogue (Gelu)"),
    ("matmul", None, "cublasLt bias"),
    ("gemm", "Relu", "cublasLt bias+relu"),
    ("gemm", "Tanh", "cublasLt bias + generated epilogue (Tanh)"),
])
def test_linear_epilogue(kind, tail, strategy):
    batch_dims = (3, 5) if kind != "gemm" else (7,)
    g = _linear(kind, batch_dims, tail=tail)
    feeds = [_r(*batch_dims, 32)]
    eager, want, a, b, b2 = _run_both(g, feeds)
    for got in (a, b, b2):
        _close(got[0], want[0])
    assert eager.fallback_ops == {}
    assert eager.epilogues == {strategy: 1}


@pytest.mark.parametrize("bias,tail,strategy", [
    (True, None, "cublasLt bias+residual"),
    (False, None, "cublasLt residual"),
    (True, "Gelu", "cublasLt bias+residual + generated epilogue (Gelu)"),
    (False, "Relu", "cublasLt residual + generated epilogue (Relu)"),
])
def test_linear_with_residual_add_in_cublaslt(bias, tail, strategy):
    """A transformer's ``x + linear(h)`` (with or without a bias: zero biases are removed at export):
    the residual is cublasLt's C operand, the rest of the epilogue one generated kernel."""
    g = Graph("residual")
    h = g.add_input("h", "float32", ["batch", 5, 32])
    x = g.add_input("x", "float32", ["batch", 5, 24])
    y = g.op("MatMul", h, g.op("Transpose", g.add_initializer("w", _r(24, 32, scale=0.2)), perm=[1, 0]))
    if bias:
        y = g.op("Add", y, g.add_initializer("bias", _r(24)))
    y = g.op("Add", x, y)  # the residual first, as transformers write it
    if tail:
        y = g.op(tail, y)
    g.outputs = [y]
    infer_shapes(g)
    feeds = [_r(3, 5, 32), _r(3, 5, 24)]
    eager, want, a, b, b2 = _run_both(g, feeds)
    for got in (a, b, b2):
        _close(got[0], want[0])
    assert eager.fallback_ops == {} and eager.epilogues == {strategy: 1}


def test_relu_between_bias_and_residual_keeps_the_residual_out_of_cublaslt():
    """relu(x W + b) + r: cublasLt adds C before its ReLU epilogue, so the residual stays in the generated kernel."""
    g = Graph("relu_first")
    h = g.add_input("h", "float32", ["batch", 32])
    r = g.add_input("r", "float32", ["batch", 24])
    y = g.op("Relu", g.op("Add", g.op("MatMul", h, g.add_initializer("w", _r(32, 24, scale=0.2))),
                          g.add_initializer("bias", _r(24))))
    g.outputs = [g.op("Add", y, r)]
    infer_shapes(g)
    eager, want, a, b, b2 = _run_both(g, [_r(7, 32), _r(7, 24)])
    for got in (a, b, b2):
        _close(got[0], want[0])
    assert eager.epilogues == {"cublasLt bias+relu + generated epilogue (Add)": 1}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cublaslt_residual_operand(dtype):
    m, k, n = 33, 40, 24
    a, b, r = _r(m, k).astype(dtype), _r(k, n).astype(dtype), _r(m, n).astype(dtype)
    want = a.astype(np.float64) @ b.astype(np.float64) + r
    for bias in (None, _r(n).astype(dtype)):
        lt = linalg.LtBias(None if bias is None else cp.asarray(bias))
        got = lt(cp.asarray(a), cp.asarray(b), cp.asarray(r))
        assert got is not None
        w = want if bias is None else want + bias
        tol = 1e-5 if dtype == np.float32 else 2e-2
        _close(got.get().astype(np.float64), w, rtol=tol, atol=tol)
        r_t = cp.asarray(np.ascontiguousarray(r.T)).T  # the right shape, not contiguous: refused
        assert lt(cp.asarray(a), cp.asarray(b), r_t) is None


def test_gemm_with_its_own_bias_then_relu_runs_the_generated_epilogue():
    g = Graph("gemm_c")
    x = g.add_input("x", "float32", [6, 10])
    y = g.op("Gemm", x, g.add_initializer("w", _r(10, 4)), g.add_initializer("c", _r(4)), alpha=0.5)
    g.outputs = [g.op("Relu", y)]
    infer_shapes(g)
    eager, want, a, b, b2 = _run_both(g, [_r(6, 10)])
    for got in (a, b, b2):
        _close(got[0], want[0])
    assert eager.epilogues == {"Gemm kernel + generated epilogue (Relu)": 1}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("relu", [False, True])
def test_cublaslt_bias_layouts(ta, tb, relu, dtype):
    m, k, n = 33, 20, 17
    a = _r(k, m, dtype=dtype).T if ta else _r(m, k, dtype=dtype)
    b = _r(n, k, dtype=dtype).T if tb else _r(k, n, dtype=dtype)
    bias = _r(n, dtype=dtype)
    want = a.astype(np.float64) @ b.astype(np.float64) + bias
    if relu:
        want = np.maximum(want, 0)
    da = cp.asarray(np.ascontiguousarray(a.T)).T if ta else cp.asarray(a)
    db = cp.asarray(np.ascontiguousarray(b.T)).T if tb else cp.asarray(b)
    got = linalg.LtBias(cp.asarray(bias), relu=relu)(da, db)
    assert got is not None, "cublasLt refused a plain layout"
    tol = 1e-5 if dtype == np.float32 else 1e-12
    _close(got.get().astype(np.float64), want, rtol=tol, atol=tol)


# ---------------------------------------------------------------- N-d convolution and pooling, the last ops
# (ConvTranspose, Mod, DequantizeLinear) that used to run on the host
ND_CASES = [
    ("Conv", [_r(2, 4, 17), _r(6, 4, 3, scale=0.3), _r(6)], {"pads": [1, 2], "strides": [2]}, (1, 2)),
    ("Conv", [_r(2, 4, 11), _r(4, 1, 5, scale=0.3)], {"group": 4, "dilations": [2], "pads": [4, 4]}, (1,)),
    ("Conv", [_r(2, 4, 5, 6, 7), _r(6, 4, 3, 3, 3, scale=0.2), _r(6)], {"pads": [1] * 6}, (1, 2)),
    ("Conv", [_r(9, 4, 5, 6, 7), _r(6, 4, 1, 3, 3, scale=0.2)], {"strides": [1, 2, 2]}, (1,)),
    ("Conv", [_r(9, 4, 33), _r(8, 4, 3, scale=0.3)], {"auto_pad": "SAME_UPPER"}, (1,)),
    ("ConvTranspose", [_r(2, 4, 5, 6), _r(4, 3, 3, 3, scale=0.3), _r(3)], {}, (1, 2)),
    ("ConvTranspose", [_r(2, 4, 5, 6), _r(4, 3, 3, 2, scale=0.3)],
     {"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2], "dilations": [1, 2]}, (1,)),
    ("ConvTranspose", [_r(1, 6, 5, 5), _r(6, 2, 3, 3, scale=0.3)], {"group": 3, "strides": [2, 2]}, (1,)),
    ("ConvTranspose", [_r(2, 4, 7), _r(4, 5, 4, scale=0.3), _r(5)], {"strides": [2], "auto_pad": "SAME_UPPER"},
     (1, 2)),
    ("ConvTranspose", [_r(1, 3, 3, 4, 5), _r(3, 2, 2, 2, 2, scale=0.3)], {"strides": [2, 2, 2]}, (1,)),
    ("ConvTranspose", [_r(1, 3, 5, 5), _r(3, 2, 3, 3, scale=0.3)], {"strides": [2, 2], "output_shape": [12, 11]},
     (1,)),
    # weights computed in the graph (graph inputs here), not constants
    ("Conv", [_r(2, 4, 7, 8), _r(6, 2, 3, 3), _r(6)], {"group": 2, "pads": [1, 1, 1, 1], "strides": [1, 2]}, ()),
    ("Conv", [_r(2, 4, 9), _r(3, 4, 2)], {"dilations": [2]}, ()),
    ("ConvTranspose", [_r(2, 4, 5, 6), _r(4, 3, 3, 3), _r(3)], {"strides": [2, 1]}, ()),
    ("Mod", [np.array([7, -7, 9, -9], np.int64), np.array([2, 3, -4, 4], np.int64)], {}, ()),
    ("Mod", [_r(6), np.abs(_r(6)) + 0.5], {"fmod": 1}, ()),
    ("DequantizeLinear", [RNG.integers(-128, 127, (2, 3, 4)).astype(np.int8), np.abs(_r(3)) + 0.01,
                          RNG.integers(-5, 5, 3).astype(np.int8)], {"axis": 1}, ()),
    ("MaxPool", [_r(2, 3, 20)], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, ()),
    ("MaxPool", [_r(2, 3, 6, 7, 8)], {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "ceil_mode": 1}, ()),
    ("MaxPool", [np.where(RNG.random((2, 3, 11, 10)) < 0.02, np.nan, _r(2, 3, 11, 10)).astype(np.float32)],
     {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "dilations": [1, 2], "pads": [1, 0, 1, 2]}, ()),
    ("MaxPool", [_r(2, 3, 9, 9).astype(np.float64)], {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER"}, ()),
    ("AveragePool", [_r(2, 3, 20)], {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}, ()),
    ("AveragePool", [_r(2, 3, 20)], {"kernel_shape": [4], "strides": [3], "pads": [1, 2],
                                     "count_include_pad": 1, "ceil_mode": 1}, ()),
    ("AveragePool", [_r(1, 2, 5, 6, 7)], {"kernel_shape": [3, 3, 3], "pads": [1] * 6}, ()),
]


@pytest.mark.parametrize("mode", ["auto", "im2col", "cudnn"])
@pytest.mark.parametrize("op,inputs,attrs,const", ND_CASES, ids=[f"{c[0]}{len(c[1][0].shape)}r_{i}"
                                                                for i, c in enumerate(ND_CASES)])
def test_nd_conv_and_pool_native(op, inputs, attrs, const, mode, conv_mode):
    if op != "Conv" and mode != "auto":
        pytest.skip("one path only")
    if mode == "cudnn" and not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    conv_mode(mode)
    g, feeds = build_single(op, inputs, attrs, const_inputs=const)
    want = evaluate(g, feeds)[0]
    p = CudaProgram(g, output="numpy", cuda_graphs=False)
    got = p.run(feeds, as_list=True)[0]
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want)
    else:
        assert np.array_equal(np.isnan(got), np.isnan(want))
        _close(np.nan_to_num(got), np.nan_to_num(want), rtol=2e-5, atol=2e-5)
    assert p.fallback_ops == {}


# ---------------------------------------------------------------- the shared cuDNN workspace
def test_cudnn_workspace_is_shared_per_stream(conv_mode):
    if not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    conv_mode("cudnn")
    g = Graph("convs")
    x = g.add_input("x", "float32", [4, 8, 16, 16])
    y = x
    for i, (m, k) in enumerate([(16, 3), (32, 5), (16, 1), (8, 7)]):
        c = y.type.shape[1] if y.type is not None else 8
        y = g.op("Conv", y, g.add_initializer(f"w{i}", _r(m, c, k, k, scale=0.05)), pads=[k // 2] * 4)
        infer_shapes(g)
    g.outputs = [y]
    infer_shapes(g)
    kcudnn._WORKSPACES.clear()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        p = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
        got = p.run([_r(4, 8, 16, 16)], as_list=True)[0]
        stream.synchronize()
    mine = [k for k in kcudnn._WORKSPACES if k[1] == stream.ptr]
    assert len(mine) <= 1  # one buffer for every convolution on the stream (none if no plan needs one)
    if mine:
        assert kcudnn.pinned(stream) == [kcudnn._WORKSPACES[mine[0]]]
    assert got.shape == (4, 8, 16, 16)


def test_matmul_scale_becomes_the_gemm_alpha():
    g = Graph("scores")
    q = g.add_input("q", "float32", ["batch", 4, 16, 8])
    k = g.add_input("k", "float32", ["batch", 4, 8, 16])
    s = g.op("Mul", g.op("MatMul", q, k), g.add_constant(np.array(0.125, np.float32)))
    g.outputs = [g.op("Softmax", s, axis=-1)]
    infer_shapes(g)
    eager, want, a, b, b2 = _run_both(g, [_r(2, 4, 16, 8), _r(2, 4, 8, 16)])
    for got in (a, b, b2):
        _close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert eager.epilogues == {"cuBLAS alpha": 1}
