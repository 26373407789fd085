"""Swish (ai.onnx 24) and SwiGLU (ai.onnx 28) against ONNX's reference evaluator over alpha and the float types;
alpha cast to X's type as the function body does; extreme values, NaN and infinities; empty tensors; SwiGLU's
no-broadcast rule and its other named inference errors; the opset-18 export (16-bit types widened, one rounding)."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph, evaluate
from op_harness import build_single, check_op, inferred, onnx_reference

RNG = np.random.default_rng(28)
ALPHAS = [1.0, 0.5, 1.702, -0.25, 0.0]


def _f(*shape, dtype=np.float32, scale=3.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def swish64(v: np.ndarray, alpha: float) -> np.ndarray:
    v = v.astype(np.float64)
    return v / (1 + np.exp(-alpha * v))


# --------------------------------------------------------------------------- Swish


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swish_matches_onnx_reference(alpha, dtype):
    x = _f(3, 4, 5, dtype=dtype)
    want = onnx_reference("Swish", [x], {"alpha": alpha}, opset=24)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    check_op("Swish", [x], want, {"alpha": alpha}, rtol=tol, atol=tol, symbolic_batch=True)


def test_swish_default_alpha_is_one():
    x = _f(2, 7)
    (y,) = check_op("Swish", [x])
    np.testing.assert_allclose(y, swish64(x, 1.0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swish_half_types_round_once_with_alpha_in_the_type(dtype):
    """alpha = 0.1 is first cast to X's type (CastLike in the function body), then the math is wide."""
    dt = kiln.ir.dtype(dtype).numpy
    x = _f(4, 6).astype(dt)
    (y,) = check_op("Swish", [x], attrs={"alpha": 0.1})
    alpha_t = float(np.float32(0.1).astype(dt))
    np.testing.assert_array_equal(y, swish64(x, alpha_t).astype(dt))


def test_swish_float16_matches_onnx_reference_within_its_rounding():
    x = _f(3, 4, dtype=np.float16)
    want = onnx_reference("Swish", [x], {"alpha": 0.5}, opset=24)
    check_op("Swish", [x], want, {"alpha": 0.5}, rtol=2e-3, atol=1e-3)


def test_swish_extremes_nan_and_infinities():
    x = np.array([-1e4, -100, -0.0, 0.0, 100, 1e4, np.inf, -np.inf, np.nan], np.float32)
    with np.errstate(all="raise"):  # no overflow on the way
        (y,) = check_op("Swish", [x])
    np.testing.assert_array_equal(y[:7], np.array([-0.0, -100 / (1 + np.exp(100)), -0.0, 0, 100, 1e4, np.inf],
                                                  np.float32))  # -3.7e-42: a float32 subnormal, not flushed
    assert np.isnan(y[7]) and np.isnan(y[8])  # -inf * Sigmoid(-inf) = -inf * 0, as ONNX's


def test_swish_empty():
    (y,) = check_op("Swish", [np.zeros((0, 3), np.float32)], attrs={"alpha": 2.0})
    assert y.shape == (0, 3) and y.dtype == np.float32


def test_swish_takes_floats_only():
    with pytest.raises(KilnError, match="allowed: bfloat16, float16, float32, float64"):
        build_single("Swish", [np.zeros(3, np.int32)])


# --------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swiglu_matches_onnx_reference(alpha, dtype):
    a, b = _f(2, 3, 8, dtype=dtype), _f(2, 3, 8, dtype=dtype)
    want = onnx_reference("SwiGLU", [a, b], {"alpha": alpha}, opset=28)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    check_op("SwiGLU", [a, b], want, {"alpha": alpha}, rtol=tol, atol=tol, symbolic_batch=True)


def test_swiglu_is_swish_of_the_gate_times_the_value():
    a, b = _f(5, 6), _f(5, 6)
    (y,) = check_op("SwiGLU", [a, b], attrs={"alpha": 1.5})
    np.testing.assert_allclose(y, swish64(a, np.float32(1.5)) * b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swiglu_half_types_round_once(dtype):
    dt = kiln.ir.dtype(dtype).numpy
    a, b = _f(4, 6).astype(dt), _f(4, 6).astype(dt)
    (y,) = check_op("SwiGLU", [a, b], attrs={"alpha": 0.1})
    alpha_t = float(np.float32(0.1).astype(dt))
    np.testing.assert_array_equal(y, (swish64(a, alpha_t) * b.astype(np.float64)).astype(dt))


def test_swiglu_float16_matches_onnx_reference_within_its_rounding():
    a, b = _f(2, 4, dtype=np.float16), _f(2, 4, dtype=np.float16)
    check_op("SwiGLU", [a, b], onnx_reference("SwiGLU", [a, b], {}, opset=28), rtol=2e-3, atol=1e-3)


def test_swiglu_empty_and_scalar():
    (y,) = check_op("SwiGLU", [np.zeros((2, 0), np.float32), np.zeros((2, 0), np.float32)])
    assert y.shape == (2, 0)
    a, b = np.array(1.5, np.float32), np.array(-2.0, np.float32)
    (y,) = check_op("SwiGLU", [a, b])
    assert y.shape == () and np.isclose(y, swish64(a, 1.0) * -2.0)


def test_swiglu_inference_keeps_symbolic_dims():
    assert inferred("SwiGLU", [_f(2, 4), _f(2, 4)]) == [("batch", 4)]
    g = Graph("sym")
    y = g.op("SwiGLU", g.add_input("a", "float32", ["n", None]), g.add_input("b", "float32", [None, 16]))
    assert y.type.shape == ("n", 16)


@pytest.mark.parametrize("a_shape,b_shape,match", [
    ((2, 4), (2, 1), r"A \[2, 4\] and B \[2, 1\] must have the same shape \(SwiGLU does not broadcast\)"),
    ((2, 4), (4,), r"A \[2, 4\] and B \[4\] must have the same shape"),
    ((1, 4), (3, 4), r"must have the same shape"),
])
def test_swiglu_does_not_broadcast(a_shape, b_shape, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("SwiGLU", [np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)])


def test_swiglu_inputs_of_different_types_are_refused():
    with pytest.raises(ShapeInferenceError, match="B is float16 but A is float32; SwiGLU takes one type for both"):
        build_single("SwiGLU", [np.zeros(3, np.float32), np.zeros(3, np.float16)])


# ------------------------------------------------------------------------- ONNX export (opsets 18..22)


def _exported(g: Graph):
    onnx = pytest.importorskip("onnx")
    from kiln.serializer import onnx as kx
    proto = kx.to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def test_swish_exports_as_its_function_body():
    g = Graph("s")
    g.outputs = [g.op("Swish", g.add_input("x", "float32", [3]), alpha=0.5)]
    assert [n.op_type for n in _exported(g).graph.node] == ["Constant", "Mul", "Sigmoid", "Mul"]
    g = Graph("s1")
    g.outputs = [g.op("Swish", g.add_input("x", "float32", [3]))]
    assert [n.op_type for n in _exported(g).graph.node] == ["Sigmoid", "Mul"]  # alpha = 1: no scaling


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swiglu_export_of_half_types_computes_in_float32_and_rounds_once(dtype):
    ort = pytest.importorskip("onnxruntime")
    g = Graph("h")
    a, b = g.add_input("a", dtype, [4, 6]), g.add_input("b", dtype, [4, 6])
    g.outputs = [g.op("Cast", g.op("SwiGLU", a, b, alpha=0.1), to=1)]  # float32 out: ORT takes no bfloat16 feeds
    proto = _exported(g)
    ops = [n.op_type for n in proto.graph.node]
    assert ops[:2] == ["Cast", "Cast"] and ops.count("Cast") == 4
    if dtype == "float16":
        feeds = [_f(4, 6, dtype=np.float16), _f(4, 6, dtype=np.float16)]
        got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"a": feeds[0], "b": feeds[1]})[0]
        np.testing.assert_array_equal(got, evaluate(g, feeds)[0])
