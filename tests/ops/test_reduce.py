"""Reduce*, ArgMax/ArgMin, TopK, CumSum and CumProd: references against numpy written another way
(transpose-and-flatten reductions), torch and hand-computed values; inference and failures."""
import numpy as np
import pytest
from op_harness import build_single, check_op, onnx_reference

from kiln.errors import ShapeInferenceError, VerifyError

torch = pytest.importorskip("torch")


def rand(rng, shape, dtype=np.float32):
    if np.issubdtype(dtype, np.integer):
        lo = 0 if np.issubdtype(dtype, np.unsignedinteger) else -4
        return rng.integers(lo, 5, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def out_types(op, inputs, attrs=None, **kw):
    g, _ = build_single(op, inputs, attrs, **kw)
    return [v.type for v in g.outputs]


# --------------------------------------------------------------------------- Reduce*

def _prod_by_columns(m):
    r = np.ones(m.shape[:-1])
    for j in range(m.shape[-1]):
        r = r * m[..., j]
    return r


# Each oracle reduces the last axis of a float64 matrix-like array, without np.sum/np.max.
ORACLES = {
    "ReduceSum": lambda m: m @ np.ones(m.shape[-1]),
    "ReduceMean": lambda m: (m @ np.ones(m.shape[-1])) / m.shape[-1],
    "ReduceMax": lambda m: np.sort(m, axis=-1)[..., -1],
    "ReduceMin": lambda m: np.sort(m, axis=-1)[..., 0],
    "ReduceProd": _prod_by_columns,
    "ReduceL2": lambda m: np.sqrt((m * m) @ np.ones(m.shape[-1])),
}


def flat_reduce(op, x, axes, keepdims):
    """Move the reduced axes last, flatten them into one, reduce that with the oracle."""
    axes = sorted(a % x.ndim for a in (range(x.ndim) if axes is None else axes))
    kept = [i for i in range(x.ndim) if i not in axes]
    moved = np.transpose(x.astype(np.float64), kept + axes).reshape([x.shape[i] for i in kept] + [-1])
    r = ORACLES[op](moved)
    if keepdims:
        r = r.reshape([1 if i in axes else x.shape[i] for i in range(x.ndim)])
    return r


def reduce_inputs(x, axes):
    return [x, None if axes is None else np.array(axes, np.int64)]


@pytest.mark.parametrize("op", sorted(ORACLES))
@pytest.mark.parametrize("axes", [None, [1], [-1, 0], [0, 1, 2]])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64])
def test_reduce_matches_flattened_numpy(rng, op, axes, keepdims, dtype):
    x = rand(rng, (2, 3, 4), dtype)
    if op == "ReduceProd" and dtype == np.float16:
        x = (x / 2 + 1).astype(dtype)  # keep the product of 24 values in float16 range
    expected = flat_reduce(op, x, axes, keepdims)
    if np.issubdtype(dtype, np.integer):
        expected = np.trunc(expected).astype(dtype)  # ONNX computes, then casts back (truncating)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
    check_op(op, reduce_inputs(x, axes), expected, dict(keepdims=keepdims), const_inputs=[1],
             symbolic_batch=True, **tol)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_reduce_max_min_small_ints(rng, op, dtype):
    x = rand(rng, (3, 5), dtype)
    check_op(op, reduce_inputs(x, [1]), flat_reduce(op, x, [1], 1).astype(dtype), const_inputs=[1])


@pytest.mark.parametrize("op,oracle", [("ReduceMax", np.any), ("ReduceMin", np.all)])
@pytest.mark.parametrize("axes", [None, [1], [-1, 0], [0, 1, 2], []])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_max_min_of_bool_match_onnx_reference(rng, op, oracle, axes, keepdims, noop):
    """ReduceMax/ReduceMin-20 take bool (False < True): max is any, min is all."""
    x = rng.random((2, 3, 4)) < 0.3
    x[1] = ~x[1] if op == "ReduceMin" else x[1]
    inputs = reduce_inputs(x, axes)
    attrs = dict(keepdims=keepdims, noop_with_empty_axes=noop)
    want = onnx_reference(op, inputs, attrs, opset=20)
    check_op(op, inputs, want, attrs, const_inputs=[1], symbolic_batch=True)
    if axes:
        np.testing.assert_array_equal(want, oracle(x, axis=tuple(axes), keepdims=bool(keepdims)))


@pytest.mark.parametrize("op,identity", [("ReduceMax", False), ("ReduceMin", True)])
def test_reduce_max_min_of_bool_over_no_elements(op, identity):
    x = np.zeros((2, 0, 3), bool)
    want = onnx_reference(op, [x, np.array([1], np.int64)], {}, opset=20)
    np.testing.assert_array_equal(want, np.full((2, 1, 3), identity))
    check_op(op, [x, np.array([1], np.int64)], want, const_inputs=[1])
    check_op(op, [x, None], np.full((1, 1, 1), identity), {})
    check_op(op, [x], np.full((1, 1, 1), identity), {})


def test_reduce_bool_is_max_min_only():
    with pytest.raises(VerifyError, match=r"\(ReduceSum\): input 0 \('data'\) is bool"):
        build_single("ReduceSum", [np.zeros((2, 3), bool)], {})
    with pytest.raises(VerifyError, match=r"\(ArgMax\): input 0 \('data'\) is bool"):
        build_single("ArgMax", [np.zeros((2, 3), bool)], {})


def test_reduce_keeps_symbolic_batch(rng):
    x = rand(rng, (2, 3, 4))
    [t] = out_types("ReduceMean", reduce_inputs(x, [-1]), const_inputs=[1], symbolic_batch=True)
    assert t.shape == ("batch", 3, 1)
    [t] = out_types("ReduceSum", reduce_inputs(x, [1]), dict(keepdims=0), const_inputs=[1], symbolic_batch=True)
    assert t.shape == ("batch", 4)


def test_reduce_empty_axes(rng):
    x = rand(rng, (2, 3))
    empty = np.zeros(0, np.int64)
    # noop_with_empty_axes=1: omitted or empty axes make the op the identity.
    check_op("ReduceSum", [x, None], x, dict(noop_with_empty_axes=1))
    check_op("ReduceMax", [x, empty], x, dict(noop_with_empty_axes=1), const_inputs=[1])
    # Otherwise they reduce every axis.
    check_op("ReduceSum", [x, empty], np.array([[x.astype(np.float64).sum()]]), const_inputs=[1], rtol=1e-5)
    check_op("ReduceMin", [x, None], np.array(x.min()), dict(keepdims=0))


def test_reduce_over_no_elements_gives_the_identity():
    x = np.zeros((2, 0), np.float32)
    axes = np.array([1], np.int64)
    check_op("ReduceSum", [x, axes], np.zeros((2, 1)), const_inputs=[1])
    check_op("ReduceProd", [x, axes], np.ones((2, 1)), const_inputs=[1])
    check_op("ReduceMax", [x, axes], np.full((2, 1), -np.inf), const_inputs=[1])
    check_op("ReduceMin", [x.astype(np.int32), axes], np.full((2, 1), np.iinfo(np.int32).max, np.int32),
             const_inputs=[1])


def test_reduce_with_runtime_axes(rng):
    x = rand(rng, (2, 3, 4))
    axes = np.array([0, 2], np.int64)
    # The axes are a graph input here, not a constant: the rank may be known, the dims are not.
    [t] = out_types("ReduceSum", [x, axes])
    assert t.shape == (None, None, None)
    [t] = out_types("ReduceSum", [x, axes], dict(keepdims=0))
    assert t.shape == (None,)
    check_op("ReduceSum", [x, axes], flat_reduce("ReduceSum", x, [0, 2], 0), dict(keepdims=0), rtol=1e-5)


@pytest.mark.parametrize("axes,match", [([3], "axis 3 is out of range for rank 3"),
                                        ([1, -2], "name the same axis twice"),
                                        ([[0, 1]], "axes must be a 1-D tensor")])
def test_reduce_bad_axes_fail(axes, match):
    inputs = [np.zeros((2, 3, 4), np.float32), np.array(axes, np.int64)]
    with pytest.raises(ShapeInferenceError, match=rf"'reducesum' \(ReduceSum\).*{match}"):
        build_single("ReduceSum", inputs, const_inputs=[1])


# --------------------------------------------------------------------------- ArgMax, ArgMin

@pytest.mark.parametrize("op,oracle", [("ArgMax", torch.argmax), ("ArgMin", torch.argmin)])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_arg_matches_torch(rng, op, oracle, axis, keepdims, dtype):
    # Distinct values: torch does not promise which of several equal extremes it picks.
    x = rng.permutation(60).reshape(3, 4, 5).astype(dtype)
    expected = oracle(torch.from_numpy(x.astype(np.float64)), dim=axis, keepdim=bool(keepdims)).numpy()
    check_op(op, [x], expected, dict(axis=axis, keepdims=keepdims), symbolic_batch=axis != 0)


@pytest.mark.parametrize("op,last,expected", [("ArgMax", 0, [1, 0]), ("ArgMax", 1, [3, 2]),
                                              ("ArgMin", 0, [0, 1]), ("ArgMin", 1, [2, 1])])
def test_arg_ties_and_select_last_index(op, last, expected):
    x = np.array([[1, 5, 1, 5], [7, 2, 7, 3]], np.int32)
    check_op(op, [x], np.array(expected, np.int64), dict(axis=1, keepdims=0, select_last_index=last))


def test_arg_bad_axis_fails():
    with pytest.raises(ShapeInferenceError, match=r"\(ArgMax\).*axis 2 is out of range for rank 2"):
        build_single("ArgMax", [np.zeros((2, 3), np.float32)], dict(axis=2))


# --------------------------------------------------------------------------- TopK

@pytest.mark.parametrize("axis", [-1, 1, 0])
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_topk_matches_torch(rng, axis, largest, k, dtype):
    x = rng.permutation(120).reshape(4, 5, 6).astype(dtype)
    values, indices = torch.topk(torch.from_numpy(x), k, dim=axis, largest=bool(largest), sorted=True)
    check_op("TopK", [x, np.array([k], np.int64)], [values.numpy(), indices.numpy()],
             dict(axis=axis, largest=largest), const_inputs=[1], symbolic_batch=axis != 0)


@pytest.mark.parametrize("largest,values,indices", [(1, [3, 3, 2], [0, 2, 3]), (0, [1, 1, 2], [1, 4, 3])])
def test_topk_ties_keep_lower_index_first(largest, values, indices):
    x = np.array([3, 1, 3, 2, 1], np.float32)
    check_op("TopK", [x, np.array([3], np.int64)], [np.array(values, np.float32), np.array(indices, np.int64)],
             dict(largest=largest), const_inputs=[1])


def test_topk_inference(rng):
    x = rand(rng, (2, 7))
    types = out_types("TopK", [x, np.array([3], np.int64)], const_inputs=[1], symbolic_batch=True)
    assert [(t.dtype.short, t.shape) for t in types] == [("float32", ("batch", 3)), ("int64", ("batch", 3))]
    # K fed at run time: its value, hence the dim, is unknown.
    types = out_types("TopK", [x, np.array([3], np.int64)])
    assert [t.shape for t in types] == [(2, None), (2, None)]


@pytest.mark.parametrize("k,attrs,match", [([8], {}, "K=8 is out of range for an axis of size 7"),
                                           ([-1], {}, "K=-1 is out of range"),
                                           ([1, 2], {}, "K must be a 1-D tensor of one element"),
                                           ([2], dict(axis=2), "axis 2 is out of range")])
def test_topk_bad_inputs_fail(k, attrs, match):
    inputs = [np.zeros((2, 7), np.float32), np.array(k, np.int64)]
    with pytest.raises(ShapeInferenceError, match=rf"\(TopK\).*{match}"):
        build_single("TopK", inputs, attrs, const_inputs=[1])


# --------------------------------------------------------------------------- CumSum

def torch_cumsum(x, axis, exclusive, reverse):
    t = torch.from_numpy(x.astype(np.float64))
    if reverse:
        t = torch.flip(t, [axis])
    y = torch.cumsum(t, dim=axis)
    if exclusive:
        y = y - t
    if reverse:
        y = torch.flip(y, [axis])
    return y.numpy()


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64])
def test_cumsum_matches_torch(rng, axis, exclusive, reverse, dtype):
    x = rand(rng, (3, 4, 5), dtype)
    expected = torch_cumsum(x, axis, exclusive, reverse).astype(dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-5)
    check_op("CumSum", [x, np.array(axis, np.int32)], expected, dict(exclusive=exclusive, reverse=reverse),
             const_inputs=[1], symbolic_batch=True, **tol)


@pytest.mark.parametrize("exclusive,reverse,expected", [(0, 0, [1, 3, 6, 10]), (1, 0, [0, 1, 3, 6]),
                                                        (0, 1, [10, 9, 7, 4]), (1, 1, [9, 7, 4, 0])])
def test_cumsum_hand_computed(exclusive, reverse, expected):
    x = np.array([1, 2, 3, 4], np.int64)
    check_op("CumSum", [x, np.array([0], np.int64)], np.array(expected, np.int64),
             dict(exclusive=exclusive, reverse=reverse), const_inputs=[1])


@pytest.mark.parametrize("axis,match", [(np.array(3), "axis 3 is out of range for rank 2"),
                                        (np.array([0, 1]), "axis must be a scalar or a 1-element tensor")])
def test_cumsum_bad_axis_fails(axis, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(CumSum\).*{match}"):
        build_single("CumSum", [np.zeros((2, 3), np.float32), axis.astype(np.int64)], const_inputs=[1])


# --------------------------------------------------------------------------- CumProd


def torch_cumprod(x, axis, exclusive, reverse):
    """torch.cumprod in float64; exclusive: the inclusive product shifted one step, 1 in front."""
    t = torch.from_numpy(x.astype(np.float64))
    if reverse:
        t = torch.flip(t, [axis])
    y = torch.cumprod(t, dim=axis)
    if exclusive:
        y = torch.cat([torch.ones_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, y.shape[axis] - 1)], dim=axis)
    if reverse:
        y = torch.flip(y, [axis])
    return y.numpy()


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64])
def test_cumprod_matches_torch(rng, axis, exclusive, reverse, dtype):
    x = rand(rng, (3, 4, 5), dtype)
    if np.dtype(dtype).kind == "f":
        x = (np.sign(x) * (0.5 + np.abs(x))).astype(dtype)  # products neither vanish nor explode
    expected = torch_cumprod(x, axis, exclusive, reverse).astype(dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
    check_op("CumProd", [x, np.array(axis, np.int32)], expected, dict(exclusive=exclusive, reverse=reverse),
             const_inputs=[1], symbolic_batch=True, **tol)


@pytest.mark.parametrize("exclusive,reverse,expected", [(0, 0, [1, 2, 6, 24]), (1, 0, [1, 1, 2, 6]),
                                                        (0, 1, [24, 24, 12, 4]), (1, 1, [24, 12, 4, 1])])
def test_cumprod_hand_computed(exclusive, reverse, expected):
    x = np.array([1, 2, 3, 4], np.int64)
    check_op("CumProd", [x, np.array([0], np.int64)], np.array(expected, np.int64),
             dict(exclusive=exclusive, reverse=reverse), const_inputs=[1])
    check_op("CumProd", [x, np.array(-1, np.int64)], np.array(expected, np.int64),
             dict(exclusive=exclusive, reverse=reverse))  # the axis a run-time value


def test_cumprod_integers_wrap_as_int32_arithmetic():
    x = np.array([65536, 65536, 3, 0, 5], np.int32)
    check_op("CumProd", [x, np.array(0, np.int64)], np.array([65536, 0, 0, 0, 0], np.int32))


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_cumprod_matches_onnx_reference(rng, exclusive, reverse, dtype):
    x = rand(rng, (3, 4), dtype)
    for axis in (0, -1):
        attrs = dict(exclusive=exclusive, reverse=reverse)
        want = onnx_reference("CumProd", [x, np.array(axis % 2, np.int64)], attrs, 26)
        check_op("CumProd", [x, np.array(axis, np.int64)], want, attrs, const_inputs=[1])


@pytest.mark.parametrize("axis,match", [(np.array(3), "axis 3 is out of range for rank 2"),
                                        (np.array([0, 1]), "axis must be a scalar or a 1-element tensor")])
def test_cumprod_bad_axis_fails(axis, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(CumProd\).*{match}"):
        build_single("CumProd", [np.zeros((2, 3), np.float32), axis.astype(np.int64)], const_inputs=[1])
