"""Activation ops against torch.nn.functional (computed in float64) and hand-computed values."""
from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph

torch = pytest.importorskip("torch")
F = torch.nn.functional

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float64): (1e-12, 1e-12), np.dtype(np.float32): (1e-5, 1e-6),
       np.dtype(np.float16): (1e-3, 1e-3), BF16: (8e-3, 8e-3)}
FLOATS = [np.float32, np.float16, np.float64]
SHAPES = [(), (9,), (2, 3, 4)]


def rand(rng: np.random.Generator, shape, dtype, lo: float = -4.0, hi: float = 4.0) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def torch64(fn, *arrays: np.ndarray) -> np.ndarray:
    return fn(*(torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in arrays)).numpy()


def check_float(op: str, inputs, expected, dtype, attrs=None, **kw) -> list:
    """check_op with the dtype's tolerance; bfloat16 (which check_op compares exactly) compared here."""
    rtol, atol = TOL[np.dtype(dtype)]
    if np.dtype(dtype) != BF16:
        return check_op(op, inputs, expected, attrs, rtol=rtol, atol=atol, **kw)
    outs = check_op(op, inputs, None, attrs, **kw)
    np.testing.assert_allclose(outs[0].astype(np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol)
    return outs


# op -> (attrs, torch oracle taking a float64 tensor)
CASES = {
    "Relu": ({}, F.relu),
    "LeakyRelu": ({}, lambda t: F.leaky_relu(t, 0.01)),
    "LeakyRelu/alpha": ({"alpha": 0.3}, lambda t: F.leaky_relu(t, 0.3)),
    "Elu": ({}, F.elu),
    "Elu/alpha": ({"alpha": 0.5}, lambda t: F.elu(t, 0.5)),
    "Gelu": ({}, F.gelu),
    "Gelu/tanh": ({"approximate": "tanh"}, lambda t: F.gelu(t, approximate="tanh")),
    "HardSigmoid": ({}, lambda t: torch.clamp(0.2 * t + 0.5, 0, 1)),
    "HardSigmoid/torch": ({"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid),
    "HardSwish": ({}, F.hardswish),
    "Softplus": ({}, F.softplus),
    "Softsign": ({}, F.softsign),
    "Selu": ({}, F.selu),
    "Mish": ({}, F.mish),
}


def _op(case: str) -> str:
    return case.split("/")[0]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_activation_matches_torch(rng, case, dtype, shape):
    attrs, fn = CASES[case]
    x = rand(rng, shape, dtype)
    # Selu's ONNX constants are float32 roundings of torch's, a 1e-8 relative difference.
    rtol = 1e-7 if case == "Selu" and dtype == np.float64 else None
    if rtol is None:
        check_float(_op(case), [x], torch64(fn, x), dtype, attrs)
    else:
        check_op(_op(case), [x], torch64(fn, x), attrs, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("case", sorted(CASES))
def test_activation_symbolic_batch_bfloat16(rng, case):
    attrs, fn = CASES[case]
    x = rand(rng, (3, 7), BF16)
    check_float(_op(case), [x], torch64(fn, x.astype(np.float64)), BF16, attrs, symbolic_batch=True)


def test_relu_bfloat16_matches_torch(rng):
    x = rand(rng, (5, 6), BF16)
    expected = F.relu(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)).float().numpy()
    (out,) = check_op("Relu", [x])
    assert out.dtype == BF16
    np.testing.assert_array_equal(out.astype(np.float32), expected)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_relu_int(rng, dtype):
    x = rng.integers(-50, 50, size=(4, 5)).astype(dtype)
    check_op("Relu", [x], F.relu(torch.from_numpy(x)).numpy(), symbolic_batch=True)


def test_hand_computed_values():
    x = np.array([-2.0, 0.0, 1.0], np.float64)
    check_op("HardSwish", [x], np.array([-2 * (1 / 6 * -2 + 0.5), 0.0, 1 * (1 / 6 + 0.5)]))
    check_op("Gelu", [x], np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()]))
    check_op("Softsign", [x], np.array([-2 / 3, 0.0, 0.5]))
    check_op("Elu", [x], np.array([math.expm1(-2) * 0.5, 0.0, 1.0]), {"alpha": 0.5})


@pytest.mark.parametrize("op", ["Softplus", "Elu", "Selu", "Mish", "Gelu", "HardSwish"])
def test_large_inputs_stay_finite(op):
    x = np.array([-1e4, -100.0, 100.0, 1e4], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out,) = check_op(op, [x])
    assert np.all(np.isfinite(out))
    fn = dict(CASES)[op][1]
    np.testing.assert_allclose(out, torch64(fn, x), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- PRelu


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("x_shape, slope_shape", [((2, 3, 4, 4), (3, 1, 1)), ((2, 5), (5,)), ((2, 5), ()),
                                                  ((3, 4), (3, 4)), ((2, 3), (1,))], ids=str)
def test_prelu_matches_torch(rng, dtype, x_shape, slope_shape):
    x = rand(rng, x_shape, dtype)
    slope = rand(rng, slope_shape, dtype, 0.0, 0.5)
    expected = torch.where(torch.from_numpy(x.astype(np.float64)) < 0,
                           torch.from_numpy(x.astype(np.float64)) * torch.from_numpy(slope.astype(np.float64)),
                           torch.from_numpy(x.astype(np.float64))).numpy()
    check_float("PRelu", [x, slope], expected, dtype, symbolic_batch=True)


def test_prelu_torch_channel_semantics(rng):
    # torch's PReLU slope is per channel (dim 1); in ONNX it is shaped [C, 1, 1] to broadcast.
    x = rand(rng, (2, 3, 5), np.float32)
    weight = rand(rng, (3,), np.float32, 0.0, 1.0)
    expected = F.prelu(torch.from_numpy(x), torch.from_numpy(weight)).numpy()
    check_op("PRelu", [x, weight.reshape(3, 1)], expected)


def test_prelu_int():
    x = np.array([[-4, 0, 3], [5, -6, -1]], np.int32)
    slope = np.array([2, 3, -1], np.int32)
    check_op("PRelu", [x, slope], np.array([[-8, 0, 3], [5, -18, 1]], np.int32))


def test_prelu_symbolic_x_takes_slope_dim():
    g, _ = build_single("PRelu", [np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)], symbolic_batch=True)
    # slope's own leading dim is "batch" too (same rank and size); the output keeps it.
    assert g.outputs[0].type.shape == ("batch", 3)
    # A symbolic dim of X meeting a slope dim > 1 must equal it.
    g = Graph("prelu")
    y = g.op("PRelu", g.add_input("x", "float32", ["n", 1]), g.add_input("s", "float32", [4, 1]))
    assert y.type.shape == (4, 1)


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("x_shape, slope_shape", [((2, 3), (4,)), ((3,), (2, 3)), ((1, 3), (2, 3))], ids=str)
def test_prelu_slope_must_broadcast_to_x(x_shape, slope_shape):
    with pytest.raises(ShapeInferenceError, match=r"\(PRelu\).*slope"):
        build_single("PRelu", [np.zeros(x_shape, np.float32), np.zeros(slope_shape, np.float32)])


def test_prelu_dtype_mismatch_fails():
    with pytest.raises(ShapeInferenceError, match=r"\(PRelu\).*slope is float64"):
        build_single("PRelu", [np.zeros(3, np.float32), np.zeros(3, np.float64)])


def test_gelu_bad_approximate_fails():
    with pytest.raises(ShapeInferenceError, match=r"\(Gelu\).*approximate"):
        build_single("Gelu", [np.zeros(3, np.float32)], {"approximate": "erf"})


def test_unknown_attribute_rejected():
    with pytest.raises(KilnError, match="beta"):
        build_single("LeakyRelu", [np.zeros(3, np.float32)], {"beta": 1.0})
