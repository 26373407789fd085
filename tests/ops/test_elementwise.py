"""Elementwise arithmetic/math ops against torch (float math) and integer arithmetic done another way."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError, VerifyError

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)
# (rtol, atol) for comparing a result rounded to the dtype with the exact float64 value.
TOL = {np.dtype(np.float64): (1e-12, 1e-12), np.dtype(np.float32): (1e-5, 1e-6),
       np.dtype(np.float16): (1e-3, 1e-3), BF16: (8e-3, 8e-3)}
FLOATS = [np.float32, np.float16, np.float64]
BINARY_SHAPES = [((2, 3), (2, 3)), ((2, 3), (3,)), ((4, 1, 5), (3, 1)), ((), (2, 2)), ((3, 0), (1, 0))]


def rand(rng: np.random.Generator, shape, dtype, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def rand_int(rng: np.random.Generator, shape, dtype, lo: int = -20, hi: int = 20) -> np.ndarray:
    return rng.integers(lo, hi, size=shape).astype(dtype)


def torch64(fn, *arrays: np.ndarray) -> np.ndarray:
    """The torch result computed on float64 copies: an exact-ish oracle for any float dtype."""
    return fn(*(torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in arrays)).numpy()


def check_float(op: str, inputs, expected, dtype, **kw) -> list:
    """check_op with the dtype's tolerance; bfloat16 (which check_op compares exactly) compared here."""
    rtol, atol = TOL[np.dtype(dtype)]
    if np.dtype(dtype) != BF16:
        return check_op(op, inputs, expected, rtol=rtol, atol=atol, **kw)
    outs = check_op(op, inputs, **kw)
    np.testing.assert_allclose(outs[0].astype(np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol)
    return outs


# --------------------------------------------------------------------------- binary arithmetic

BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
def test_binary_float(rng, op, dtype, shapes):
    a = rand(rng, shapes[0], dtype)
    b = rand(rng, shapes[1], dtype, 0.5, 3.0) * np.where(rng.random(shapes[1]) < 0.5, -1, 1).astype(dtype)
    check_float(op, [a, b], torch64(BINARY[op], a, b), dtype)


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8])
def test_binary_int(rng, op, dtype):
    lo = 0 if dtype == np.uint8 else -9
    a = rand_int(rng, (3, 4), dtype, lo, 10)
    b = rand_int(rng, (4,), dtype, 1, 10)
    fn = {"Div": lambda x, y: torch.div(x, y, rounding_mode="trunc")}.get(op, BINARY[op])
    expected = fn(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    check_op(op, [a, b], expected)


def test_add_bfloat16_matches_torch(rng):
    a = rand(rng, (4, 5), BF16)
    b = rand(rng, (5,), BF16)
    ta = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    tb = torch.from_numpy(b.astype(np.float32)).to(torch.bfloat16)
    check_float("Add", [a, b], (ta + tb).float().numpy(), BF16)


def test_add_symbolic_batch(rng):
    a = rand(rng, (2, 3), np.float32)
    b = rand(rng, (3,), np.float32)
    check_op("Add", [a, b], torch64(torch.add, a, b), symbolic_batch=True)
    g, _ = build_single("Mul", [a, a], symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 3)


def test_div_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6, -6, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3, -3, 5], np.int32)
    check_op("Div", [a, b], np.array([3, -3, -3, 3, 2, 2, 0], np.int32))


@given(st.lists(st.tuples(st.integers(-2**31, 2**31 - 1), st.integers(-2**31, 2**31 - 1).filter(bool)),
                min_size=1, max_size=20))
def test_div_int_is_c_division(pairs):
    a = np.array([p[0] for p in pairs], np.int64)
    b = np.array([p[1] for p in pairs], np.int64)
    (q,) = check_op("Div", [a, b])
    for x, y, got in zip(a.tolist(), b.tolist(), q.tolist()):
        r = x - got * y
        # C division: a == q*b + r, |r| < |b|, and r has the sign of a (or is 0).
        assert abs(r) < abs(y) and (r == 0 or (r < 0) == (x < 0)), (x, y, got)


def test_mod_follows_the_divisor_or_the_dividend(rng):
    a = np.array([7, -7, 7, -7, 6, 0], np.int32)
    b = np.array([3, 3, -3, -3, 4, 5], np.int32)
    check_op("Mod", [a, b], np.array([1, 2, -2, -1, 2, 0], np.int32))                  # Python's %
    check_op("Mod", [a, b], np.array([1, -1, 1, -1, 2, 0], np.int32), {"fmod": 1})     # C's fmod
    x = rand(rng, (2, 3), np.float32) * 10
    y = np.array([3.0, -2.5, 1.5], np.float32)
    check_op("Mod", [x, y], torch64(torch.fmod, x, y), {"fmod": 1}, symbolic_batch=True)
    # Mod-28 (what kiln implements): floats with fmod=0 follow the divisor, as Python's % does.
    check_op("Mod", [x, y], torch64(torch.remainder, x, y), symbolic_batch=True)
    edge_a = np.array([5.0, -5.0, 5.0, np.inf, 1.0, -0.0, 7.5], np.float64)
    edge_b = np.array([np.inf, np.inf, 0.0, 2.0, np.nan, 3.0, -2.0], np.float64)
    want = np.array([5.0 % np.inf, -5.0 % np.inf, np.nan, np.nan, np.nan, 0.0, 7.5 % -2.0])
    check_op("Mod", [edge_a, edge_b], want)


def test_float_div_by_zero_is_ieee():
    a = np.array([1.0, -1.0, 0.0], np.float32)
    b = np.zeros(3, np.float32)
    (out,) = check_op("Div", [a, b])
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


# --------------------------------------------------------------------------- Pow


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", BINARY_SHAPES[:4], ids=str)
def test_pow_float(rng, dtype, shapes):
    x = rand(rng, shapes[0], dtype, 0.1, 3.0)
    y = rand(rng, shapes[1], dtype, -2.0, 2.0)
    check_float("Pow", [x, y], torch64(torch.pow, x, y), dtype)


@pytest.mark.parametrize("exp_dtype", [np.int64, np.int8, np.float64, np.float16])
def test_pow_output_has_base_dtype(rng, exp_dtype):
    x = rand(rng, (2, 3), np.float32, -2.0, 2.0)
    y = np.array([2, 3, 0], exp_dtype)
    (out,) = check_op("Pow", [x, y], torch64(torch.pow, x, y), rtol=1e-5, atol=1e-6)
    assert out.dtype == np.float32


def test_pow_int_base():
    x = np.array([[2, -3, 5], [0, 7, -1]], np.int64)
    y = np.array([3, 2, 0], np.int32)
    expected = np.array([[a ** b for a, b in zip(row, y.tolist())] for row in x.tolist()], np.int64)
    check_op("Pow", [x, y], expected)
    # A fractional or negative exponent of an integer base: pow() truncated toward zero.
    check_op("Pow", [np.array([4, 10, 2, -1], np.int32), np.array([0.5, 0.5, -1, -1], np.float32)],
             np.array([2, 3, 0, -1], np.int32))
    check_op("Pow", [np.array([2, 1, -1, -1, 3], np.int64), np.array([-1, -3, -3, -2, 0], np.int64)],
             np.array([0, 1, -1, 1, 1], np.int64))


def test_pow_symbolic_batch(rng):
    x = rand(rng, (3, 4), np.float32, 0.5, 2.0)
    check_op("Pow", [x, np.float32(2.0) * np.ones(4, np.float32)], x.astype(np.float64) ** 2, symbolic_batch=True)


# --------------------------------------------------------------------------- unary

# op -> (torch function, input range)
UNARY_FLOAT = {
    "Exp": (torch.exp, -5, 5), "Log": (torch.log, 0.05, 10), "Sqrt": (torch.sqrt, 0, 10),
    "Reciprocal": (torch.reciprocal, 0.2, 5), "Erf": (torch.erf, -3, 3), "Tanh": (torch.tanh, -4, 4),
    "Sigmoid": (torch.sigmoid, -8, 8), "Sin": (torch.sin, -6, 6), "Cos": (torch.cos, -6, 6),
    "Floor": (torch.floor, -5, 5), "Ceil": (torch.ceil, -5, 5), "Neg": (torch.neg, -5, 5),
    "Abs": (torch.abs, -5, 5), "Sign": (torch.sign, -5, 5),
}


@pytest.mark.parametrize("op", sorted(UNARY_FLOAT))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4)], ids=str)
def test_unary_float(rng, op, dtype, shape):
    fn, lo, hi = UNARY_FLOAT[op]
    x = rand(rng, shape, dtype, lo, hi)
    check_float(op, [x], torch64(fn, x), dtype)


@pytest.mark.parametrize("op", sorted(UNARY_FLOAT))
def test_unary_symbolic_batch_and_bfloat16(rng, op):
    fn, lo, hi = UNARY_FLOAT[op]
    x = rand(rng, (3, 5), BF16, lo, hi)
    # The oracle sees the bfloat16 values exactly, so only the final rounding differs.
    check_float(op, [x], torch64(fn, x.astype(np.float64)), BF16, symbolic_batch=True)


@pytest.mark.parametrize("op", ["Neg", "Abs", "Sign"])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_unary_int(rng, op, dtype):
    x = rand_int(rng, (4, 5), dtype)
    fn = UNARY_FLOAT[op][0]
    check_op(op, [x], fn(torch.from_numpy(x)).numpy())


def test_sigmoid_stable_for_large_inputs():
    x = np.array([-1e4, -800.0, -50.0, 0.0, 50.0, 800.0, 1e4], np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (np.float64, np.float32, np.float16):
            xs = x.astype(dtype)
            (out,) = check_float("Sigmoid", [xs], torch64(torch.sigmoid, xs), dtype)
            assert np.all(np.isfinite(out)) and out[0] == 0 and out[-1] == 1


def test_erf_int_inputs_truncate():
    check_op("Erf", [np.array([-3, 0, 3], np.int32)], np.zeros(3, np.int32))


def test_log_of_zero_is_minus_inf():
    (out,) = check_op("Log", [np.array([0.0, 1.0], np.float32)])
    assert out[0] == -np.inf and out[1] == 0


# --------------------------------------------------------------------------- variadic


def _torch_fold(fn, arrays):
    out = torch.from_numpy(np.asarray(arrays[0], np.float64))
    for a in arrays[1:]:
        out = fn(out, torch.from_numpy(np.asarray(a, np.float64)))
    return out.numpy()


VARIADIC = {"Max": torch.maximum, "Min": torch.minimum, "Sum": torch.add}


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_variadic_float(rng, op, dtype):
    xs = [rand(rng, (2, 1, 4), dtype), rand(rng, (3, 1), dtype), rand(rng, (4,), dtype)]
    if op == "Mean":
        expected = torch.stack(list(torch.broadcast_tensors(
            *(torch.from_numpy(x.astype(np.float64)) for x in xs)))).mean(0).numpy()
    else:
        expected = _torch_fold(VARIADIC[op], xs)
    check_float(op, xs, expected, dtype)


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic_single_input_and_symbolic(rng, op):
    x = rand(rng, (3, 4), np.float32)
    check_op(op, [x], x, symbolic_batch=True)
    y = rand(rng, (3, 4), np.float32)
    g, _ = build_single(op, [x, y, x], symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 4)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_int_and_nan(rng, op):
    xs = [rand_int(rng, (3, 4), np.int32), rand_int(rng, (4,), np.int32)]
    fold = max if op == "Max" else min
    expected = np.array([[fold(v, w) for v, w in zip(row, xs[1].tolist())] for row in xs[0].tolist()], np.int32)
    check_op(op, xs, expected)
    (out,) = check_op(op, [np.array([np.nan, 1.0], np.float32), np.array([0.0, np.nan], np.float32)])
    assert np.isnan(out).all()


# --------------------------------------------------------------------------- Clip


@pytest.mark.parametrize("dtype", FLOATS + [np.int32, np.int8])
def test_clip(rng, dtype):
    x = (rand(rng, (3, 5), np.float64) * 4).astype(dtype)
    lo = np.array(-2, dtype)
    hi = np.array(3, dtype)
    t = torch.from_numpy(x.astype(np.float64))
    check_op("Clip", [x, lo, hi], torch.clamp(t, -2, 3).numpy().astype(dtype), symbolic_batch=True)
    check_op("Clip", [x, None, hi], torch.clamp(t, max=3).numpy().astype(dtype))
    check_op("Clip", [x, lo], torch.clamp(t, min=-2).numpy().astype(dtype))
    check_op("Clip", [x], x)


def test_clip_min_above_max_gives_max_and_accepts_one_element_bounds():
    x = np.array([-5.0, 0.0, 5.0], np.float32)
    check_op("Clip", [x, np.array([2.0], np.float32), np.array([1.0], np.float32)], np.ones(3, np.float32),
             const_inputs=[1, 2])


# --------------------------------------------------------------------------- inference failures


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Sum"])
def test_incompatible_shapes_fail(op):
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*(broadcast|dims)"):
        build_single(op, [np.zeros((2, 3), np.float32), np.zeros((4,), np.float32)])


@pytest.mark.parametrize("op", ["Add", "Div", "Min", "Mean"])
def test_mixed_dtypes_fail(op):
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*different dtypes"):
        build_single(op, [np.zeros(3, np.float32), np.zeros(3, np.float64)])


def test_clip_bad_bounds_fail():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ShapeInferenceError, match=r"\(Clip\).*min must be a scalar"):
        build_single("Clip", [x, np.zeros(3, np.float32)])
    with pytest.raises(ShapeInferenceError, match=r"\(Clip\).*max is float64"):
        build_single("Clip", [x, None, np.zeros((), np.float64)])


@pytest.mark.parametrize("op, x", [("Floor", np.zeros(3, np.int32)), ("Neg", np.zeros(3, np.uint8)),
                                   ("Exp", np.zeros(3, np.bool_))])
def test_disallowed_dtypes_fail_verification(op, x):
    with pytest.raises(VerifyError, match=rf"\({op}\).*allowed"):
        build_single(op, [x])
