"""Elementwise arithmetic and math ops (ONNX opset-18 semantics, numpy broadcasting).

Transcendental float math is evaluated in float64 and rounded once to the op's dtype
(:func:`float_map`): the reference is then as exact as the dtype allows, and float16 and
bfloat16 need no ufunc support of their own. Exact ops (+, -, *, /, comparisons, floor...)
use numpy directly, which already rounds correctly in every dtype.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from kiln.ir.dtypes import DType, dtype as as_dtype
from kiln.ir.ops._common import FLOAT, NUMERIC, SIGNED_NUMERIC, infer_broadcast, infer_same
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, broadcast_shapes

# ONNX Pow-15: the base is one of these; the exponent may be any numeric dtype.
POW_BASE = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64, DType.INT32, DType.INT64})


def float_map(fn: Callable[..., np.ndarray], *arrays: np.ndarray, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """``fn`` on float64 copies of ``arrays``, rounded once to ``dtype`` (default: the first array's).

    Overflow to inf, log(0) and the like are IEEE results here, not errors, so numpy's
    warnings are silenced.
    """
    out_dtype = np.asarray(arrays[0]).dtype if dtype is None else dtype
    with np.errstate(all="ignore"):
        wide = fn(*(np.asarray(a, dtype=np.float64) for a in arrays))
        return np.asarray(wide).astype(out_dtype)


# math.erf is exact to float64 precision and needs no scipy.
erf64 = np.vectorize(math.erf, otypes=[np.float64])


def sigmoid64(v: np.ndarray) -> np.ndarray:
    """Logistic function on float64 that never overflows: exp only ever sees -|v|."""
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# --------------------------------------------------------------------------- binary arithmetic


@op("Add", traits=("elementwise", "commutative"),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def add(a, b):
    return np.add(a, b)


@op("Sub", traits=("elementwise",), inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def sub(a, b):
    return np.subtract(a, b)


@op("Mul", traits=("elementwise", "commutative"),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def mul(a, b):
    return np.multiply(a, b)


@op("Div", traits=("elementwise",), inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast)
def div(a, b):
    """True division for floats; integer division truncates toward zero (as in C and ONNX)."""
    if as_dtype(a.dtype).is_float:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.divide(a, b)
    return _trunc_div(a, b)


@op("Mod", inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"],
    attrs=[Attr("fmod", AttrKind.INT, 0)], infer=infer_broadcast)
def mod(a, b, fmod=0):
    """Remainder (ONNX Mod-28, which kiln imports for every Mod version: earlier ones allowed a subset).
    fmod=0: ``a - floor(a / b) * b``, the sign of the divisor, as Python's ``%`` (floats: x % 0 and inf % y
    are NaN, x % inf is x when the signs agree, else inf); fmod=1: ``a - trunc(a / b) * b``, the sign of the
    dividend, as C's ``fmod``. Integer x % 0 is undefined (0 here)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmod:
            return np.fmod(a, b)
        r = np.remainder(a, b)
        if r.dtype.kind == "f":
            # x % ±inf spelled out (the GPU runs this reference on CuPy, whose remainder gives NaN there): x when
            # x and the divisor have the same sign, else the divisor; ±0 takes the divisor's sign.
            inf_b = np.isinf(b) & np.isfinite(a)
            zero = r.dtype.type(0)
            r = np.where(inf_b, np.where(a == 0, np.copysign(zero, b), np.where((a < 0) == (b < 0), a, b)), r)
        return r.astype(np.result_type(a, b), copy=False)


def _trunc_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # Integer division by zero is undefined in ONNX; numpy yields 0, and we keep it quiet.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.floor_divide(a, b)
        r = np.remainder(a, b)
    # floor and truncation differ only when the exact quotient is negative and inexact:
    # then floor went one step away from zero.
    step_back = (r != 0) & ((a < 0) != (b < 0))
    return (q + step_back).astype(q.dtype)


def _infer_pow(ctx: InferContext) -> TensorType:
    base, exponent = ctx.input(0), ctx.input(1)
    return TensorType(base.dtype, broadcast_shapes(base.shape, exponent.shape))


@op("Pow", traits=("elementwise",), inputs=[In("X", POW_BASE), In("Y", NUMERIC)], outputs=["Z"], infer=_infer_pow)
def pow_(x, y):
    """x ** y with the dtype of the base ``x``; the exponent may have any numeric dtype."""
    if x.dtype.kind in "iu" and y.dtype.kind in "iu" and not np.any(y < 0):
        # Exact integer power (wrapping on overflow, like C).
        with np.errstate(over="ignore"):
            return np.power(x.astype(np.int64), y.astype(np.int64)).astype(x.dtype)
    if x.dtype.kind in "iu":
        # Fractional or negative exponents of an integer base: compute in float64 and
        # truncate toward zero, as a C cast of pow() would.
        return float_map(lambda b, e: np.trunc(np.power(b, e)), x, y)
    return float_map(np.power, x, y)


# --------------------------------------------------------------------------- unary


@op("Neg", traits=("elementwise",), inputs=[In("X", SIGNED_NUMERIC)], outputs=["Y"], infer=infer_same)
def neg(x):
    return np.negative(x)


@op("Abs", traits=("elementwise",), inputs=[In("X", NUMERIC)], outputs=["Y"], infer=infer_same)
def abs_(x):
    return np.abs(x)


@op("Sign", traits=("elementwise",), inputs=[In("input", NUMERIC)], outputs=["output"], infer=infer_same)
def sign(x):
    return np.sign(x)


@op("Floor", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def floor(x):
    return np.floor(x)


@op("Ceil", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def ceil(x):
    return np.ceil(x)


@op("Exp", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def exp(x):
    return float_map(np.exp, x)


@op("Log", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def log(x):
    return float_map(np.log, x)


@op("Sqrt", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def sqrt(x):
    return float_map(np.sqrt, x)


@op("Reciprocal", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def reciprocal(x):
    return float_map(np.reciprocal, x)


@op("Erf", traits=("elementwise",), inputs=[In("input", NUMERIC)], outputs=["output"], infer=infer_same)
def erf(x):
    """Gauss error function. ONNX allows integer inputs: the result is truncated toward zero."""
    return float_map(erf64, x)


@op("Tanh", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def tanh(x):
    return float_map(np.tanh, x)


@op("Sigmoid", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def sigmoid(x):
    return float_map(sigmoid64, x)


@op("Sin", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def sin(x):
    return float_map(np.sin, x)


@op("Cos", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def cos(x):
    return float_map(np.cos, x)


# Inverse and hyperbolic trigonometry (ai.onnx 7/9; 22 adds bfloat16): float64, rounded once. Outside the
# domain (acos 2, atanh 1.5) the result is NaN, as numpy gives and ONNX's reference expects.
def _unary_float(name: str, fn: Callable[[np.ndarray], np.ndarray], doc: str) -> None:
    def reference(x):
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return float_map(fn, x)
    reference.__name__, reference.__doc__ = name.lower(), doc
    op(name, traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)(reference)


for _name, _fn in (("Tan", np.tan), ("Acos", np.arccos), ("Asin", np.arcsin), ("Atan", np.arctan),
                   ("Sinh", np.sinh), ("Cosh", np.cosh), ("Asinh", np.arcsinh), ("Acosh", np.arccosh),
                   ("Atanh", np.arctanh)):
    _unary_float(_name, _fn, f"{_fn.__name__} of each element.")


@op("Round", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def round_(x):
    """Round to the nearest integer, halves to even (as numpy's rint and ONNX)."""
    return np.rint(x)


# --------------------------------------------------------------------------- variadic


def _fold(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], arrays: tuple) -> np.ndarray:
    """Left fold of a broadcasting binary ufunc over the inputs (a copy even for one input)."""
    out = np.array(arrays[0])
    for a in arrays[1:]:
        out = fn(out, a)
    return out


@op("Max", traits=("elementwise", "commutative"),
    inputs=[In("data_0", NUMERIC, variadic=True)], outputs=["max"], infer=infer_broadcast)
def max_(*xs):
    """Elementwise maximum of all inputs (broadcast); NaN propagates."""
    return _fold(np.maximum, xs)


@op("Min", traits=("elementwise", "commutative"),
    inputs=[In("data_0", NUMERIC, variadic=True)], outputs=["min"], infer=infer_broadcast)
def min_(*xs):
    """Elementwise minimum of all inputs (broadcast); NaN propagates."""
    return _fold(np.minimum, xs)


@op("Sum", traits=("elementwise",), inputs=[In("data_0", FLOAT, variadic=True)], outputs=["sum"], infer=infer_broadcast)
def sum_(*xs):
    """Elementwise sum of all inputs (broadcast), accumulated in float64 and rounded once."""
    return float_map(lambda *ws: _fold(np.add, ws), *xs)


@op("Mean", traits=("elementwise",),
    inputs=[In("data_0", FLOAT, variadic=True)], outputs=["mean"], infer=infer_broadcast)
def mean(*xs):
    """Elementwise mean of all inputs (broadcast), accumulated in float64 and rounded once."""
    return float_map(lambda *ws: _fold(np.add, ws) / len(ws), *xs)


# --------------------------------------------------------------------------- Clip


def _infer_clip(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    for i, name in ((1, "min"), (2, "max")):
        if not ctx.has_input(i):
            continue
        bound = ctx.input(i)
        if bound.dtype is not x.dtype:
            ctx.fail(f"{name} is {bound.dtype} but input is {x.dtype}")
        # ONNX asks for a scalar; exporters also emit shape [1], so any one-element shape passes.
        if bound.shape is not None and any(isinstance(d, int) and d != 1 for d in bound.shape):
            ctx.fail(f"{name} must be a scalar, got shape {bound}")
    return x


@op("Clip", traits=("elementwise",), inputs=[In("input", NUMERIC), In("min", NUMERIC, optional=True, max_elements=1),
                  In("max", NUMERIC, optional=True, max_elements=1)],
    outputs=["output"], infer=_infer_clip)
def clip(x, lo=None, hi=None):
    """Limit x to [min, max] (omitted bound: unbounded). min > max gives max everywhere."""
    out = np.array(x)
    if lo is not None:
        out = np.maximum(out, np.reshape(lo, ()))
    if hi is not None:
        out = np.minimum(out, np.reshape(hi, ()))
    return out
