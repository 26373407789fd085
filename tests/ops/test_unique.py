"""ai.onnx ``Unique`` (11/28): all four outputs against ONNX's reference evaluator (sorted, with and without axis,
negative axes, 3-D), the spec's examples, first-occurrence order (where ONNX's reference evaluator takes the
values from the wrong axis, against the spec's examples and a plain loop), dtypes (ints, bool, float16,
bfloat16, NaN and -0.0), empty and scalar inputs, data-dependent output sizes in inference, inference errors
by name, and import of Unique-28."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from op_harness import build_single, check_op

RNG = np.random.default_rng(11)


def onnx_unique(x, attrs, num_outputs=4, opset=11):
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    outs = ["Y", "indices", "inverse_indices", "counts"][:num_outputs]
    node = helper.make_node("Unique", ["X"], outs, **attrs)
    vi = [helper.make_tensor_value_info("X", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)]
    ov = [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in outs]
    model = helper.make_model(helper.make_graph([node], "g", vi, ov), opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {"X": x})


def first_occurrence(x, axis=None):
    """Unique in first-occurrence order by a plain loop over the elements (slices) of x: the oracle for sorted=0."""
    items = list(x.reshape(-1)) if axis is None else list(np.moveaxis(x, axis, 0))
    ys, first, inverse, counts = [], [], [], []
    for i, item in enumerate(items):
        hit = next((k for k, y in enumerate(ys) if np.array_equal(y, item)), None)
        if hit is None:
            ys.append(item)
            first.append(i)
            counts.append(0)
            hit = len(ys) - 1
        inverse.append(hit)
        counts[hit] += 1
    y = np.array(ys, x.dtype) if axis is None else np.moveaxis(np.array(ys, x.dtype), 0, axis)
    i64 = np.int64
    return [y, np.array(first, i64), np.array(inverse, i64), np.array(counts, i64)]


@pytest.mark.parametrize("shape,axis", [((7,), None), ((3, 4), None), ((6, 3), 0), ((3, 6), 1), ((3, 6), -1),
                                        ((2, 5, 2), 1), ((2, 5, 2), -3), ((2, 3, 4), 2)])
def test_sorted_matches_onnx_reference(shape, axis):
    x = RNG.integers(0, 3, shape).astype(np.float32)  # few values: repeats, and repeated slices along short axes
    attrs = {} if axis is None else {"axis": axis}
    check_op("Unique", [x], onnx_unique(x, attrs), attrs, num_outputs=4)


@pytest.mark.parametrize("shape,axis", [((9,), None), ((3, 4), None), ((6, 2), 0), ((2, 6), 1), ((2, 6, 2), -2)])
def test_first_occurrence_order(shape, axis):
    x = RNG.integers(0, 3, shape).astype(np.int32)
    attrs = {"sorted": 0} if axis is None else {"sorted": 0, "axis": axis}
    check_op("Unique", [x], first_occurrence(x, axis), attrs, num_outputs=4)
    if len(shape) == 1 or axis == 0:  # where ONNX's reference evaluator takes Y from the right axis
        check_op("Unique", [x], onnx_unique(x, attrs), attrs, num_outputs=4)


@pytest.mark.parametrize("x,attrs,want", [  # the examples of the ONNX spec
    ([2, 1, 1, 3, 4, 3], {"sorted": 0}, ([2, 1, 3, 4], [0, 1, 3, 4], [0, 1, 1, 2, 3, 2], [1, 2, 2, 1])),
    ([[1, 3], [2, 3]], {}, ([1, 2, 3], [0, 2, 1], [0, 2, 1, 2], [1, 1, 2])),
    ([[1, 0, 0], [1, 0, 0], [2, 3, 4]], {"axis": 0}, ([[1, 0, 0], [2, 3, 4]], [0, 2], [0, 0, 1], [2, 1])),
    ([[[1., 1.], [0., 1.], [2., 1.], [0., 1.]], [[1., 1.], [0., 1.], [2., 1.], [0., 1.]]], {"axis": 1},
     ([[[0., 1.], [1., 1.], [2., 1.]], [[0., 1.], [1., 1.], [2., 1.]]], [1, 0, 2], [1, 0, 2, 0], [2, 1, 1])),
])
def test_spec_examples(x, attrs, want):
    x = np.array(x, np.float32)
    check_op("Unique", [x], [np.array(want[0], np.float32)] + [np.array(w, np.int64) for w in want[1:]], attrs,
             num_outputs=4)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.float64, np.float16, bool])
def test_dtypes(dtype):
    x = RNG.integers(0, 4, (12,)).astype(dtype)
    for s in (0, 1):
        check_op("Unique", [x], first_occurrence(x) if not s else None, {"sorted": s}, num_outputs=4)
    check_op("Unique", [x], [a.astype(x.dtype) if k == 0 else a for k, a in enumerate(onnx_unique(x, {}))],
             {}, num_outputs=4)


@pytest.mark.parametrize("sorted_", [0, 1])
def test_bfloat16_compares_values_exactly(sorted_):
    values = np.array([2.0, 1.0, 1.0, 3.0, -0.5, 3.0, 1e30, 1e30], np.float32)
    x = values.astype(ml_dtypes.bfloat16)
    want = onnx_unique(values, {"sorted": sorted_}) if sorted_ else first_occurrence(values)
    want[0] = want[0].astype(ml_dtypes.bfloat16)
    check_op("Unique", [x], want, {"sorted": sorted_}, num_outputs=4)


def test_nan_and_signed_zero():
    x = np.array([np.nan, 0.0, 1.0, -0.0, np.nan, 1.0], np.float32)
    y, first, inverse, counts = check_op("Unique", [x], None, {}, num_outputs=4)
    np.testing.assert_array_equal(y, [0.0, 1.0, np.nan])  # 0.0 and -0.0 one value; the NaNs one value
    np.testing.assert_array_equal(first, [1, 2, 0])
    np.testing.assert_array_equal(inverse, [2, 0, 1, 0, 2, 1])
    np.testing.assert_array_equal(counts, [2, 2, 2])
    y, first, _, _ = check_op("Unique", [x], None, {"sorted": 0}, num_outputs=4)
    np.testing.assert_array_equal(y, [np.nan, 0.0, 1.0])
    np.testing.assert_array_equal(first, [0, 1, 2])


@pytest.mark.parametrize("shape,axis,count", [((0,), None, 0), ((2, 0), None, 0), ((2, 0), 1, 0), ((2, 0), 0, 1),
                                              ((0, 3), 0, 0)])
def test_empty_inputs(shape, axis, count):
    x = np.zeros(shape, np.float32)
    attrs = {} if axis is None else {"axis": axis}
    y, first, inverse, counts = check_op("Unique", [x], None, attrs, num_outputs=4)
    assert len(counts) == count and len(first) == count and counts.sum() == len(inverse)


def test_scalar_input_flattens():
    check_op("Unique", [np.array(5.0, np.float32)], [np.array([5.0], np.float32), np.array([0]), np.array([0]),
                                                      np.array([1])], num_outputs=4)


@pytest.mark.parametrize("num_outputs", [1, 2, 3])
def test_fewer_outputs(num_outputs):
    x = np.array([3, 1, 3, 2], np.int64)
    full = first_occurrence(x)
    check_op("Unique", [x], full[:num_outputs], {"sorted": 0}, num_outputs=num_outputs)


def test_inference_sizes_are_data_dependent_unless_constant():
    x = np.array([[1, 2], [1, 2], [3, 4]], np.float32)
    g, _ = build_single("Unique", [x], {"axis": 0}, num_outputs=4, symbolic_batch=True)
    assert [v.type.shape for v in g.outputs] == [(None, 2), (None,), ("batch",), (None,)]
    g, _ = build_single("Unique", [x], {}, num_outputs=4)
    assert [v.type.shape for v in g.outputs] == [(None,), (None,), (6,), (None,)]
    g, _ = build_single("Unique", [x], {"axis": 0}, const_inputs=[0], num_outputs=4)
    assert [v.type.shape for v in g.outputs] == [(2, 2), (2,), (3,), (2,)]
    g, _ = build_single("Unique", [np.ones((1, 3), np.float32)], {"axis": 0}, num_outputs=4)
    assert g.outputs[0].type.shape == (1, 3)  # one slice: one distinct slice


@pytest.mark.parametrize("shape,attrs,match", [
    ((3,), {"sorted": 2}, "sorted must be 0 or 1"),
    ((3, 2), {"axis": 2}, "axis 2 is out of range"),
    ((), {"axis": 0}, "X is a scalar"),
])
def test_inference_errors_name_the_problem(shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(Unique\).*{match}"):
        build_single("Unique", [np.zeros(shape, np.float32)], attrs, num_outputs=4)


def test_import_of_unique_28():
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    import kiln
    x = np.array([[2, 1], [2, 1], [0, 5]], np.float32)
    node = helper.make_node("Unique", ["X"], ["Y", "", "inverse_indices"], axis=0, sorted=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("inverse_indices", onnx.TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 28)])
    y, inverse = kiln.load(kiln.import_onnx(model)).run([x], as_list=True)
    np.testing.assert_array_equal(y, [[2, 1], [0, 5]])
    np.testing.assert_array_equal(inverse, [0, 0, 1])


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_half_types_export_through_float32(dtype):
    """Unique-11 (the opsets kiln writes) has no bfloat16: a 16-bit float Unique is written as Cast to float32 (exact),
    Unique, Cast back of Y: what kiln computes."""
    onnx = pytest.importorskip("onnx")
    from kiln.ir import evaluate
    from kiln.serializer import onnx as kx
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = np.array([[3.5, -1.0, 3.5], [0.25, -1.0, 7.0]], np.float32).astype(dt)
    g, feeds = build_single("Unique", [x], {"sorted": 0}, num_outputs=4)
    proto = kx.to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["Cast", "Unique", "Cast"]
    if dt == np.float16:  # onnxruntime's Python binding takes no bfloat16
        ort = pytest.importorskip("onnxruntime")
        got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x0": x})
        for a, b in zip(got, evaluate(g, feeds)):
            np.testing.assert_array_equal(a, b)
