"""Identity, Constant, ConstantOfShape, EyeLike, Range and Dropout against torch and hand values."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from op_harness import build_single, check_op, i64, onnx_reference

from kiln.errors import ShapeInferenceError
from kiln.ir import DType, Graph, evaluate, verify
from kiln.ir.evaluator import EvaluationError
from kiln.ir.passes import infer_shapes






@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.bool_, ml_dtypes.bfloat16])
def test_identity(dtype):
    x = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
    out = check_op("Identity", [x], None, symbolic_batch=True)[0]
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out.astype(np.float64), x.astype(np.float64))


# --------------------------------------------------------------------------- Constant


@pytest.mark.parametrize("attrs, expected", [
    ({"value": np.array([[1.5, 2]], np.float16)}, np.array([[1.5, 2]], np.float16)),
    ({"value": np.array(True)}, np.array(True)),
    ({"value_float": 0.25}, np.array(0.25, np.float32)),
    ({"value_floats": [1.0, -2.0]}, np.array([1, -2], np.float32)),
    ({"value_int": -3}, np.array(-3, np.int64)),
    ({"value_ints": [4, 5, 6]}, np.array([4, 5, 6], np.int64)),
])
def test_constant(attrs, expected):
    out = check_op("Constant", [], expected, attrs)[0]
    assert out.dtype == expected.dtype


def test_constant_needs_exactly_one_value():
    with pytest.raises(ShapeInferenceError, match=r"node 'constant' \(Constant\).*exactly one"):
        build_single("Constant", [], {"value_int": 1, "value_float": 2.0})
    with pytest.raises(ShapeInferenceError, match="got none"):
        build_single("Constant", [], {})


def test_constant_shape_feeds_reshape():
    g = Graph("const")
    x = g.add_input("x", "float32", ["batch", 6])
    g.outputs = [g.op("Reshape", x, g.op("Constant", value_ints=[0, 2, 3]))]
    infer_shapes(g)
    verify(g)
    assert g.outputs[0].type.shape == ("batch", 2, 3)


# --------------------------------------------------------------------------- ConstantOfShape


@pytest.mark.parametrize("shape, value", [
    ((2, 3), None), ((4,), np.array([7], np.int64)), ((), np.array([1.5], np.float64)),
    ((3, 0), np.array([True])), ((1, 2), np.array([2], np.float16)),
])
def test_constant_of_shape(shape, value):
    fill = np.zeros(1, np.float32) if value is None else value
    expected = np.full(shape, fill[0], dtype=fill.dtype)
    attrs = {} if value is None else {"value": value}
    check_op("ConstantOfShape", [np.array(shape, np.int64)], expected, attrs, const_inputs=[0])


def test_constant_of_shape_inference():
    g, _ = build_single("ConstantOfShape", [i64(2, 5)])
    assert g.outputs[0].type.shape == (None, None)
    with pytest.raises(ShapeInferenceError, match="exactly one element"):
        build_single("ConstantOfShape", [i64(2)], {"value": np.array([1, 2], np.int64)}, const_inputs=[0])
    with pytest.raises(ShapeInferenceError, match="negative dim"):
        build_single("ConstantOfShape", [i64(2, -1)], const_inputs=[0])


# --------------------------------------------------------------------------- EyeLike


def diagonal(rows: int, cols: int, k: int, dtype) -> np.ndarray:
    """Ones where column - row == k."""
    return (np.arange(cols)[None, :] - np.arange(rows)[:, None] == k).astype(dtype)


@pytest.mark.parametrize("shape", [(3, 3), (2, 5), (5, 2), (0, 3)])
@pytest.mark.parametrize("k", [0, 1, -1, 3, -7])
@pytest.mark.parametrize("dtype, to", [(np.float32, None), (np.int64, None), (np.bool_, None),
                                       (np.float32, DType.INT32), (np.int8, DType.FLOAT16),
                                       (np.float16, DType.BFLOAT16), (np.int32, DType.BOOL)])
def test_eye_like(shape, k, dtype, to):
    x = np.full(shape, 7).astype(dtype)  # the input's values are not read
    out_dtype = dtype if to is None else to.numpy
    attrs = {"k": k} if to is None else {"k": k, "dtype": to.value}
    out = check_op("EyeLike", [x], diagonal(*shape, k, out_dtype), attrs, symbolic_batch=True)[0]
    assert out.dtype == out_dtype


@pytest.mark.parametrize("k, to", [(0, None), (2, 6), (-1, 11)])
def test_eye_like_matches_onnx_reference(k, to):
    x = np.zeros((3, 4), np.float32)
    attrs = {"k": k} if to is None else {"k": k, "dtype": to}
    want = onnx_reference("EyeLike", [x], attrs, 22)
    out = check_op("EyeLike", [x], want, attrs)[0]
    assert out.dtype == want.dtype


def test_eye_like_inference():
    g, _ = build_single("EyeLike", [np.zeros((4, 6), np.float16)], {"dtype": DType.INT64.value}, symbolic_batch=True)
    assert (g.outputs[0].type.dtype, g.outputs[0].type.shape) == (DType.INT64, ("batch", 6))
    with pytest.raises(ShapeInferenceError, match=r"node 'eyelike' \(EyeLike\).*must be a 2-D tensor"):
        build_single("EyeLike", [np.zeros((2, 3, 4), np.float32)])
    with pytest.raises(ShapeInferenceError, match=r"node 'eyelike' \(EyeLike\).*must be a 2-D tensor"):
        build_single("EyeLike", [np.zeros(3, np.float32)])
    with pytest.raises(ShapeInferenceError, match="dtype=8 is not a dtype kiln supports"):
        build_single("EyeLike", [np.zeros((2, 2), np.float32)], {"dtype": 8})  # string


# --------------------------------------------------------------------------- Range


@pytest.mark.parametrize("start, limit, delta, dtype", [
    (0, 5, 1, np.int64), (10, 1, -3, np.int32), (3, 3, 1, np.int16), (5, 1, 2, np.int64),
    (0.0, 1.0, 0.1, np.float32), (1.0, -2.0, -0.5, np.float64), (0.5, 2.25, 0.25, np.float32),
])
def test_range(torch, start, limit, delta, dtype):
    torch_dtype = torch.float64 if np.dtype(dtype).kind == "f" else torch.int64
    if (limit - start) * delta > 0:
        expected = torch.arange(start, limit, delta, dtype=torch_dtype).numpy().astype(dtype)
    else:  # torch refuses a range that runs the wrong way; ONNX gives an empty one
        expected = np.zeros(0, dtype)
    args = [np.array(v, dtype) for v in (start, limit, delta)]
    check_op("Range", args, expected, const_inputs=[0, 1, 2])
    g, _ = build_single("Range", args)
    assert g.outputs[0].type.shape == (None,)


def test_range_symbolic_length():
    g = Graph("rng")
    x = g.add_input("x", "float32", ["batch", "seq", 4])
    seq = g.op("Gather", g.op("Shape", x), g.add_initializer("one", np.array(1, np.int64)))
    pos = g.op("Range", g.add_initializer("zero", np.array(0, np.int64)), seq,
               g.add_initializer("step", np.array(1, np.int64)))
    g.outputs = [pos]
    infer_shapes(g)
    verify(g)
    assert pos.type.shape == ("seq",)
    np.testing.assert_array_equal(evaluate(g, [np.zeros((2, 5, 4), np.float32)])[0], np.arange(5))


def test_range_errors():
    with pytest.raises(ShapeInferenceError, match=r"node 'range' \(Range\).*delta must not be 0"):
        build_single("Range", [np.array(0, np.int64)] * 3, const_inputs=[0, 1, 2])
    with pytest.raises(ShapeInferenceError, match="share a dtype"):
        build_single("Range", [np.array(0, np.int64), np.array(3, np.int32), np.array(1, np.int64)])
    with pytest.raises(ShapeInferenceError, match="must be a scalar"):
        build_single("Range", [np.array([0, 1], np.int64), np.array(3, np.int64), np.array(1, np.int64)])


# --------------------------------------------------------------------------- Dropout


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_dropout_is_identity_at_inference(dtype):
    x = np.linspace(-1, 1, 12).reshape(3, 4).astype(dtype)
    check_op("Dropout", [x], x, symbolic_batch=True)
    check_op("Dropout", [x, np.array(0.5, dtype), np.array(False)], [x, np.ones((3, 4), bool)],
             const_inputs=[1, 2], num_outputs=2, symbolic_batch=True)


def test_dropout_training_mode_is_rejected():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(ShapeInferenceError, match=r"node 'dropout' \(Dropout\).*training_mode=True"):
        build_single("Dropout", [x, None, np.array(True)], const_inputs=[2])
    g, feeds = build_single("Dropout", [x, None, np.array(True)])
    with pytest.raises(EvaluationError, match=r"node 'dropout' \(Dropout\).*training_mode=True"):
        evaluate(g, feeds)
