"""The CUDA backend (issue 8): CudaProgram against the reference evaluator and torch.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module); on the device machine:
``python -m pytest tests/runtime/test_cuda.py`` (bench/gpu_smoke.py runs it with the rest).
Tolerances are float32's (TF32 is off by default)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

import kiln  # noqa: E402
from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes.shape_inference import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from op_harness import build_single  # noqa: E402

RNG = np.random.default_rng(0)


def _r(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _close(got, want, rtol=1e-5, atol=1e-6):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


# (op, inputs, attrs, const_inputs): one case per kernel family, each expected to run natively.
OP_CASES = [
    ("Add", [_r(4, 5), _r(5)], {}, ()),
    ("Sub", [_r(3, 1, 4), _r(2, 1)], {}, ()),
    ("Div", [np.array([7, -7, 9, -9], np.int64), np.array([2, 2, -4, 4], np.int64)], {}, ()),
    ("Pow", [np.abs(_r(6)), _r(6)], {}, ()),
    ("Max", [_r(3, 4), _r(4), _r(3, 1)], {}, ()),
    ("Sum", [_r(3, 4), _r(4)], {}, ()),
    ("Relu", [_r(1000)], {}, ()),
    ("Gelu", [_r(257)], {}, ()),
    ("Gelu", [_r(64)], {"approximate": "tanh"}, ()),
    ("Sigmoid", [_r(4, 4) * 30], {}, ()),
    ("Erf", [_r(100)], {}, ()),
    ("Softplus", [_r(100) * 50], {}, ()),
    ("HardSwish", [_r(100) * 4], {}, ()),
    ("Clip", [_r(5, 5), np.array(-0.5, np.float32), np.array(0.5, np.float32)], {}, (1, 2)),
    ("Where", [RNG.random((3, 4)) > 0.5, _r(3, 4), _r(4)], {}, ()),
    ("Cast", [_r(10) * 10], {"to": 7}, ()),
    ("Equal", [np.array([1, 2, 3], np.int32), np.array([1, 0, 3], np.int32)], {}, ()),
    ("IsInf", [np.array([1, np.inf, -np.inf, np.nan], np.float32)], {"detect_negative": 0}, ()),
    ("MatMul", [_r(2, 3, 8, 16), _r(16, 5)], {}, (1,)),
    ("MatMul", [_r(2, 8, 16), _r(2, 16, 5)], {}, ()),
    ("Gemm", [_r(4, 6), _r(5, 6), _r(5)], {"transB": 1, "alpha": 0.5, "beta": 2.0}, (1, 2)),
    ("Conv", [_r(2, 4, 9, 9), _r(6, 4, 3, 3), _r(6)], {"pads": [1, 1, 1, 1], "strides": [2, 2]}, (1, 2)),
    ("Conv", [_r(1, 6, 8, 8), _r(6, 2, 3, 3)], {"group": 3, "dilations": [2, 2]}, (1,)),
    ("Conv", [_r(1, 4, 7, 7), _r(4, 1, 3, 3)], {"group": 4, "pads": [1, 1, 1, 1]}, (1,)),
    ("Conv", [_r(2, 8, 5, 5), _r(3, 8, 1, 1)], {}, (1,)),
    ("MaxPool", [_r(1, 3, 9, 9)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ()),
    ("AveragePool", [_r(1, 2, 7, 7)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, ()),
    ("GlobalAveragePool", [_r(2, 3, 5, 5)], {}, ()),
    ("BatchNormalization", [_r(2, 3, 4, 4), _r(3), _r(3), _r(3), np.abs(_r(3)) + 0.5], {}, (1, 2, 3, 4)),
    ("LayerNormalization", [_r(2, 5, 16), _r(16), _r(16)], {}, ()),
    ("Softmax", [_r(3, 7) * 10], {"axis": -1}, ()),
    ("LogSoftmax", [_r(3, 7)], {"axis": 0}, ()),
    ("ReduceMean", [_r(3, 4, 5), np.array([1], np.int64)], {"keepdims": 0}, (1,)),
    ("ReduceMax", [_r(3, 4, 5), np.array([0, 2], np.int64)], {}, (1,)),
    ("ArgMax", [_r(3, 6)], {"axis": 1, "select_last_index": 1}, ()),
    ("Reshape", [_r(2, 3, 4), np.array([0, -1], np.int64)], {}, (1,)),
    ("Transpose", [_r(2, 3, 4)], {"perm": [2, 0, 1]}, ()),
    ("Concat", [_r(2, 3), _r(2, 1)], {"axis": 1}, ()),
    ("Split", [_r(6, 2)], {"axis": 0, "num_outputs": 3}, ()),
    ("Slice", [_r(5, 6), np.array([1, -1], np.int64), np.array([4, 0], np.int64), np.array([0, 1], np.int64),
               np.array([2, -2], np.int64)], {}, (1, 2, 3, 4)),
    ("Gather", [_r(10, 4), np.array([[1, -1], [0, 9]], np.int64)], {"axis": 0}, ()),
    ("GatherElements", [_r(3, 4), np.array([[0, 1, 2, 3]] * 3, np.int64) % 3], {"axis": 0}, ()),
    ("Expand", [_r(3, 1), np.array([2, 3, 4], np.int64)], {}, (1,)),
    ("Pad", [_r(2, 3), np.array([1, 0, 0, 2], np.int64)], {}, (1,)),
    ("Trilu", [_r(4, 4)], {"upper": 0}, ()),
    ("CumSum", [_r(3, 5), np.array(1, np.int64)], {"reverse": 1}, (1,)),
    ("Tile", [_r(2, 3), np.array([2, 1], np.int64)], {}, (1,)),
    ("ConstantOfShape", [np.array([2, 3], np.int64)], {"value": np.array([1.5], np.float32)}, (0,)),
]


@pytest.mark.parametrize("op,inputs,attrs,const", OP_CASES, ids=[f"{c[0]}{i}" for i, c in enumerate(OP_CASES)])
def test_op_matches_reference_natively(op, inputs, attrs, const):
    num_outputs = attrs.get("num_outputs") if op == "Split" else None
    g, feeds = build_single(op, inputs, attrs, const_inputs=const, num_outputs=num_outputs)
    want = evaluate(g, feeds)
    p = CudaProgram(g, output="numpy", cuda_graphs=False)
    got = p.run(feeds, as_list=True)
    for o, w in zip(got, want):
        _close(o, w, rtol=2e-5, atol=2e-6)
    assert p.fallback_ops == {}, f"{op} fell back to the host: {p.fallback_ops}"


def test_host_fallback_is_counted_and_correct(monkeypatch):
    # Every registered op has a CUDA kernel now; without one, a node runs on the host and says so.
    from kiln.runtime.kernels import cuda
    monkeypatch.delitem(cuda.KERNELS, ("", "ConvTranspose"))
    g, feeds = build_single("ConvTranspose", [_r(1, 2, 4, 4), _r(2, 3, 3, 3)], {}, const_inputs=(1,))
    p = CudaProgram(g, output="numpy", cuda_graphs=False)
    _close(p.run(feeds, as_list=True)[0], evaluate(g, feeds)[0], rtol=1e-5, atol=1e-6)
    assert p.fallback_ops == {"ConvTranspose": 1}


def _rows(shape, dtype):
    """Random rows with some structure the kernels must survive: a -inf and a large value in
    the first row."""
    x = (_r(*shape, dtype=dtype) * 4).astype(dtype)
    if x.shape[-1] > 2:
        x.reshape(-1, x.shape[-1])[0, :2] = (-np.inf, 80.0)
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5, 1), (3, 7), (2, 12, 33), (4, 128), (64, 1000), (3, 1024), (2, 1025),
                                   (3, 5000), (2, 9000)])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_fused_softmax_last_axis(op, shape, dtype):
    from kiln.runtime.kernels.cuda import rowwise
    x = _rows(shape, dtype)
    g, feeds = build_single(op, [x], {"axis": -1})
    want = evaluate(g, feeds)[0]
    before = dict(rowwise.LAUNCHES)
    got = CudaProgram(g, output="numpy", cuda_graphs=False).run(feeds, as_list=True)[0]
    _close(got, want, rtol=2e-5 if dtype == np.float32 else 1e-12, atol=2e-6 if dtype == np.float32 else 1e-14)
    variant = "warp" if shape[-1] <= rowwise.WARP_MAX_D else "block"
    assert rowwise.LAUNCHES[variant] == before[variant] + 1


def test_softmax_other_axis_and_strided_input():
    # Not the last axis: the CuPy path; a transposed device input to the fused path.
    x = _r(6, 5, 4)
    g, feeds = build_single("Softmax", [x], {"axis": 1})
    _close(CudaProgram(g, output="numpy", cuda_graphs=False).run(feeds, as_list=True)[0], evaluate(g, feeds)[0])
    g, _ = build_single("Softmax", [np.ascontiguousarray(x.transpose(2, 1, 0))], {"axis": -1})
    xt = cp.asarray(x).transpose(2, 1, 0)
    got = CudaProgram(g, output="numpy", cuda_graphs=False).run([xt], as_list=True)[0]
    _close(got, evaluate(g, [x.transpose(2, 1, 0)])[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axis,affine", [
    ((2, 5, 16), -1, (16,)), ((128, 768), -1, (768,)), ((3, 4, 8, 40), -2, (8, 40)), ((2, 3, 2000), -1, (2000,)),
    ((4, 6, 10), -2, (10,)), ((7, 33), 1, (1,))])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_norm(shape, axis, affine, bias, dtype):
    from kiln.runtime.kernels.cuda import rowwise
    # A large mean (against std 3): a one-pass E[x^2] - E[x]^2 would cancel to noise in float32.
    x = (_r(*shape, dtype=dtype) * 3 + (100 if dtype == np.float32 else 1000)).astype(dtype)
    inputs = [x, _r(*affine, dtype=dtype), _r(*affine, dtype=dtype) if bias else None]
    g, feeds = build_single("LayerNormalization", inputs, {"axis": axis, "epsilon": 1e-5}, const_inputs=(1, 2),
                            num_outputs=3)
    want = evaluate(g, feeds)
    before = rowwise.LAUNCHES["warp"] + rowwise.LAUNCHES["block"]
    got = CudaProgram(g, output="numpy", cuda_graphs=False).run(feeds, as_list=True)
    assert rowwise.LAUNCHES["warp"] + rowwise.LAUNCHES["block"] == before + 1
    tol = dict(rtol=5e-5, atol=5e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    for o, w in zip(got, want):
        _close(o, w, **tol)


def test_layer_norm_in_a_captured_graph():
    g = Graph("ln")
    x = g.add_input("x", "float32", ["batch", 8, 96])
    y = g.op("LayerNormalization", x, g.add_initializer("s", _r(96)), g.add_initializer("b", _r(96)), axis=-1)
    g.outputs = [g.op("Softmax", y, axis=-1)]
    infer_shapes(g)
    p = CudaProgram(g.copy(), output="numpy", cuda_graphs=True)
    for batch in (2, 2, 3):
        xs = _r(batch, 8, 96)
        _close(p.run([xs], as_list=True)[0], evaluate(g, [xs])[0])
    assert p.graph_failures == {} and p.captured_graphs() == 2


def test_weights_read_only_through_a_kernels_copy_are_not_uploaded_twice():
    g = Graph("convs")
    x = g.add_input("x", "float32", [2, 4, 6, 6])
    w = g.add_initializer("w", _r(6, 4, 3, 3))     # read only by a Conv (which keeps its own layout)
    w2 = g.add_initializer("w2", _r(4, 4, 3, 3))   # read by a Conv and by a Mul: must stay uploaded
    m = g.add_initializer("m", _r(96, 10))          # read only by a MatMul (its own copy)
    y = g.op("Conv", g.op("Conv", x, w2, pads=[1, 1, 1, 1]), w)
    out = g.op("MatMul", g.op("Reshape", y, g.add_constant(np.array([2, -1], np.int64))), m)
    g.outputs = [out, g.op("Mul", w2, g.add_constant(np.array(2.0, np.float32)))]
    infer_shapes(g)
    want_graph = g.copy()
    p = CudaProgram(g, output="numpy", cuda_graphs=False, fuse=False)
    assert sorted(p.constants_not_uploaded) == ["m", "w"]
    on_device = sum(a.nbytes for a in p._template if isinstance(a, cp.ndarray))
    assert on_device == w2.const.nbytes
    xs = _r(2, 4, 6, 6)
    for o, want in zip(p.run([xs], as_list=True), evaluate(want_graph, [xs])):
        _close(o, want, rtol=2e-5, atol=2e-5)


def _chain(shape, dtype="float32"):
    g = Graph("chain")
    x = g.add_input("x", dtype, shape)
    one, two, half = (g.add_constant(np.array(v, np.float32)) for v in (1.0, 2.0, 0.5))
    y = g.op("Add", x, one)
    y = g.op("Mul", y, two)
    y = g.op("Relu", y)
    y = g.op("Sub", y, half)
    y = g.op("Sigmoid", y)
    g.outputs = [y]
    infer_shapes(g)
    return g


@pytest.mark.parametrize("shape", [(64, 64), (3, 5, 7), ("batch", 33)])
def test_fused_chain(shape):
    g = _chain(list(shape))
    p = kiln.load(g, device="cuda", output="cupy", cuda_graphs=False)
    assert p.fused_groups == 1 and [n.op for n in p.graph.nodes] == ["FusedElementwise"]
    concrete = tuple(5 if d == "batch" else d for d in shape)
    x = _r(*concrete)
    got = p.run([x], as_list=True)[0]
    assert isinstance(got, cp.ndarray)
    _close(got.get(), evaluate(_chain(list(shape)), [x])[0])
    launcher = p.plan.instructions[0].kernel.launcher
    # The 4-wide path runs exactly when the size is a multiple of 4 (inputs are fresh, aligned).
    assert launcher.vector_launches == (1 if x.size % 4 == 0 else 0)


def test_fused_broadcast_and_strided_inputs():
    g = Graph("bcast")
    x = g.add_input("x", "float32", [8, 6, 5])
    b = g.add_input("b", "float32", [6, 1])
    s = g.add_input("s", "float32", [5])
    y = g.op("Tanh", g.op("Mul", g.op("Add", x, b), s))
    z = g.op("Greater", y, g.add_constant(np.array(0.25, np.float32)))
    g.outputs = [y, z]
    infer_shapes(g)
    want_graph = g.copy()
    p = CudaProgram(g, cuda_graphs=False)
    assert p.fused_groups == 1
    xs, bs, ss = _r(8, 6, 5), _r(6, 1), _r(5)
    # A transposed (non-contiguous) device input takes the strided path.
    xt = cp.asarray(np.ascontiguousarray(xs.transpose(2, 1, 0))).transpose(2, 1, 0)
    got = p.run([xt, cp.asarray(bs), ss], as_list=True)
    want = evaluate(want_graph, [xs, bs, ss])
    _close(got[0].get(), want[0])
    _close(got[1].get(), want[1])


def test_cuda_graph_replay_matches_eager():
    g = _mlp_graph()
    eager = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
    graphed = CudaProgram(g.copy(), output="numpy", cuda_graphs=True)
    for batch in (3, 3, 5, 3):
        x = _r(batch, 16)
        a = eager.run([x], as_list=True)[0]
        b = graphed.run([x], as_list=True)[0]
        _close(b, a, rtol=1e-6, atol=1e-7)
        _close(b, evaluate(g, [x])[0], rtol=1e-5, atol=1e-6)
    assert graphed.graph_failures == {}
    assert graphed.captured_graphs() == 2


def test_cuda_graph_outputs_are_not_overwritten_by_the_next_replay():
    p = CudaProgram(_mlp_graph(), cuda_graphs=True)
    x1, x2 = _r(4, 16), _r(4, 16)
    first = p.run([x1], as_list=True)[0]
    kept = first.get()
    p.run([x2], as_list=True)
    _close(first.get(), kept, rtol=0, atol=0)


def _mlp_graph():
    g = Graph("mlp")
    x = g.add_input("x", "float32", ["batch", 16])
    w1 = g.add_initializer("w1", _r(16, 32))
    b1 = g.add_initializer("b1", _r(32))
    w2 = g.add_initializer("w2", _r(32, 8))
    h = g.op("Relu", g.op("Add", g.op("MatMul", x, w1), b1))
    y = g.op("Softmax", g.op("MatMul", h, w2), axis=-1)
    g.outputs = [y]
    infer_shapes(g)
    return g


def test_inputs_checked_like_the_cpu_runtime():
    p = CudaProgram(_mlp_graph())
    with pytest.raises(kiln.InputError, match="input 'x'"):
        p.run([cp.zeros((2, 15), cp.float32)])
    with pytest.raises(kiln.InputError, match="input 'x'"):
        p.run([np.zeros((2, 16), np.float64)])


@pytest.fixture(scope="module")
def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["mlp", "resnet18", "resnet50", "mobilenet_v3", "transformer_encoder", "gpt",
                                  "dict_outputs", "sdpa", "hf_bert", "hf_gpt2"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_zoo_matches_torch(name, graphs, _torch, tmp_path):
    import importlib.util

    import zoo
    from kiln.frontend.tracer import to_numpy
    entry = zoo.by_name(name)
    if entry.needs is not None and importlib.util.find_spec(entry.needs) is None:
        pytest.skip(f"{entry.needs} is not installed")
    model, inputs, spec = entry.factory()
    try:
        graph = kiln.trace(model, inputs, dynamic=spec)
    except (kiln.KilnError, AttributeError) as e:  # the tracer vs this machine's torch/transformers
        pytest.skip(f"tracing {name} fails here (a frontend issue, not the CUDA backend's): {e}")
    p = kiln.load(kiln.save(graph, tmp_path / f"{name}.kiln"), device="cuda", output="numpy", cuda_graphs=graphs)
    names, tensors = zoo.input_list(model, inputs)
    with _torch.no_grad():
        want = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    got = p.run([to_numpy(t) for t in tensors], as_list=True)
    flat = _flat(want, _torch, to_numpy)
    assert len(got) == len(flat)
    for o, w in zip(got, flat):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5, err_msg=f"{name}: {p.fallback_ops}")


def _flat(out, torch_mod, to_numpy):
    if isinstance(out, torch_mod.Tensor):
        return [to_numpy(out)]
    if isinstance(out, dict):
        return [a for v in out.values() for a in _flat(v, torch_mod, to_numpy)]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [a for v in out for a in _flat(v, torch_mod, to_numpy)]


# ---------------------------------------------------------------- convolution: cuDNN and im2col
from kiln.runtime.kernels.cuda import cudnn as kcudnn, nn as knn  # noqa: E402

# ResNet-50's shape classes in small, plus what else the cuDNN path must describe right.
CONV_CASES = [
    ("1x1", (2, 32, 9, 9), (16, 32, 1, 1), {}),
    ("3x3", (2, 32, 9, 9), (24, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("3x3_stride2", (2, 32, 10, 10), (24, 32, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("1x1_stride2", (2, 32, 10, 10), (24, 32, 1, 1), {"strides": [2, 2]}),
    ("7x7_stem", (2, 3, 32, 32), (16, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),
    ("asymmetric_pads", (1, 16, 8, 11), (8, 16, 3, 2), {"pads": [0, 1, 2, 0]}),
    ("same_upper_dilated", (1, 16, 12, 12), (8, 16, 3, 3), {"auto_pad": "SAME_UPPER", "dilations": [2, 2]}),
    ("grouped", (1, 32, 9, 9), (32, 8, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}),
    ("3x3_batch8", (8, 32, 9, 9), (24, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
]


@pytest.fixture
def conv_mode():
    """Set the Conv path for one test; the shape decisions are cleared before and after."""
    before = kcudnn.mode()
    knn.CONV_CHOICES.clear()
    yield kcudnn.set_mode
    kcudnn.set_mode(before)
    knn.CONV_CHOICES.clear()


def _conv_case(x_shape, w_shape, attrs, bias=True):
    x, w = _r(*x_shape), (_r(*w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    inputs = [x, w] + ([_r(w_shape[0])] if bias else [])
    g, feeds = build_single("Conv", inputs, attrs, const_inputs=(1, 2) if bias else (1,))
    g64, feeds64 = build_single("Conv", [a.astype(np.float64) for a in inputs], attrs,
                                const_inputs=(1, 2) if bias else (1,))
    return g, feeds, evaluate(g64, feeds64)[0]


def _rel(got, want):
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("name,x_shape,w_shape,attrs", CONV_CASES, ids=[c[0] for c in CONV_CASES])
@pytest.mark.parametrize("mode", ["cudnn", "im2col", "auto"])
def test_conv_paths_match_float64(name, x_shape, w_shape, attrs, mode, conv_mode):
    if mode != "im2col" and not kcudnn.available():
        pytest.skip(f"cuDNN path unavailable: {kcudnn.why_unavailable()}")
    conv_mode(mode)
    g, feeds, want = _conv_case(x_shape, w_shape, attrs, bias=name != "1x1")
    got = CudaProgram(g, output="numpy", cuda_graphs=False).run(feeds, as_list=True)[0]
    assert got.shape == want.shape
    # float32 accumulation lands near 1e-7; TF32 (tensor-core engines not deselected) near 3e-4.
    assert _rel(got, want) < 1e-5
    (entry,) = knn.CONV_CHOICES.values() if mode != "im2col" else ({"path": "im2col"},)
    if mode == "cudnn" and name != "grouped":  # every ungrouped case must really run on cuDNN
        assert entry["path"] == "cudnn", entry
    if mode == "auto":  # the batch rule: cuDNN from CUDNN_MIN_BATCH samples (where it builds), else im2col
        if x_shape[0] < knn.CUDNN_MIN_BATCH:
            assert entry["path"] == "im2col", entry
        elif "why" not in entry:
            assert entry["path"] == "cudnn", entry


def test_cudnn_conv_is_captured_in_a_cuda_graph(conv_mode):
    if not kcudnn.available():
        pytest.skip(f"cuDNN path unavailable: {kcudnn.why_unavailable()}")
    assert kcudnn.capture_ok(), f"cuDNN execute failed the capture probe: {kcudnn.capture_failure()}"
    conv_mode("cudnn")
    g = Graph("convnet")
    x = g.add_input("x", "float32", ["batch", 16, 12, 12])
    w1, b1 = g.add_initializer("w1", _r(32, 16, 3, 3) / 12), g.add_initializer("b1", _r(32))
    w2 = g.add_initializer("w2", _r(8, 32, 1, 1) / 6)
    h = g.op("Relu", g.op("Conv", x, w1, b1, pads=[1, 1, 1, 1], strides=[2, 2]))
    g.outputs = [g.op("Conv", h, w2)]
    infer_shapes(g)
    eager = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
    graphed = CudaProgram(g.copy(), output="numpy", cuda_graphs=True)
    for batch in (2, 2, 3):
        xs = _r(batch, 16, 12, 12)
        a = eager.run([xs], as_list=True)[0]
        b = graphed.run([xs], as_list=True)[0]
        _close(b, a, rtol=1e-6, atol=1e-7)
        _close(b, evaluate(g, [xs])[0], rtol=1e-4, atol=1e-5)
    assert graphed.graph_failures == {}
    assert graphed.captured_graphs() == 2
    assert {e["path"] for e in knn.CONV_CHOICES.values()} == {"cudnn"}


def test_conv_without_cudnn_keeps_im2col(monkeypatch, conv_mode):
    # What a machine without the frontend sees: no executor, the CuPy-only path, same numbers.
    monkeypatch.setattr(kcudnn, "available", lambda: False)
    conv_mode("auto")
    g, feeds, want = _conv_case((2, 8, 9, 9), (6, 8, 3, 3), {"pads": [1, 1, 1, 1]})
    got = CudaProgram(g, output="numpy", cuda_graphs=False).run(feeds, as_list=True)[0]
    assert _rel(got, want) < 1e-5
    assert knn.CONV_CHOICES == {}
