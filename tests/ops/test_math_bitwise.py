"""The ONNX ops added for the node suite's coverage (issue 22): inverse/hyperbolic trigonometry, Round, Celu,
ThresholdedRelu, Shrink, Hardmax, the Bitwise ops, BitShift-28, and ReduceL1/SumSquare/LogSum/LogSumExp; each
against numpy written independently, ONNX's reference evaluator where it helps, and named inference errors."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError, VerifyError
from op_harness import build_single, check_op

RNG = np.random.default_rng(22)


@pytest.mark.parametrize("op,fn,lo,hi", [
    ("Tan", np.tan, -1.2, 1.2), ("Acos", np.arccos, -1, 1), ("Asin", np.arcsin, -1, 1), ("Atan", np.arctan, -9, 9),
    ("Sinh", np.sinh, -4, 4), ("Cosh", np.cosh, -4, 4), ("Asinh", np.arcsinh, -9, 9), ("Acosh", np.arccosh, 1, 9),
    ("Atanh", np.arctanh, -0.99, 0.99)])
def test_trigonometry(op, fn, lo, hi):
    x = RNG.uniform(lo, hi, (3, 5)).astype(np.float32)
    check_op(op, [x], fn(x.astype(np.float64)).astype(np.float32), symbolic_batch=True)
    (half,) = check_op(op, [x.astype(np.float16)])
    assert half.dtype == np.float16


def test_out_of_domain_is_nan_without_a_warning():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (y,) = check_op("Acos", [np.array([2.0, -1.0], np.float32)])
    assert np.isnan(y[0]) and y[1] == np.float32(np.pi)


def test_round_halves_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4, -2.6], np.float32)
    check_op("Round", [x], np.array([0, 2, 2, -0, -2, 2, -3], np.float32))


def test_celu_thresholded_relu_shrink():
    x = np.array([-3.0, -0.4, 0.0, 0.3, 1.0, 2.5], np.float32)
    check_op("Celu", [x], np.where(x > 0, x, 2.0 * (np.exp(x / 2.0) - 1)).astype(np.float32), {"alpha": 2.0})
    check_op("ThresholdedRelu", [x], np.array([0, 0, 0, 0, 0, 2.5], np.float32), {"alpha": 1.0})
    check_op("Shrink", [x], np.array([-2.5, 0, 0, 0, 0.5, 2.0], np.float32), {"lambd": 0.5, "bias": 0.5})
    check_op("Shrink", [np.array([-3, 0, 3], np.int32)], np.array([-2, 0, 2], np.int32), {"lambd": 1.5, "bias": 1.0})


def test_hardmax_marks_the_first_maximum():
    x = np.array([[1, 3, 3, 0], [5, 5, 5, 5], [-1, -2, -3, -4]], np.float32)
    check_op("Hardmax", [x], np.array([[0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32))
    check_op("Hardmax", [x], np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32), {"axis": 0})
    with pytest.raises(ShapeInferenceError, match="axis"):
        build_single("Hardmax", [x], {"axis": 2})


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_bitwise(dtype):
    info = np.iinfo(dtype)
    a = RNG.integers(info.min, info.max, (4, 3), dtype=dtype, endpoint=True)
    b = RNG.integers(info.min, info.max, (3,), dtype=dtype, endpoint=True)
    check_op("BitwiseAnd", [a, b], a & b)
    check_op("BitwiseOr", [a, b], a | b)
    check_op("BitwiseXor", [a, b], a ^ b)
    check_op("BitwiseNot", [a], ~a)
    with pytest.raises(VerifyError, match="allowed: int16, int32, int64, int8, uint16, uint32, uint64, uint8"):
        build_single("BitwiseAnd", [a.astype(np.float32), b.astype(np.float32)])


def test_bitshift_follows_bitshift_28():
    x = np.array([1, -8, 64, -1, 5, 5], np.int8)
    y = np.array([1, 1, 2, 7, 8, -1], np.int8)
    check_op("BitShift", [x, y], np.array([0, -4, 16, -1, 0, 0], np.int8), {"direction": "RIGHT"})
    check_op("BitShift", [x, y], np.array([2, -16, 0, -128, 0, 0], np.int8), {"direction": "LEFT"})
    u = np.array([1, 4, 255], np.uint8)
    check_op("BitShift", [u, np.array([1, 1, 9], np.uint8)], np.array([2, 8, 0], np.uint8), {"direction": "LEFT"})
    neg = np.array([-5], np.int8)
    check_op("BitShift", [neg, np.array([9], np.int8)], np.array([-1], np.int8), {"direction": "RIGHT"})
    with pytest.raises(ShapeInferenceError, match="direction"):
        build_single("BitShift", [x, y], {"direction": "UP"})
    ref = pytest.importorskip("onnx.reference.ops.op_bitshift")
    a = RNG.integers(-2**31, 2**31 - 1, 64).astype(np.int32)
    s = RNG.integers(-3, 40, 64).astype(np.int32)
    for direction in ("LEFT", "RIGHT"):
        want = ref.BitShift._run(type("N", (), {"direction": direction})(), a, s)[0]
        check_op("BitShift", [a, s], want, {"direction": direction})


@pytest.mark.parametrize("op,fn", [
    ("ReduceL1", lambda m: np.abs(m) @ np.ones(m.shape[-1])),
    ("ReduceSumSquare", lambda m: (m * m) @ np.ones(m.shape[-1])),
    ("ReduceLogSum", lambda m: np.log(m @ np.ones(m.shape[-1]))),
    ("ReduceLogSumExp", lambda m: np.log(np.exp(m) @ np.ones(m.shape[-1])))])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_more_reductions(op, fn, keepdims):
    x = RNG.uniform(0.1, 2.0, (2, 3, 4)).astype(np.float32)
    want = fn(x.astype(np.float64))
    if keepdims:
        want = want[..., None]
    check_op(op, [x, np.array([-1], np.int64)], want.astype(np.float32), {"keepdims": keepdims}, const_inputs=[1])


def test_log_sum_exp_does_not_overflow():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf]], np.float32)
    (y,) = check_op("ReduceLogSumExp", [x, np.array([1], np.int64)], np.array([[1000 + np.log(2)], [-np.inf]],
                                                                                 np.float32), const_inputs=[1])
    assert np.isfinite(y[0, 0])
