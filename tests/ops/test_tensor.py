"""Identity, Constant, ConstantOfShape, EyeLike, Range (Range-27) and Dropout against torch, ONNX's reference
evaluator and hand values."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from op_harness import build_single, check_op, i64, onnx_reference

from kiln.errors import ShapeInferenceError, UnsupportedOpError
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


@pytest.mark.parametrize("start, limit, delta", [(1, 5, 1), (0.5, 10.25, 0.75), (10, -3, -1.5), (3, 3, 1),
                                                 (2, 1, 1), (1000, 1032, 0.125), (-7.25, 300.5, 3.3)])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("stash_type", [None, 1, 11])
def test_range_27_half_types_match_onnx_reference(start, limit, delta, dtype, stash_type):
    """Range-27: float16/bfloat16 computed in stash_type (float unless 11, double) and rounded once, exactly as ONNX's
    reference computes them; ones the half types cannot step through exactly (1000 + k/8 in bfloat16) show it."""
    args = [np.array(v).astype(dtype) for v in (start, limit, delta)]
    attrs = {} if stash_type is None else {"stash_type": stash_type}
    want = onnx_reference("Range", args, attrs, opset=27)
    got = check_op("Range", args, None, attrs, const_inputs=[0, 1, 2])[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
    check_op("Range", args, [want], attrs)  # run-time inputs: the length is known at run time only


def test_range_27_stash_type_changes_half_results():
    """Stepping float16 itself would stall at 2048 + 1 == 2048; float (the default stash) does not."""
    args = [np.array(v, np.float16) for v in (2040, 2060, 1)]
    got = check_op("Range", args, None, {}, const_inputs=[0, 1, 2])[0]
    np.testing.assert_array_equal(got, (2040 + np.arange(20, dtype=np.float32)).astype(np.float16))
    assert got[-1] == 2060  # 2059 rounded to float16's even numbers above 2048, not stalled at 2048


@pytest.mark.parametrize("stash_type", [1, 11, 7])
def test_range_stash_type_has_no_effect_on_other_types(stash_type):
    args = [np.array(v, np.float32) for v in (0.0, 1.0, 0.1)]
    want = onnx_reference("Range", args, {}, opset=11)
    check_op("Range", args, want, {"stash_type": stash_type}, const_inputs=[0, 1, 2])
    check_op("Range", [np.array(v, np.int32) for v in (5, -4, -2)], np.array([5, 3, 1, -1, -3], np.int32),
             {"stash_type": stash_type})


def test_range_errors():
    with pytest.raises(ShapeInferenceError, match=r"node 'range' \(Range\).*delta must not be 0"):
        build_single("Range", [np.array(0, np.int64)] * 3, const_inputs=[0, 1, 2])
    with pytest.raises(ShapeInferenceError, match="share a dtype"):
        build_single("Range", [np.array(0, np.int64), np.array(3, np.int32), np.array(1, np.int64)])
    with pytest.raises(ShapeInferenceError, match="must be a scalar"):
        build_single("Range", [np.array([0, 1], np.int64), np.array(3, np.int64), np.array(1, np.int64)])
    with pytest.raises(ShapeInferenceError, match=r"\(Range\).*stash_type 10 is not 1 \(float\) or 11 \(double\)"):
        build_single("Range", [np.array(v, np.float16) for v in (0, 3, 1)], {"stash_type": 10})
    with pytest.raises(ShapeInferenceError, match=r"\(Range\).*delta must not be 0"):
        build_single("Range", [np.array(v, np.float16) for v in (0, 3, 0)], const_inputs=[0, 1, 2])
    g, feeds = build_single("Range", [np.array(v, np.float16) for v in (0, 3, 0)])
    with pytest.raises(EvaluationError, match="delta must not be 0"):
        evaluate(g, feeds)


# --------------------------------------------------------------------------- Dropout


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_dropout_is_identity_at_inference(dtype):
    x = np.linspace(-1, 1, 12).reshape(3, 4).astype(dtype)
    check_op("Dropout", [x], x, symbolic_batch=True)
    check_op("Dropout", [x, np.array(0.5, dtype), np.array(False)], [x, np.ones((3, 4), bool)],
             const_inputs=[1, 2], num_outputs=2, symbolic_batch=True)


def test_dropout_training_mode_is_exact_only_with_ratio_0():
    """Training mode with ratio 0 drops nothing and scales by 1: the identity, the mask all true (what ONNX's
    reference and onnxruntime give). Any other ratio draws random numbers: refused, at inference when constant,
    else when the run meets it."""
    x = np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float32)
    want = [x, np.ones((3, 4), bool)]
    for const in ([1, 2], [], [1], [2]):
        check_op("Dropout", [x, np.array(0, np.float32), np.array(True)], want, const_inputs=const, num_outputs=2)
    ref = onnx_reference("Dropout", [x, np.array(0, np.float32), np.array(True)], {"seed": 0}, opset=22)
    np.testing.assert_array_equal(ref, x)
    with pytest.raises(ShapeInferenceError, match=r"node 'dropout' \(Dropout\).*training_mode=True with ratio 0.5"):
        build_single("Dropout", [x, None, np.array(True)], const_inputs=[2])
    with pytest.raises(ShapeInferenceError, match=r"\(Dropout\).*training_mode=True with ratio 0.25 is not supported"):
        build_single("Dropout", [x, np.array(0.25, np.float32), np.array(True)], const_inputs=[1, 2])
    for inputs, const in (([x, None, np.array(True)], []), ([x, np.array(0.25, np.float32), np.array(True)], [2])):
        g, feeds = build_single("Dropout", inputs, const_inputs=const)
        with pytest.raises(UnsupportedOpError, match=r"training_mode=True with ratio 0\.(5|25) at run time"):
            evaluate(g, feeds)
    # A computed training_mode that is False at run time: the identity whatever the ratio.
    g, feeds = build_single("Dropout", [x, np.array(0.25, np.float32), np.array(False)])
    np.testing.assert_array_equal(evaluate(g, feeds)[0], x)
