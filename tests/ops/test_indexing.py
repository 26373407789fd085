"""Slice, Gather, GatherElements, ScatterND and Trilu against Python slicing, numpy fancy
indexing, torch and hand-computed values."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from op_harness import build_single, check_op, i64, inferred, onnx_reference

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
    for s, e, a, step in zip(starts, ends, axes, steps):
        s, e, step = int(s), int(e), int(step)
        if step < 0 and s + x.shape[a] < 0:
            s = 0
        index[a] = slice(s, e, step)
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


# --------------------------------------------------------------------------- ONNX's reference evaluator


def runtime_refuses(op: str, inputs: list, attrs: dict, match: str) -> None:
    """Both the evaluator and the CPU runtime stop with a kiln error naming the node."""
    import kiln
    g, feeds = build_single(op, inputs, attrs)
    with pytest.raises(EvaluationError, match=match):
        evaluate(g, feeds)
    with pytest.raises(kiln.KilnError, match=match):
        kiln.load(g).run(feeds, as_list=True)


# --------------------------------------------------------------------------- GatherND


def gather_nd_loops(data, indices, batch_dims=0) -> np.ndarray:
    """ONNX's definition one index tuple at a time: Python indexing wraps negatives as ONNX does."""
    b = batch_dims
    k = indices.shape[-1]
    out = np.empty(indices.shape[:-1] + data.shape[b + k:], data.dtype)
    for pos in np.ndindex(*indices.shape[:-1]):
        out[pos] = data[pos[:b] + tuple(int(i) for i in indices[pos])]
    return out


GATHER_ND_CASES = [  # data shape, indices, batch_dims: the five examples of ONNX's documentation first
    ((2, 2), [[0, 0], [1, 1]], 0),
    ((2, 2), [[1], [0]], 0),
    ((2, 2, 2), [[0, 1], [1, 0]], 0),
    ((2, 2, 2), [[[0, 1]], [[1, 0]]], 0),
    ((2, 2, 2), [[1], [0]], 1),
    ((3, 4, 5), [[-1, 2, -5], [0, -4, 4]], 0),
    ((3, 4, 5), [[[2], [-1]], [[0], [3]], [[1], [1]]], 1),
    ((2, 3, 4, 5), [[[1, -1], [0, 0]], [[2, 3], [-3, 2]]], 1),
    ((2, 3, 4, 5), [[[3], [-1], [0]], [[2], [1], [-4]]], 2),
    ((2, 3, 4), np.zeros((0, 2), np.int64), 0),
]


@pytest.mark.parametrize("shape, idx, batch_dims", GATHER_ND_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_, np.float16])
def test_gather_nd(shape, idx, batch_dims, dtype):
    x = (arange(shape, np.int64) % 7).astype(dtype)
    idx = np.asarray(idx, np.int64)
    check_op("GatherND", [x, idx], gather_nd_loops(x, idx, batch_dims), {"batch_dims": batch_dims},
             symbolic_batch=batch_dims > 0)
    check_op("GatherND", [x, idx], gather_nd_loops(x, idx, batch_dims), {"batch_dims": batch_dims}, const_inputs=[1])


@pytest.mark.parametrize("shape, idx, batch_dims", GATHER_ND_CASES[:-1])
def test_gather_nd_matches_onnx_reference(shape, idx, batch_dims):
    x = arange(shape)
    idx = np.asarray(idx, np.int64)
    check_op("GatherND", [x, idx], onnx_reference("GatherND", [x, idx], {"batch_dims": batch_dims}, 13),
             {"batch_dims": batch_dims})


def test_gather_nd_last_token_pooling():
    """What the dynamo exporter writes for hidden[arange(b), lengths - 1]: one (batch, position) tuple per row."""
    hidden = arange((3, 5, 4))
    rows = i64(0, 1, 2)
    last = i64(4, 1, -1)
    check_op("GatherND", [hidden, np.stack([rows, last], axis=1)], hidden[rows, last])
    check_op("GatherND", [hidden, last.reshape(3, 1)], hidden[rows, last], {"batch_dims": 1}, symbolic_batch=True)


def test_gather_nd_inference():
    x = arange((3, 4, 5))
    assert inferred("GatherND", [x, np.zeros((3, 2, 1), np.int64)], {"batch_dims": 1}) == [("batch", 2, 5)]
    assert inferred("GatherND", [x, np.zeros((3, 2), np.int64)], {"batch_dims": 1}) == [(3,)]  # the int beats "batch"
    assert inferred("GatherND", [x, np.zeros((6, 3), np.int64)], symbolic_batch=False) == [(6,)]
    assert inferred("GatherND", [x, np.zeros((2, 7, 1), np.int64)], symbolic_batch=False) == [(2, 7, 4, 5)]
    g = Graph("g")  # the tuple length unknown: so is the output's rank
    v = g.add_input("x", "float32", [3, 4])
    g.outputs = [g.op("GatherND", v, g.add_input("i", "int64", [2, "k"]))]
    infer_shapes(g)
    assert g.outputs[0].type.shape is None


@pytest.mark.parametrize("shape, idx, attrs, match", [
    ((3, 4), np.zeros((2, 3), np.int64), {}, r"index tuples have 3 elements .* 1 to 2"),
    ((3, 4), np.zeros((3, 2), np.int64), {"batch_dims": 1}, r"1 to 1 \(data rank 2 less batch_dims 1\)"),
    ((3, 4), np.zeros((2, 0), np.int64), {}, "index tuples have 0 elements"),
    ((3, 4), np.zeros((3, 1), np.int64), {"batch_dims": 2}, "batch_dims 2 must be less than the ranks"),
    ((3, 4), np.zeros((3, 1), np.int64), {"batch_dims": -1}, "batch_dims must be >= 0"),
    ((3, 4), np.zeros((2, 1), np.int64), {"batch_dims": 1}, "first batch_dims=1 dims of data"),
    ((3, 4), np.array(1, np.int64), {}, "indices must have rank >= 1"),
    ((), np.zeros((1, 1), np.int64), {}, "data must have rank >= 1"),
])
def test_gather_nd_inference_errors(shape, idx, attrs, match):
    with pytest.raises(ShapeInferenceError, match=r"node 'gathernd' \(GatherND\).*" + match):
        build_single("GatherND", [arange(shape), idx], attrs)


def test_gather_nd_refuses_an_index_out_of_range():
    x = arange((3, 4))
    with pytest.raises(ShapeInferenceError, match=r"\(GatherND\).*index 4 is out of range \[-4, 4\) for axis 1"):
        build_single("GatherND", [x, i64(0, 4).reshape(1, 2)], const_inputs=[1])
    with pytest.raises(ShapeInferenceError, match=r"index -4 is out of range \[-3, 3\) for axis 0"):
        build_single("GatherND", [x, i64(-4).reshape(1, 1)], const_inputs=[1])
    runtime_refuses("GatherND", [x, i64(1, 0, 2, 4).reshape(2, 2)], {}, "node 'gathernd'.*outside data")
    runtime_refuses("GatherND", [x, i64(-4, 0).reshape(1, 2)], {}, "outside data")
    runtime_refuses("GatherND", [arange((2, 3, 4)), i64(1, 3).reshape(2, 1)], {"batch_dims": 1}, "outside data")


# --------------------------------------------------------------------------- ScatterElements


def torch_scatter(torch, data, indices, updates, axis, reduction):
    """torch's scatter/scatter_reduce (include_self: the data takes part, as in ONNX); indices made >= 0."""
    t = torch.from_numpy(data.copy())
    idx = torch.from_numpy(np.where(indices < 0, indices + data.shape[axis], indices).astype(np.int64))
    src = torch.from_numpy(updates)
    if reduction == "none":
        return t.scatter(axis, idx, src).numpy()
    how = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[reduction]
    return t.scatter_reduce(axis, idx, src, how, include_self=True).numpy()


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32])
def test_scatter_elements_matches_torch(torch, rng, reduction, axis, dtype):
    data = rng.integers(-5, 6, size=(4, 5, 3)).astype(dtype)
    shape = [3, 4, 2]
    n = data.shape[axis]
    if reduction == "none":  # distinct targets: duplicates are undefined without a reduction
        shape[axis] = 2
        idx = np.moveaxis(np.broadcast_to(i64(n - 1, -n).reshape(2, 1, 1), [2] + [s for i, s in enumerate(shape)
                                                                                 if i != axis % 3]), 0, axis)
    else:
        idx = rng.integers(-n, n, size=shape)
    idx = np.ascontiguousarray(idx).astype(np.int32 if dtype == np.int32 else np.int64)
    upd = rng.integers(-5, 6, size=idx.shape).astype(dtype)
    want = torch_scatter(torch, data, idx, upd, axis, reduction)
    attrs = {"axis": axis, "reduction": reduction}
    check_op("ScatterElements", [data, idx, upd], want, attrs)
    check_op("ScatterElements", [data, idx, upd], onnx_reference("ScatterElements", [data, idx, upd], attrs), attrs)


def test_scatter_elements_documented_examples_and_duplicates():
    data = np.zeros((3, 3), np.float32)
    idx = i64(1, 0, 2, 0, 2, 1).reshape(2, 3)
    upd = np.array([[1.0, 1.1, 1.2], [2.0, 2.1, 2.2]], np.float32)
    check_op("ScatterElements", [data, idx, upd], np.array([[2.0, 1.1, 0.0], [1.0, 0.0, 2.2], [0.0, 2.1, 1.2]]))
    row = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)
    check_op("ScatterElements", [row, i64(1, 3).reshape(1, 2), np.array([[1.1, 2.1]], np.float32)],
             np.array([[1.0, 1.1, 3.0, 2.1, 5.0]]), {"axis": 1})
    check_op("ScatterElements", [row, i64(1, -1).reshape(1, 2), np.array([[1.1, 2.1]], np.float32)],
             np.array([[1.0, 1.1, 3.0, 4.0, 2.1]]), {"axis": 1})
    dup = i64(1, 1).reshape(1, 2)  # duplicates combine in order
    two = np.array([[1.1, 2.1]], np.float32)
    check_op("ScatterElements", [row, dup, two], np.array([[1.0, 5.2, 3.0, 4.0, 5.0]]),
             {"axis": 1, "reduction": "add"})
    check_op("ScatterElements", [row, dup, two], np.array([[1.0, 2 * 1.1 * 2.1, 3.0, 4.0, 5.0]]),
             {"axis": 1, "reduction": "mul"}, rtol=1e-6)
    flags = np.array([[False, True, False]])
    check_op("ScatterElements", [flags, i64(0, 2).reshape(1, 2), np.array([[True, True]])],
             np.array([[True, True, True]]), {"axis": 1, "reduction": "max"})


def test_scatter_elements_keeps_symbolic_dims():
    data = arange((3, 4))
    idx = np.zeros((3, 2), np.int64)
    assert inferred("ScatterElements", [data, idx, arange((3, 2))], {"axis": 1}) == [("batch", 4)]


@pytest.mark.parametrize("inputs, attrs, match", [
    ([arange((3, 4)), np.zeros((2, 2), np.int64), arange((2, 2))], {"reduction": "sum"}, "reduction 'sum'"),
    ([arange((3, 4)), np.zeros((2, 2), np.int64), np.zeros((2, 2), np.int64)], {},
     "updates are int64, data is float32"),
    ([arange((3, 4)), np.zeros(2, np.int64), arange((2,))], {}, "must have the same rank"),
    ([arange((3, 4)), np.zeros((2, 2), np.int64), arange((2, 3))], {}, "must have the shape of indices"),
    ([arange((3, 4)), np.zeros((2, 2), np.int64), arange((2, 2))], {"axis": 2}, "axis 2 is out of range for rank 2"),
    ([arange((3, 4)), np.zeros((2, 5), np.int64), arange((2, 5))], {}, "larger than data .* on axis 1"),
    ([arange(()), np.zeros((), np.int64), arange(())], {}, "data must have rank >= 1"),
])
def test_scatter_elements_inference_errors(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=r"node 'scatterelements' \(ScatterElements\).*" + match):
        build_single("ScatterElements", inputs, attrs)


def test_scatter_elements_refuses_an_index_out_of_range():
    data = arange((3, 4))
    with pytest.raises(ShapeInferenceError, match=r"index 4 is out of range \[-4, 4\) for axis 1"):
        build_single("ScatterElements", [data, i64(0, 4).reshape(1, 2), arange((1, 2))], {"axis": 1}, const_inputs=[1])
    runtime_refuses("ScatterElements", [data, i64(0, 4).reshape(1, 2), arange((1, 2))], {"axis": 1},
                    r"node 'scatterelements'.*out of range \[-4, 4\) on axis 1")
    runtime_refuses("ScatterElements", [data, i64(-4, 0).reshape(2, 1), arange((2, 1))], {"reduction": "add"},
                    r"out of range \[-3, 3\) on axis 0")


# --------------------------------------------------------------------------- OneHot


def one_hot_loops(indices, depth, values, axis) -> np.ndarray:
    """on_value at each in-range index (negatives from the back) on a last axis, then moved to ``axis``."""
    out = np.full(indices.shape + (depth,), values[0], values.dtype)
    for pos in np.ndindex(*indices.shape):
        i = int(indices[pos])
        i = i + depth if i < 0 else i
        if 0 <= i < depth:
            out[pos + (i,)] = values[1]
    return np.moveaxis(out, -1, axis % (indices.ndim + 1))


ONE_HOT_INDICES = np.array([[1, 9, -1], [0, -10, 3], [12, -11, 4]], np.int64)  # in range, negative, outside


@pytest.mark.parametrize("axis", [-1, 0, 1, 2, -2, -3])
@pytest.mark.parametrize("values", [np.array([0, 1], np.float32), np.array([-2, 5], np.int64),
                                    np.array([False, True]), np.array([0.5, 3], np.float16)])
def test_one_hot(axis, values):
    want = one_hot_loops(ONE_HOT_INDICES, 10, values, axis)
    args = [ONE_HOT_INDICES, np.array(10, np.int64), values]
    check_op("OneHot", args, want, {"axis": axis}, const_inputs=[1, 2], symbolic_batch=axis != 0)
    check_op("OneHot", args, want, {"axis": axis})


@pytest.mark.parametrize("indices, depth, axis", [
    (ONE_HOT_INDICES, np.array(10, np.int64), -1),
    (ONE_HOT_INDICES.astype(np.int32), np.array([7], np.int32), 0),
    (np.array([[1.0, 9.0], [2.0, -4.0]], np.float32), np.array(10.0, np.float32), 1),
    (np.array([0, 2, -3, 5], np.int8), np.array(3.0, np.float64), -1),
])
def test_one_hot_matches_onnx_reference(indices, depth, axis):
    values = np.array([1, 3], np.float32)
    # onnx.reference takes depth as a scalar only (ONNX also allows a 1-element tensor)
    want = onnx_reference("OneHot", [indices, depth.reshape(()), values], {"axis": axis}, 11)
    check_op("OneHot", [indices, depth, values], want, {"axis": axis}, const_inputs=[1])
    loops = one_hot_loops(indices.astype(np.int64), int(depth.reshape(-1)[0]), values, axis)
    np.testing.assert_array_equal(want, loops)


def test_one_hot_truncates_float_indices_and_depth():
    values = np.array([0, 1], np.int64)
    got = check_op("OneHot", [np.array([1.7, -0.5, -1.2], np.float32), np.array(3.9, np.float32), values],
                   None, const_inputs=[1])[0]
    np.testing.assert_array_equal(got, [[0, 1, 0], [1, 0, 0], [0, 0, 1]])  # 1, 0 and -1 (the last) after truncation


def test_one_hot_inference():
    idx = np.zeros((3, 4), np.int64)
    values = np.array([0, 1], np.float32)
    assert inferred("OneHot", [idx, np.array(5, np.int64), values], {"axis": 1}, const_inputs=[1]) == [("batch", 5, 4)]
    assert inferred("OneHot", [idx, np.array(5, np.int64), values], {}) == [("batch", 4, None)]  # depth at run time
    g = Graph("g")  # depth read off a shape keeps its symbol
    x = g.add_input("x", "float32", ["batch", "classes"])
    labels = g.add_input("labels", "int64", ["batch"])
    depth = g.op("Gather", g.op("Shape", x), g.add_initializer("one", i64(1)))
    g.outputs = [g.op("OneHot", labels, depth, g.add_initializer("v", values))]
    infer_shapes(g)
    assert g.outputs[0].type.shape == ("batch", "classes")


@pytest.mark.parametrize("depth, values, attrs, match", [
    (np.array(5, np.int64), np.array([0, 1, 2], np.float32), {}, "values must be a 1-D tensor of two elements"),
    (np.array(5, np.int64), np.array([[0, 1]], np.float32), {}, "values must be a 1-D tensor of two elements"),
    (np.array([5, 6], np.int64), np.array([0, 1], np.float32), {}, "depth must be a scalar"),
    (np.array(-2, np.int64), np.array([0, 1], np.float32), {}, "depth must be >= 0, got -2"),
    (np.array(np.nan, np.float32), np.array([0, 1], np.float32), {}, "depth nan is not a finite number"),
    (np.array(5, np.int64), np.array([0, 1], np.float32), {"axis": 3}, "axis 3 is out of range for rank 3"),
    (np.array(5, np.int64), np.array([0, 1], np.float32), {"axis": -4}, "axis -4 is out of range for rank 3"),
])
def test_one_hot_inference_errors(depth, values, attrs, match):
    with pytest.raises(ShapeInferenceError, match=r"node 'onehot' \(OneHot\).*" + match):
        build_single("OneHot", [np.zeros((2, 3), np.int64), depth, values], attrs, const_inputs=[1])


def test_one_hot_refuses_a_negative_depth_at_run_time():
    runtime_refuses("OneHot", [i64(0, 1), np.array(-1, np.int64), np.array([0, 1], np.float32)], {},
                    "node 'onehot'.*depth must be >= 0")


# --------------------------------------------------------------------------- Compress


COMPRESS_CASES = [  # condition, axis: shorter than the axis, longer with False past the end, none selected
    ([False, True, True], 0), ([True, False, True, True], 1), ([True, False], -1), ([False, True, False, False], 2),
    ([False, False, False], 0), ([], 1), ([False, True, False, False, False, True, True], None),
    ([True] * 24 + [False] * 3, None),
]


@pytest.mark.parametrize("cond, axis", COMPRESS_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_compress_matches_numpy(cond, axis, dtype):
    x = (arange((3, 4, 2), np.int64) % 5).astype(dtype)
    cond = np.array(cond, np.bool_)
    attrs = {} if axis is None else {"axis": axis}
    want = np.compress(cond, x, axis=axis)
    check_op("Compress", [x, cond], want, attrs, symbolic_batch=axis not in (0, None))
    got = check_op("Compress", [x, cond], want, attrs, const_inputs=[1])
    if axis is None:  # without an axis the flattened elements, by mask indexing
        np.testing.assert_array_equal(got[0], x.reshape(-1)[:len(cond)][cond[:x.size]])


@pytest.mark.parametrize("cond, axis", COMPRESS_CASES[:-2])
def test_compress_matches_onnx_reference(cond, axis):
    x = arange((3, 4, 2))
    cond = np.array(cond, np.bool_)
    attrs = {} if axis is None else {"axis": axis}
    check_op("Compress", [x, cond], onnx_reference("Compress", [x, cond], attrs, 11), attrs)


def test_compress_inference():
    x = arange((3, 4, 2))
    cond = np.array([True, False, True])
    assert inferred("Compress", [x, cond], {"axis": 1}) == [("batch", None, 2)]  # a size the condition's values give
    assert inferred("Compress", [x, cond], {"axis": 1}, const_inputs=[1]) == [("batch", 2, 2)]
    assert inferred("Compress", [x, cond], {}) == [(None,)]
    assert inferred("Compress", [x, cond], {}, const_inputs=[1], symbolic_batch=False) == [(2,)]
    assert inferred("Compress", [x, np.zeros(0, np.bool_)], {"axis": 2}) == [("batch", 4, 0)]


@pytest.mark.parametrize("x, cond, attrs, match", [
    (arange((3, 4)), np.ones((2, 2), np.bool_), {}, "condition must be a 1-D bool tensor"),
    (arange((3, 4)), np.ones(2, np.bool_), {"axis": 2}, "axis 2 is out of range for rank 2"),
    (arange(()), np.ones(1, np.bool_), {}, "input must have rank >= 1"),
])
def test_compress_inference_errors(x, cond, attrs, match):
    with pytest.raises(ShapeInferenceError, match=r"node 'compress' \(Compress\).*" + match):
        build_single("Compress", [x, cond], attrs)


def test_compress_refuses_a_selection_past_the_end():
    x = arange((3, 4))
    long = np.array([False, True, False, True, True])
    with pytest.raises(ShapeInferenceError, match="selects position 4, but there are only 4 slices along axis 1"):
        build_single("Compress", [x, long], {"axis": 1}, const_inputs=[1])
    with pytest.raises(ShapeInferenceError, match="position 12, but there are only 12 elements"):
        build_single("Compress", [x, np.ones(13, np.bool_)], {}, const_inputs=[1])
    runtime_refuses("Compress", [x, long], {"axis": -1}, "node 'compress'.*selects position 4")


def test_nonzero_lists_indices_row_major():
    x = np.array([[1, 0, 3], [0, 0, 5]], np.float32)
    check_op("NonZero", [x], np.array([[0, 0, 1], [0, 2, 2]], np.int64))
    check_op("NonZero", [np.zeros((2, 3), bool)], np.zeros((2, 0), np.int64))
    check_op("NonZero", [np.array(3, np.int32)], np.zeros((1, 1), np.int64))


# --------------------------------------------------------------------------- ReverseSequence


def onnx_model(op, inputs, attrs, opset, initializers=()):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper
    names = [f"i{k}" for k in range(len(inputs))]
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
          for k, (n, a) in enumerate(zip(names, inputs)) if k not in initializers]
    inits = [numpy_helper.from_array(inputs[k], names[k]) for k in initializers]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", vi,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("shape,batch_axis,time_axis,lens", [
    ((4, 4), 1, 0, [4, 3, 2, 1]), ((4, 4), 0, 1, [1, 2, 3, 4]), ((5, 3, 2), 1, 0, [0, 5, 2]),
    ((3, 5, 2, 2), 0, 1, [5, 1, 3]), ((2, 6), 0, 1, [0, 0])])
def test_reverse_sequence_matches_onnx_reference(shape, batch_axis, time_axis, lens):
    x = arange(shape)
    lens = np.array(lens, np.int64)
    attrs = {"batch_axis": batch_axis, "time_axis": time_axis}
    want = onnx_reference("ReverseSequence", [x, lens], attrs, opset=10)
    check_op("ReverseSequence", [x, lens], want, attrs)
    check_op("ReverseSequence", [x, lens], want, attrs, const_inputs=[1])


def test_reverse_sequence_spec_example():
    x = arange((4, 4)).T.copy()
    check_op("ReverseSequence", [x, i64(4, 3, 2, 1)],
             np.array([[3, 6, 9, 12], [2, 5, 8, 13], [1, 4, 10, 14], [0, 7, 11, 15]], np.float32),
             {"time_axis": 0, "batch_axis": 1})


@pytest.mark.parametrize("dtype", [np.int8, np.int64, bool, np.float16, "bfloat16"])
def test_reverse_sequence_dtypes(dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = arange((3, 4), np.float32) % 5
    want = onnx_reference("ReverseSequence", [x, i64(2, 4, 1)], {"batch_axis": 0, "time_axis": 1}, opset=10)
    check_op("ReverseSequence", [x.astype(dt), i64(2, 4, 1)], want.astype(dt), {"batch_axis": 0, "time_axis": 1})


def test_reverse_sequence_keeps_symbolic_dims():
    [shape] = inferred("ReverseSequence", [arange((5, 3, 2)), i64(1, 2, 3)])
    assert shape == ("batch", 3, 2)


@pytest.mark.parametrize("shape,lens,attrs,match", [
    ((4, 3), [1, 2, 3], {"batch_axis": 1, "time_axis": 1}, "must be 0 and 1"),
    ((4, 3), [1, 2, 3], {"batch_axis": 2, "time_axis": 0}, "must be 0 and 1"),
    ((4,), [1], {}, "rank >= 2"),
    ((4, 3), [1, 2], {}, "sequence_lens has 2 lengths, but the batch axis 1 of input has 3"),
    ((4, 3), [1, 5, 2], {}, r"must lie in \[0, 4\]"),
    ((4, 3), [1, -1, 2], {}, r"must lie in \[0, 4\]"),
])
def test_reverse_sequence_bad_inputs_fail(shape, lens, attrs, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(ReverseSequence\).*{match}"):
        build_single("ReverseSequence", [arange(shape), np.array(lens, np.int64)], attrs, const_inputs=[1])


def test_reverse_sequence_length_out_of_range_at_run_time_fails():
    g, feeds = build_single("ReverseSequence", [arange((4, 3)), i64(1, 5, 2)])
    with pytest.raises(EvaluationError, match=r"must lie in \[0, 4\]"):
        evaluate(g, feeds)


def test_reverse_sequence_28_imports():
    import kiln
    x, lens = arange((3, 4)), i64(4, 0, 2)
    model = onnx_model("ReverseSequence", [x, lens], {"batch_axis": 0, "time_axis": 1}, opset=28)
    (y,) = kiln.load(kiln.import_onnx(model)).run([x, lens], as_list=True)
    np.testing.assert_array_equal(y, onnx_reference("ReverseSequence", [x, lens], {"batch_axis": 0, "time_axis": 1},
                                                    opset=10))


# --------------------------------------------------------------------------- Scatter (deprecated): ScatterElements


@pytest.mark.parametrize("opset", [9, 10, 11, 18])
@pytest.mark.parametrize("axis", [None, 1, -2])
def test_scatter_imports_as_scatter_elements(opset, axis):
    import kiln
    data = arange((3, 4))
    indices = np.array([[1, 0, 2, 0], [2, 2, 0, 1]], np.int64) if axis != 1 else np.array([[3, 0], [1, 2], [0, 3]])
    updates = -arange(indices.shape) - 1
    attrs = {} if axis is None else {"axis": axis}
    for initializers in ((), (1,)):
        model = onnx_model("Scatter", [data, indices, updates], attrs, opset, initializers)
        graph = kiln.import_onnx(model)
        assert [n.op for n in graph.nodes] == ["ScatterElements"]
        assert graph.nodes[0].attrs.get("axis", 0) == (axis or 0)
        feeds = [data, updates] if initializers else [data, indices, updates]
        (y,) = kiln.load(graph).run(feeds, as_list=True)
        want = onnx_reference("ScatterElements", [data, indices, updates], attrs, opset=11)
        np.testing.assert_array_equal(y, want)


def test_scatter_int32_indices_and_a_bad_axis():
    import kiln
    data, indices, updates = arange((2, 3)), np.array([[2], [0]], np.int32), np.array([[7.0], [8.0]], np.float32)
    (y,) = kiln.load(kiln.import_onnx(onnx_model("Scatter", [data, indices, updates], {"axis": 1}, 10))).run(
        [data, indices, updates], as_list=True)
    np.testing.assert_array_equal(y, [[0, 1, 7], [8, 4, 5]])
    with pytest.raises(kiln.KilnError, match=r"ScatterElements.*axis 2 is out of range"):
        kiln.import_onnx(onnx_model("Scatter", [data, indices, updates], {"axis": 2}, 10))


def test_reverse_sequence_of_bfloat16_exports_through_float32():
    """ReverseSequence-10 (the opsets kiln writes) has no bfloat16 (28 adds it): Cast to float32 (exact), Cast back."""
    import ml_dtypes
    onnx = pytest.importorskip("onnx")
    from kiln.serializer import onnx as kx
    g, _ = build_single("ReverseSequence", [arange((3, 2)).astype(ml_dtypes.bfloat16), i64(2, 3)], const_inputs=[1])
    proto = kx.to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["Cast", "ReverseSequence", "Cast"]
    g, _ = build_single("ReverseSequence", [arange((3, 2)).astype(np.float16), i64(2, 3)], const_inputs=[1])
    assert [n.op_type for n in kx.to_onnx_model(g).graph.node] == ["ReverseSequence"]
