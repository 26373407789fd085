"""Comparison, boolean, Where, Cast and IsNaN/IsInf ops against torch and Python-level oracles."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import KilnError, ShapeInferenceError, VerifyError
from kiln.ir import DType

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [((2, 3), (2, 3)), ((2, 3), (3,)), ((4, 1, 5), (3, 1)), ((), (2, 2))]

COMPARE = {"Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt,
           "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge}
LOGIC = {"And": lambda p, q: p and q, "Or": lambda p, q: p or q, "Xor": lambda p, q: p != q}


def small_values(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Few distinct values, so equal pairs actually occur."""
    return rng.integers(-2, 3, size=shape).astype(dtype) if np.dtype(dtype) != np.uint8 else \
        rng.integers(0, 3, size=shape).astype(dtype)


def as_torch(a: np.ndarray):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


# --------------------------------------------------------------------------- comparisons


@pytest.mark.parametrize("op", sorted(COMPARE))
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_compare(rng, op, dtype, shapes):
    a = small_values(rng, shapes[0], dtype)
    b = small_values(rng, shapes[1], dtype)
    (out,) = check_op(op, [a, b], COMPARE[op](as_torch(a), as_torch(b)).numpy())
    assert out.dtype == np.bool_


@pytest.mark.parametrize("op", sorted(COMPARE))
def test_compare_symbolic_bfloat16_and_nan(rng, op):
    a = small_values(rng, (3, 4), BF16)
    b = small_values(rng, (4,), BF16)
    check_op(op, [a, b], COMPARE[op](as_torch(a), as_torch(b)).numpy(), symbolic_batch=True)
    nan = np.array([np.nan, 1.0], np.float32)
    # Every comparison with NaN is false.
    check_op(op, [nan, np.array([np.nan, np.nan], np.float32)], np.array([False, False]))


def test_equal_bool():
    a = np.array([[True, False], [False, True]])
    check_op("Equal", [a, np.array([True, True])], np.array([[True, False], [False, True]]))


@pytest.mark.parametrize("op", ["Equal", "Less", "GreaterOrEqual", "And"])
def test_compare_failures(op):
    dtype = np.bool_ if op == "And" else np.float32
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*(broadcast|dims)"):
        build_single(op, [np.zeros((2, 3), dtype), np.zeros((4,), dtype)])
    other = np.int32 if op != "And" else np.float32
    with pytest.raises((ShapeInferenceError, VerifyError), match=rf"\({op}\)"):
        build_single(op, [np.zeros(3, dtype), np.zeros(3, other)])


# --------------------------------------------------------------------------- boolean logic


@pytest.mark.parametrize("op", sorted(LOGIC))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_logic(rng, op, shapes):
    a = rng.random(shapes[0]) < 0.5
    b = rng.random(shapes[1]) < 0.5
    pa, pb = np.broadcast_arrays(a, b)
    expected = np.array([LOGIC[op](p, q) for p, q in zip(pa.ravel().tolist(), pb.ravel().tolist())],
                        np.bool_).reshape(pa.shape)
    check_op(op, [a, b], expected, symbolic_batch=True)


def test_not(rng):
    x = rng.random((3, 4)) < 0.5
    check_op("Not", [x], torch.logical_not(torch.from_numpy(x)).numpy(), symbolic_batch=True)


def test_logic_rejects_non_bool():
    with pytest.raises(VerifyError, match=r"\(Not\).*allowed: bool"):
        build_single("Not", [np.zeros(3, np.float32)])


# --------------------------------------------------------------------------- Where


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_, BF16])
@pytest.mark.parametrize("shapes", [((2, 3), (2, 3), (2, 3)), ((3,), (2, 1), ()), ((2, 1, 4), (3, 1), (4,))],
                         ids=str)
def test_where(rng, dtype, shapes):
    cond = rng.random(shapes[0]) < 0.5
    x = (rng.random(shapes[1]) * 10).astype(dtype)
    y = (rng.random(shapes[2]) * -10).astype(dtype)
    expected = torch.where(torch.from_numpy(cond), as_torch(x), as_torch(y)).numpy()
    (out,) = check_op("Where", [cond, x, y])
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float64), expected)


def test_where_symbolic_batch(rng):
    cond = rng.random((3, 4)) < 0.5
    x = rng.random((3, 4)).astype(np.float32)
    g, _ = build_single("Where", [cond, x, np.float32(0)], symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 4)
    check_op("Where", [cond, x, np.float32(0)], np.where(cond, x, 0).astype(np.float32), symbolic_batch=True)


def test_where_failures():
    cond = np.zeros((2, 3), np.bool_)
    with pytest.raises(ShapeInferenceError, match=r"\(Where\).*different dtypes"):
        build_single("Where", [cond, np.zeros(3, np.float32), np.zeros(3, np.int32)])
    with pytest.raises(ShapeInferenceError, match=r"\(Where\).*condition must be bool"):
        build_single("Where", [np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(ShapeInferenceError, match=r"\(Where\).*(broadcast|dims)"):
        build_single("Where", [cond, np.zeros((4,), np.float32), np.zeros(3, np.float32)])


# --------------------------------------------------------------------------- Cast

TORCH_DTYPE = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.FLOAT64: torch.float64,
               DType.BFLOAT16: torch.bfloat16, DType.INT8: torch.int8, DType.INT16: torch.int16,
               DType.INT32: torch.int32, DType.INT64: torch.int64, DType.UINT8: torch.uint8,
               DType.BOOL: torch.bool}


def _cast_source(rng: np.random.Generator, src: DType) -> np.ndarray:
    """Values every target can hold (0..100, fractions for floats, with zeros for bool)."""
    vals = rng.uniform(-0.5, 100.0, size=(3, 4))
    vals[0, :2] = 0
    if src is DType.BOOL:
        return vals > 50
    if src.is_int:
        return np.round(vals).astype(src.numpy)
    return vals.astype(src.numpy)


def _torch_of(a: np.ndarray):
    # torch.from_numpy does not know ml_dtypes' bfloat16: go through float32, which holds it exactly.
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a)


# The types torch computes with (its uint16/32/64 are storage-only; the storage types' casts are checked against
# ONNX's reference in test_storage_dtypes.py and test_uint_dtypes.py).
@pytest.mark.parametrize("src", list(TORCH_DTYPE), ids=str)
@pytest.mark.parametrize("dst", list(TORCH_DTYPE), ids=str)
def test_cast_matches_torch(rng, src, dst):
    x = _cast_source(rng, src)
    expected = _torch_of(x).to(TORCH_DTYPE[dst])
    (out,) = check_op("Cast", [x], None, {"to": dst.value}, symbolic_batch=True)
    assert out.dtype == dst.numpy
    if dst is DType.BFLOAT16:
        np.testing.assert_array_equal(out.astype(np.float32), expected.float().numpy())
    else:
        np.testing.assert_array_equal(out, expected.numpy())


@pytest.mark.parametrize("dst", [DType.INT32, DType.FLOAT16, DType.BOOL, DType.FLOAT64])
def test_cast_like_takes_the_dtype_of_its_second_input(rng, dst):
    x = np.array([-2.7, -0.5, 0.0, 0.5, 2.7], np.float32)
    like = np.zeros((3, 1), dst.numpy)
    (out,) = check_op("CastLike", [x, like], x.astype(dst.numpy), {})
    assert out.dtype == dst.numpy and out.shape == x.shape


def test_cast_semantics():
    x = np.array([-2.7, -0.5, 0.0, 0.5, 2.7, np.nan], np.float32)
    # Float to int truncates toward zero; NaN is nonzero, so it casts to True.
    check_op("Cast", [x[:5]], np.array([-2, 0, 0, 0, 2], np.int32), {"to": DType.INT32.value})
    check_op("Cast", [x], np.array([True, True, False, True, True, True]), {"to": DType.BOOL.value})
    # float32 -> float16 rounds to nearest; out of range gives inf.
    big = np.array([1e5, -1e5, 1.0 + 2 ** -12], np.float32)
    check_op("Cast", [big], np.array([np.inf, -np.inf, 1.0], np.float16), {"to": DType.FLOAT16.value})


def test_cast_keeps_integer_precision():
    big = np.array([2 ** 53 + 1, -(2 ** 62) - 3, 2 ** 32 + 5], np.int64)
    check_op("Cast", [big], big, {"to": DType.INT64.value})
    # Narrowing integer casts keep the low bits, like C and torch.
    check_op("Cast", [big[2:]], np.array([5], np.int32), {"to": DType.INT32.value})


def test_cast_saturate_is_accepted_and_ignored():
    x = np.array([1e5, 1.5], np.float32)
    check_op("Cast", [x], np.array([np.inf, 1.5], np.float16), {"to": DType.FLOAT16.value, "saturate": 0})


def test_cast_failures():
    x = np.zeros(3, np.float32)
    with pytest.raises(ShapeInferenceError, match=r"\(Cast\).*to=8 is not a dtype kiln supports"):
        build_single("Cast", [x], {"to": 8})
    with pytest.raises(KilnError, match="to"):
        build_single("Cast", [x])


# --------------------------------------------------------------------------- IsNaN / IsInf


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, BF16])
def test_isnan_isinf(dtype):
    x = np.array([[np.nan, np.inf, -np.inf], [0.0, -1.5, 3e4]], np.float64).astype(dtype)
    t = as_torch(x)
    check_op("IsNaN", [x], torch.isnan(t).numpy(), symbolic_batch=True)
    check_op("IsInf", [x], torch.isinf(t).numpy(), symbolic_batch=True)
    check_op("IsInf", [x], torch.isneginf(t).numpy(), {"detect_positive": 0})
    check_op("IsInf", [x], torch.isposinf(t).numpy(), {"detect_negative": 0})
    check_op("IsInf", [x], np.zeros(x.shape, np.bool_), {"detect_negative": 0, "detect_positive": 0})


def test_isnan_rejects_int():
    with pytest.raises(VerifyError, match=r"\(IsNaN\).*allowed"):
        build_single("IsNaN", [np.zeros(3, np.int32)])
