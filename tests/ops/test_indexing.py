"""Slice, Gather, GatherElements, ScatterND and Trilu against Python slicing, numpy fancy
indexing, torch and hand-computed values."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from op_harness import build_single, check_op, i64, inferred

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.evaluator import EvaluationError
from kiln.ir.passes import infer_shapes

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min




def arange(shape, dtype=np.float32) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return np.arange(n).reshape(shape).astype(dtype)






# --------------------------------------------------------------------------- Slice


def python_slice(x, starts, ends, axes=None, steps=None) -> np.ndarray:
    """Python's slice clamping is ONNX's when given the raw (unnormalized) values, but for one
    case: stepping backwards from a start before the axis, ONNX (and onnxruntime) clamp the
    start to 0 and so take element 0, where Python takes nothing."""
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        s, e, st = int(s), int(e), int(st)
        if st < 0 and s + x.shape[a] < 0:
            s = 0
        index[a] = slice(s, e, st)
    return x[tuple(index)]


SLICES = [
    ((1,), (3,), None, None),
    ((0, 1), (2, 3), None, None),
    ((-3,), (-1,), (1,), None),
    ((1,), (INT64_MAX,), (-1,), (2,)),
    ((-1,), (INT64_MIN,), (1,), (-1,)),
    ((3,), (0,), (2,), (-2,)),
    ((10,), (-10,), (0,), (-1,)),
    ((-100,), (100,), (2,), (3,)),
    ((2, 0), (0, 4), (0, 2), (1, 1)),
    ((0, 4), (2, -9), (1, 2), (1, -1)),
]


@pytest.mark.parametrize("starts, ends, axes, steps", SLICES)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_slice(starts, ends, axes, steps, dtype):
    x = arange((3, 4, 5), dtype)
    inputs = [x, i64(*starts), i64(*ends), None if axes is None else i64(*axes),
              None if steps is None else i64(*steps)]
    while inputs[-1] is None:
        inputs.pop()
    expected = python_slice(x, starts, ends, axes, steps)
    check_op("Slice", inputs, expected, const_inputs=[1, 2, 3, 4])


BOUNDS = st.one_of(st.integers(-9, 9), st.sampled_from([INT64_MAX, INT64_MIN]))


@given(n=st.integers(0, 6), start=BOUNDS, end=BOUNDS, step=st.integers(-3, 3).filter(bool))
def test_slice_property_matches_python_slicing(n, start, end, step):
    x = np.arange(n, dtype=np.int32)
    out = check_op("Slice", [x, i64(start), i64(end), i64(0), i64(step)], python_slice(x, [start], [end], None,
                   [step]), const_inputs=[1, 2, 3, 4])[0]
    # check_op also proved that the statically inferred length equals the reference's.
    assert out.dtype == np.int32


def test_slice_hand_values_and_int32_params():
    x = np.arange(6, dtype=np.float16)
    i32 = np.int32
    check_op("Slice", [x, np.array([-1], i32), np.array([-7], i32), np.array([0], i32), np.array([-2], i32)],
             np.array([5, 3, 1], np.float16), const_inputs=[1, 2, 3, 4])
    check_op("Slice", [x, i64(4), i64(1), i64(0), i64(-1)], np.array([4, 3, 2], np.float16), const_inputs=[1, 2, 3, 4])
    check_op("Slice", [x, i64(-20), i64(-30), i64(0), i64(-1)], np.array([0], np.float16), const_inputs=[1, 2, 3, 4])


def test_slice_positive_steps_match_torch(torch):
    x = arange((4, 6, 5), np.float64)
    expected = torch.from_numpy(x)[1:4:2, :, -3:].numpy()
    check_op("Slice", [x, i64(1, -3), i64(4, INT64_MAX), i64(0, 2), i64(2, 1)], expected, const_inputs=[1, 2, 3, 4])


def test_slice_inference():
    x = arange((4, 6, 5))
    big = INT64_MAX
    assert inferred("Slice", [x, i64(1), i64(3), i64(1)], const_inputs=[1, 2, 3]) == [("batch", 2, 5)]
    assert inferred("Slice", [x, i64(0), i64(big), i64(0)], const_inputs=[1, 2, 3]) == [("batch", 6, 5)]
    assert inferred("Slice", [x, i64(-1), i64(-big), i64(0), i64(-1)], const_inputs=[1, 2, 3, 4]) == \
        [("batch", 6, 5)]
    assert inferred("Slice", [x, i64(1), i64(big), i64(0)], const_inputs=[1, 2, 3]) == [(None, 6, 5)]
    assert inferred("Slice", [x, i64(1), i64(3), i64(2)], const_inputs=[3]) == [("batch", 6, None)]
    assert inferred("Slice", [x, i64(1), i64(3)]) == [(None, None, None)]
    with pytest.raises(ShapeInferenceError, match=r"node 'slice' \(Slice\).*must not be 0"):
        build_single("Slice", [x, i64(1), i64(3), i64(0), i64(0)], const_inputs=[1, 2, 3, 4])
    with pytest.raises(ShapeInferenceError, match="differ in length"):
        build_single("Slice", [x, i64(1, 2), i64(3), i64(0)], const_inputs=[1, 2, 3])
    with pytest.raises(ShapeInferenceError, match="name an axis twice"):
        build_single("Slice", [x, i64(1, 2), i64(3, 4), i64(1, -2)], const_inputs=[1, 2, 3])


# --------------------------------------------------------------------------- Gather / GatherElements


def fancy_gather(x, idx, axis) -> np.ndarray:
    """Numpy fancy indexing with one index array: negative indices wrap as in ONNX."""
    return x[(slice(None),) * axis + (idx,)]


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("idx", [i64(0), i64(2, 0, -1), np.array([[1, -2], [0, 0]], np.int32)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_gather(axis, idx, dtype):
    x = arange((3, 4, 3), dtype)
    check_op("Gather", [x, idx], fancy_gather(x, idx, axis % 3), {"axis": axis}, const_inputs=[1])


def test_gather_inference_and_errors():
    x = arange((3, 4, 5))
    assert inferred("Gather", [x, i64(1, 2)], {"axis": 1}, const_inputs=[1]) == [("batch", 2, 5)]
    assert inferred("Gather", [x, np.array(1, np.int64)], {"axis": 2}, const_inputs=[1]) == [("batch", 4)]
    with pytest.raises(ShapeInferenceError, match=r"node 'gather' \(Gather\).*out of range for axis 1"):
        build_single("Gather", [x, i64(4)], {"axis": 1}, const_inputs=[1])
    g, feeds = build_single("Gather", [x, i64(7)], {"axis": 1})
    with pytest.raises(EvaluationError, match="node 'gather'.*out of range"):
        evaluate(g, feeds)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_gather_elements(torch, axis, dtype, rng):
    x = (arange((3, 4), np.int64) % 5).astype(dtype)
    dim = x.shape[axis]
    idx = rng.integers(-dim, dim, size=(2, 4) if axis == 0 else (3, 2))
    expected = torch.gather(torch.from_numpy(x), axis, torch.from_numpy(idx % dim)).numpy()
    check_op("GatherElements", [x, idx], expected, {"axis": axis}, symbolic_batch=axis != 0)


def test_gather_elements_rank_mismatch():
    with pytest.raises(ShapeInferenceError, match="same rank"):
        build_single("GatherElements", [arange((3, 4)), i64(1, 2)])


# --------------------------------------------------------------------------- ScatterND


def test_scatter_nd_matches_torch_index_put(torch):
    data = arange((4, 3, 2))
    idx = i64(3, 0, 1, 1).reshape(2, 2)
    upd = -arange((2, 2)) - 1
    t = torch.from_numpy(data.copy())
    t[torch.from_numpy(idx[:, 0]), torch.from_numpy(idx[:, 1])] = torch.from_numpy(upd)
    check_op("ScatterND", [data, idx, upd], t.numpy())
    added = torch.from_numpy(data.copy()).index_put_(
        (torch.from_numpy(i64(1, 1, 0)),), torch.from_numpy(np.ones((3, 3, 2), np.float32)), accumulate=True)
    check_op("ScatterND", [data, i64(1, 1, 0).reshape(3, 1), np.ones((3, 3, 2), np.float32)], added.numpy(),
             {"reduction": "add"})


@pytest.mark.parametrize("reduction, want", [("mul", [1, 6, 3, 40]), ("max", [1, 3, 3, 5]), ("min", [1, 1, 3, 2]),
                                             ("none", [1, 3, 3, 5])])
def test_scatter_nd_reductions(reduction, want):
    data = np.array([1, 2, 3, 4], np.int64)
    idx = i64(1, 3, 1, 3).reshape(4, 1)
    upd = np.array([3, 2, 1, 5], np.int64)
    if reduction == "none":
        idx, upd = i64(1, 3).reshape(2, 1), np.array([3, 5], np.int64)
    check_op("ScatterND", [data, idx, upd], np.array(want, np.int64), {"reduction": reduction})


def _scatter_nd_one_by_one(data, indices, updates, reduction):
    """ONNX's definition, one index tuple at a time (what the vectorized reference must equal)."""
    combine = {"none": lambda old, new: new, "add": np.add, "mul": np.multiply, "max": np.maximum,
               "min": np.minimum}[reduction]
    out = data.copy()
    for pos in np.ndindex(*indices.shape[:-1]):
        where = tuple(int(i) for i in indices[pos])
        out[where] = combine(out[where], updates[pos])
    return out


@given(st.integers(0, 2**31), st.sampled_from(["none", "add", "mul", "max", "min"]), st.integers(0, 3))
def test_scatter_nd_vectorized_equals_one_by_one(seed, reduction, k):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 4, size=3))
    data = rng.integers(-5, 5, size=shape).astype(np.int64)
    lead = tuple(int(d) for d in rng.integers(1, 3, size=int(rng.integers(1, 3))))
    dims = np.array(shape[:k], np.int64)
    idx = (rng.integers(0, 1 << 20, size=lead + (k,)) % np.maximum(dims, 1)).astype(np.int64)
    if reduction == "none" and k:  # duplicates are undefined without a reduction: make the tuples distinct
        flat = np.array(sorted({tuple(r) for r in idx.reshape(-1, k).tolist()}), np.int64)
        idx = flat.reshape(len(flat), k)
        lead = (len(flat),)
    elif reduction == "none":
        idx, lead = idx[:1].reshape(1, 0), (1,)
    idx = np.where(rng.random(idx.shape) < 0.3, idx - dims, idx)  # negative indices count from the back
    upd = rng.integers(-5, 5, size=lead + shape[k:]).astype(np.int64)
    want = _scatter_nd_one_by_one(data, idx, upd, reduction)
    check_op("ScatterND", [data, idx, upd], want, {"reduction": reduction})


def test_scatter_nd_refuses_an_index_outside_the_data():
    with pytest.raises(EvaluationError, match="outside data"):
        evaluate(*build_single("ScatterND", [arange((4, 3)), i64(4).reshape(1, 1), arange((1, 3))]))


def test_scatter_nd_inference_errors():
    data = arange((4, 3))
    with pytest.raises(ShapeInferenceError, match="must have shape"):
        build_single("ScatterND", [data, i64(0, 1).reshape(2, 1), arange((2, 4))])
    with pytest.raises(ShapeInferenceError, match="reduction 'sum'"):
        build_single("ScatterND", [data, i64(0).reshape(1, 1), arange((1, 3))], {"reduction": "sum"})


# --------------------------------------------------------------------------- Trilu


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -2, 7])
@pytest.mark.parametrize("shape, dtype", [((4, 4), np.float32), ((2, 3, 5), np.int64), ((5, 3), np.bool_)])
def test_trilu(torch, upper, k, shape, dtype):
    x = (arange(shape, np.int64) % 3 + 1).astype(dtype)
    t = torch.from_numpy(x)
    kk = 0 if k is None else k
    expected = (torch.triu(t, kk) if upper else torch.tril(t, kk)).numpy()
    inputs = [x] if k is None else [x, np.array(k, np.int64)]
    check_op("Trilu", inputs, expected, {"upper": upper}, const_inputs=[1], symbolic_batch=True)


def test_trilu_causal_mask_and_errors():
    ones = np.ones((3, 3), np.bool_)
    check_op("Trilu", [ones], np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], np.bool_), {"upper": 0})
    with pytest.raises(ShapeInferenceError, match="rank >= 2"):
        build_single("Trilu", [np.ones(3, np.float32)])


# --------------------------------------------------------------------------- symbolic propagation


def test_slice_and_gather_propagate_shape_values():
    g = Graph("prop")
    x = g.add_input("x", "float32", ["batch", 3, 8])
    shp = g.op("Shape", x)
    rev = g.op("Slice", shp, g.add_initializer("st", i64(-1)), g.add_initializer("en", i64(INT64_MIN)),
               g.add_initializer("ax", i64(0)), g.add_initializer("sp", i64(-1)))
    last = g.op("Gather", shp, g.add_initializer("neg", i64(-1, 0)))
    g.outputs = [g.op("Reshape", x, rev), g.op("Reshape", x, g.op("Concat", last, g.add_initializer("m", i64(-1)),
                                                                  axis=0))]
    infer_shapes(g)
    verify(g)
    assert [v.type.shape for v in g.outputs] == [(8, 3, "batch"), (8, "batch", 3)]
    feed = arange((2, 3, 8))
    outs = evaluate(g, [feed])
    np.testing.assert_array_equal(outs[0], feed.reshape(8, 3, 2))
    np.testing.assert_array_equal(outs[1], feed.reshape(8, 2, 3))
