"""MaxPool, AveragePool, GlobalAveragePool and GlobalMaxPool: references against torch
(float64) or explicit loops, inference with symbolic dims, and inference failures."""
import itertools

import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph
from kiln.ir.passes.shape_inference import infer_shapes

torch = pytest.importorskip("torch")
F = torch.nn.functional

MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
TOL = {np.float16: dict(rtol=1e-2, atol=1e-2), np.float32: dict(rtol=1e-5, atol=1e-6),
       np.float64: dict(rtol=1e-12, atol=1e-12)}


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def t64(a):
    return torch.from_numpy(np.asarray(a, np.float64))


def infer_type(op, x_shape, attrs=None, num_outputs=None):
    g = Graph("t")
    x = g.add_input("x", "float32", x_shape)
    node = g.add_node(op, [x], attrs or {}, num_outputs=num_outputs)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    return g.outputs[0].type


def loop_pool_2d(x, out_hw, k, s, begin, end, reduce, count_include_pad=False):
    """Pooling written as loops over output positions; pads ``begin``/``end`` count only
    for AveragePool's divisor with count_include_pad; anything past them never counts."""
    n, c, h, w = x.shape
    y = np.zeros((n, c) + tuple(out_hw), np.float64)
    for i, j in itertools.product(range(out_hw[0]), range(out_hw[1])):
        r0, c0 = i * s[0] - begin[0], j * s[1] - begin[1]
        rows = [r for r in range(r0, r0 + k[0]) if 0 <= r < h]
        cols = [q for q in range(c0, c0 + k[1]) if 0 <= q < w]
        win = x[:, :, rows][:, :, :, cols].astype(np.float64)
        if reduce == "max":
            y[:, :, i, j] = win.max(axis=(2, 3))
            continue
        if count_include_pad:
            n_rows = len([r for r in range(r0, r0 + k[0]) if -begin[0] <= r < h + end[0]])
            n_cols = len([q for q in range(c0, c0 + k[1]) if -begin[1] <= q < w + end[1]])
            y[:, :, i, j] = win.sum(axis=(2, 3)) / (n_rows * n_cols)
        else:
            y[:, :, i, j] = win.mean(axis=(2, 3))
    return y


# --------------------------------------------------------------------------- MaxPool

MAX_CASES = [
    # (spatial, kernel, strides, pads, dilations, ceil_mode)
    ((8, 9), (2, 2), (2, 2), (0, 0), (1, 1), 0),
    ((8, 9), (3, 3), (2, 2), (1, 1), (1, 1), 0),
    ((8, 9), (3, 3), (2, 2), (1, 1), (1, 1), 1),
    ((9, 10), (3, 2), (2, 3), (1, 0), (2, 1), 1),
    ((7, 7), (3, 3), (1, 1), (0, 0), (2, 2), 0),
    ((10, 6), (2, 2), (3, 3), (0, 0), (1, 1), 1),
    ((11,), (3,), (2,), (1,), (1,), 1),
    ((5, 6, 7), (2, 3, 2), (2, 2, 2), (1, 1, 0), (1, 1, 1), 1),
]


@pytest.mark.parametrize("spatial,k,s,p,d,ceil", MAX_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_max_pool_matches_torch(rng, spatial, k, s, p, d, ceil, dtype):
    x = rand(rng, (2, 3) + spatial, dtype)
    expected = MAX[len(k)](t64(x), k, s, p, d, ceil_mode=bool(ceil)).numpy()
    attrs = dict(kernel_shape=k, strides=s, pads=p + p, dilations=d, ceil_mode=ceil)
    check_op("MaxPool", [x], expected, attrs, symbolic_batch=True, rtol=0, atol=0)


def test_max_pool_asymmetric_pads(rng):
    x = rand(rng, (1, 2, 7, 6))
    padded = F.pad(t64(x), (2, 0, 0, 1), value=-np.inf)
    expected = F.max_pool2d(padded, (3, 3), (2, 2)).numpy()
    check_op("MaxPool", [x], expected, dict(kernel_shape=(3, 3), strides=(2, 2), pads=(0, 2, 1, 0)))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_max_pool_ints_pads_never_win(rng, dtype):
    x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, (2, 3, 6, 5), endpoint=True).astype(dtype)
    x[0, 0] = np.iinfo(dtype).min  # a plane of minimum values: a padded zero must not win
    expected = loop_pool_2d(x, (3, 3), (3, 3), (2, 2), (1, 1), (1, 1), "max").astype(dtype)
    check_op("MaxPool", [x], expected, dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)))


@pytest.mark.parametrize("auto_pad,begin,end", [("SAME_UPPER", (0, 1), (1, 2)), ("SAME_LOWER", (1, 2), (0, 1))])
def test_max_pool_auto_pad(rng, auto_pad, begin, end):
    # X 7x8, kernel 2x5, stride 2: 4x4 outputs; rows need 3*2+2 = 8 (pad 1), cols 3*2+5 = 11 (pad 3).
    x = rand(rng, (1, 2, 7, 8))
    expected = loop_pool_2d(x, (4, 4), (2, 5), (2, 2), begin, end, "max")
    check_op("MaxPool", [x], expected, dict(kernel_shape=(2, 5), strides=(2, 2), auto_pad=auto_pad))


# --------------------------------------------------------------------------- MaxPool's Indices output


def loop_argmax(x, k, s, d, begin, out, storage_order):
    """Indices as ONNX's reference computes them (onnx/reference/ops/op_max_pool.py), written as loops: per window
    the first input position (row-major window order, padding skipped) holding a value strictly greater than
    every earlier one; its flat index over [N, C, *spatial], the spatial part column major for storage_order 1."""
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    idx = np.full((n, c) + tuple(out), -1, np.int64)
    for plane, o in itertools.product(range(n * c), itertools.product(*map(range, out))):
        best, where = None, None
        for t in itertools.product(*map(range, k)):
            at = tuple(oi * si - bi + ti * di for oi, si, bi, ti, di in zip(o, s, begin, t, d))
            if all(0 <= a < size for a, size in zip(at, sizes)):
                v = x.reshape((n * c,) + sizes)[(plane,) + at]
                if best is None or v > best:
                    best, where = v, at
        if where is None:
            continue
        dims = list(zip(where, sizes))
        flat = 0
        for a, size in (dims if storage_order == 0 else dims[::-1]):
            flat = flat * size + a
        idx[(plane // c, plane % c) + o] = plane * int(np.prod(sizes)) + flat
    return idx


def onnx_max_pool(x, attrs, opset=22):
    """Y and Indices from ONNX's reference evaluator (a two-output MaxPool model)."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    node = helper.make_node("MaxPool", ["x"], ["y", "z"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)], [
        helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None),
        helper.make_tensor_value_info("z", onnx.TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {"x": x})


def test_max_pool_indices_onnx_examples():
    """The node tests test_maxpool_with_argmax_2d_precomputed_pads / _strides (storage_order 1)."""
    x = np.arange(1, 26, dtype=np.float32).reshape(1, 1, 5, 5)
    y, z = check_op("MaxPool", [x], None, dict(kernel_shape=(5, 5), pads=(2, 2, 2, 2)), num_outputs=2)
    np.testing.assert_array_equal(z[0, 0, :, 0], [12, 17, 22, 22, 22])
    np.testing.assert_array_equal(z[0, 0, 0], [12, 13, 14, 14, 14])
    check_op("MaxPool", [x], [np.array([[[[7, 9], [17, 19]]]], np.float32), np.array([[[[6, 16], [8, 18]]]])],
             dict(kernel_shape=(2, 2), strides=(2, 2), storage_order=1), num_outputs=2)


@pytest.mark.parametrize("spatial,k,s,p,d,ceil", MAX_CASES)
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices_match_loops(rng, spatial, k, s, p, d, ceil, storage_order):
    """Small integers make ties: the first maximum in window order wins, never a padded position."""
    x = rng.integers(-2, 2, (2, 3) + spatial).astype(np.float32)
    attrs = dict(kernel_shape=k, strides=s, pads=p + p, dilations=d, ceil_mode=ceil, storage_order=storage_order)
    y, z = check_op("MaxPool", [x], None, attrs, num_outputs=2, symbolic_batch=True)
    assert z.dtype == np.int64 and z.shape == y.shape
    want = loop_argmax(x, k, s, d, p, y.shape[2:], storage_order)
    np.testing.assert_array_equal(z, want)
    np.testing.assert_array_equal(x.reshape(-1)[z] if storage_order == 0 or len(k) == 1 else y, y)


@pytest.mark.parametrize("spatial,k,s,p,d,ceil", [c for c in MAX_CASES if c[2] != (1,) * len(c[1]) or
                                                  c[4] != (1,) * len(c[1])])
@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.uint8, np.float16])
def test_max_pool_indices_match_onnx_reference(rng, spatial, k, s, p, d, ceil, storage_order, dtype):
    """ONNX's reference computes Indices in its general path (strides or dilations not all 1; its all-1 path leaves
    out the [N, C] offset and storage_order, against the spec: test_max_pool_indices_match_loops covers those)."""
    x = rng.integers(0, 4, (2, 3) + spatial).astype(dtype)
    attrs = dict(kernel_shape=list(k), strides=list(s), pads=list(p + p), dilations=list(d), ceil_mode=ceil,
                 storage_order=storage_order)
    want = onnx_max_pool(x, attrs)
    check_op("MaxPool", [x], want, attrs, num_outputs=2)


@pytest.mark.parametrize("spatial,k,s,p", [((8, 9), (3, 3), (2, 2), (1, 1)), ((11,), (3,), (2,), (1,)),
                                           ((5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 1, 0))])
def test_max_pool_indices_match_torch(rng, spatial, k, s, p):
    """torch's indices are per (n, c) plane, row major: ONNX's are the same plus the plane's offset."""
    x = rand(rng, (2, 3) + spatial, np.float64)
    values, idx = MAX[len(k)](t64(x), k, s, p, return_indices=True)
    plane = np.arange(6).reshape(2, 3, *([1] * len(k))) * int(np.prod(spatial))
    check_op("MaxPool", [x], [values.numpy(), idx.numpy() + plane], dict(kernel_shape=k, strides=s, pads=p + p),
             num_outputs=2)


def test_max_pool_indices_edge_values():
    """-inf (and the lowest int8) at an input position beats the padding it ties with; a NaN maximum points
    at its window's first NaN; an empty batch gives empty Indices."""
    x = np.full((1, 1, 3, 3), -np.inf, np.float32)
    y, z = check_op("MaxPool", [x], None, dict(kernel_shape=(2, 2), pads=(1, 1, 0, 0)), num_outputs=2)
    np.testing.assert_array_equal(z[0, 0], [[0, 0, 1], [0, 0, 1], [3, 3, 4]])  # each window's first input position
    xi = np.full((1, 1, 2, 3), -128, np.int8)
    _, zi = check_op("MaxPool", [xi], None, dict(kernel_shape=(2, 2), pads=(1, 1, 1, 1), strides=(2, 2)),
                     num_outputs=2)
    np.testing.assert_array_equal(zi[0, 0], [[0, 1], [3, 4]])
    xn = np.array([[[1, np.nan, 3, np.nan, 0]]], np.float32)
    yn, zn = check_op("MaxPool", [xn], None, dict(kernel_shape=(3,)), num_outputs=2)
    np.testing.assert_array_equal(zn[0, 0], [1, 1, 3])
    empty = np.zeros((0, 2, 4, 4), np.float32)
    ye, ze = check_op("MaxPool", [empty], None, dict(kernel_shape=(2, 2)), num_outputs=2)
    assert ye.shape == ze.shape == (0, 2, 3, 3) and ze.dtype == np.int64


def test_max_pool_indices_inference():
    g, _ = build_single("MaxPool", [np.zeros((1, 2, 8, 9), np.float32)], dict(kernel_shape=(3, 3), strides=(2, 2)),
                        num_outputs=2, symbolic_batch=True)
    assert [str(v.type) for v in g.outputs] == ["float32[batch,2,3,4]", "int64[batch,2,3,4]"]
    with pytest.raises(ShapeInferenceError, match=r"\(MaxPool\).*storage_order must be 0 \(row major\) or 1"):
        build_single("MaxPool", [np.zeros((1, 1, 4, 4), np.float32)], dict(kernel_shape=(2, 2), storage_order=2),
                     num_outputs=2)


def test_pool_symbolic_dims():
    attrs = dict(kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), ceil_mode=1)
    assert infer_type("MaxPool", ("batch", 3, 8, 9), attrs).shape == ("batch", 3, 5, 5)
    assert infer_type("AveragePool", ("batch", 3, "h", 9), attrs).shape == ("batch", 3, None, 5)
    assert infer_type("MaxPool", ("batch", 3, "h", 9), dict(kernel_shape=(1, 1))).shape == ("batch", 3, "h", 9)
    assert infer_type("GlobalMaxPool", ("batch", 3, "h", "w")).shape == ("batch", 3, 1, 1)


@pytest.mark.parametrize("op,x_shape,attrs,match", [
    ("MaxPool", (1, 2, 8, 8), dict(kernel_shape=(3,)), "must have rank 3"),
    ("MaxPool", (1, 2, 2, 8), dict(kernel_shape=(3, 3)), "smaller than the window extent 3"),
    ("MaxPool", (1, 2, 8, 8), dict(kernel_shape=(3, 3), dilations=(1,)), "dilations has 1 values"),
    ("AveragePool", (1, 2, 8, 8), dict(kernel_shape=(3, 3), pads=(1, 1, -1, 1)), "pads must be >= 0"),
    ("AveragePool", (1, 2, 8, 8), dict(kernel_shape=(0, 3)), "kernel_shape must be >= 1"),
    ("GlobalAveragePool", (1, 2), {}, "rank >= 3"),
])
def test_pool_bad_inputs_fail(op, x_shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*{match}"):
        build_single(op, [np.zeros(x_shape, np.float32)], attrs)


# --------------------------------------------------------------------------- AveragePool

AVG_CASES = [
    # (spatial, kernel, strides, pads, ceil_mode)
    ((8, 9), (2, 2), (2, 2), (0, 0), 0),
    ((8, 9), (3, 3), (2, 2), (1, 1), 0),
    ((8, 9), (3, 3), (2, 2), (1, 1), 1),
    ((9, 10), (3, 2), (2, 3), (1, 1), 1),
    ((10, 6), (2, 2), (3, 3), (0, 0), 1),
    ((11,), (4,), (3,), (2,), 1),
    ((5, 6, 7), (2, 3, 2), (2, 2, 2), (1, 1, 0), 1),
]


@pytest.mark.parametrize("spatial,k,s,p,ceil", AVG_CASES)
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_average_pool_matches_torch(rng, spatial, k, s, p, ceil, include_pad, dtype):
    x = rand(rng, (2, 3) + spatial, dtype)
    expected = AVG[len(k)](t64(x), k, s, p, ceil_mode=bool(ceil), count_include_pad=bool(include_pad)).numpy()
    attrs = dict(kernel_shape=k, strides=s, pads=p + p, ceil_mode=ceil, count_include_pad=include_pad)
    check_op("AveragePool", [x], expected, attrs, symbolic_batch=True, **TOL[dtype])


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("ceil", [0, 1])
def test_average_pool_asymmetric_pads(rng, include_pad, ceil):
    x = rand(rng, (1, 2, 7, 6), np.float64)
    attrs = dict(kernel_shape=(3, 3), strides=(2, 2), pads=(0, 2, 1, 0), ceil_mode=ceil, count_include_pad=include_pad)
    # Rows: 7 + 0 + 1 - 3 = 5 -> 3 windows (ceil 4, starts at 6 < 7); cols: 6 + 2 - 3 = 5 -> 3 (ceil 4).
    out_hw = (4, 4) if ceil else (3, 3)
    expected = loop_pool_2d(x, out_hw, (3, 3), (2, 2), (0, 2), (1, 0), "avg", include_pad)
    check_op("AveragePool", [x], expected, attrs, **TOL[np.float64])


# --------------------------------------------------------------------------- global pools

@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_global_pools_match_torch(rng, shape, dtype):
    x = rand(rng, shape, dtype)
    axes = tuple(range(2, len(shape)))
    check_op("GlobalAveragePool", [x], t64(x).mean(dim=axes, keepdim=True).numpy(), symbolic_batch=True, **TOL[dtype])
    check_op("GlobalMaxPool", [x], t64(x).amax(dim=axes, keepdim=True).numpy(), symbolic_batch=True, rtol=0, atol=0)


@pytest.mark.parametrize("spatial,k,d,p,ceil,include_pad", [
    (2, (3, 3), (2, 2), (2, 2, 2, 2), 0, 0), (2, (2, 3), (2, 1), (1, 0, 1, 0), 1, 1), (1, (3,), (3,), (0, 0), 0, 0),
    (3, (2, 2, 2), (2, 2, 2), (1, 1, 1, 1, 1, 1), 1, 0)])
def test_average_pool_dilations_match_onnx_reference(rng, spatial, k, d, p, ceil, include_pad):
    """AveragePool-19's dilations: the CPU and mobile kernels take the reference's path for them."""
    ref = pytest.importorskip("onnx.reference.ops.op_average_pool")
    x = rng.standard_normal((1, 2) + (9,) * spatial).astype(np.float32)
    attrs = {"kernel_shape": list(k), "dilations": list(d), "pads": list(p), "ceil_mode": ceil,
             "count_include_pad": include_pad}
    want = ref.AveragePool_19._run(ref.AveragePool_19.__new__(ref.AveragePool_19), x, auto_pad="NOTSET",
                                   ceil_mode=ceil, count_include_pad=include_pad, dilations=list(d),
                                   kernel_shape=list(k), pads=list(p), strides=None)[0]
    check_op("AveragePool", [x], want, attrs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_is_the_p_norm_of_each_window(rng, p):
    x = rng.standard_normal((1, 2, 6, 7)).astype(np.float32)
    attrs = {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [1, 0, 0, 1], "p": p}
    xp = np.pad(np.abs(x.astype(np.float64)), [(0, 0), (0, 0), (1, 0), (0, 1)])
    oh, ow = (xp.shape[2] - 2) // 2 + 1, xp.shape[3] - 3 + 1
    want = np.array([[[[(xp[n, c, 2 * i:2 * i + 2, j:j + 3] ** p).sum() ** (1 / p) for j in range(ow)]
                       for i in range(oh)] for c in range(2)] for n in range(1)])
    check_op("LpPool", [x], want.astype(np.float32), attrs, rtol=1e-5, atol=1e-6)
    check_op("LpPool", [x], None, {"kernel_shape": [2, 2], "dilations": [2, 2], "p": p})
