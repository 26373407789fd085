"""Elementwise kernels: numpy ufuncs called directly (the references add checks and casts).

Each is fresh and can write its result into an input that dies (issue 5; the protocol is in
kiln.runtime.plan): a bare ufunc (Add is ``np.add``) gets its in-place variants from the plan,
a wrapped one (Relu, Div, Sqrt) carries ``fresh`` and ``inplace`` attributes built with
``ufunc_inplace``. Only ops whose ufunc gives the reference's results bit for bit are here:
the exact ones (Neg, Abs, Floor, Ceil in every dtype; the references call the same ufunc) and,
for float32/float64, division and square root, which the references compute in float64 and
round once: one correctly rounded float64 result rounded again to float32 equals the correctly
rounded float32 one for +, -, *, / and sqrt (53 >= 2 * 24 + 2 bits), so the direct ufunc agrees.
Exp, Log and the like are not correctly rounded by numpy in float32, so they keep the reference.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.runtime.kernels.cpu import kernel, native, reference_kernel
from kiln.runtime.plan import ufunc_inplace

_BINARY_FLOAT_SAFE = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}
_UNARY_EXACT = {"Neg": np.negative, "Abs": np.abs, "Floor": np.floor, "Ceil": np.ceil}
_CORRECTLY_ROUNDED = (np.dtype(np.float32), np.dtype(np.float64))


def _dtype(node) -> np.dtype:
    return np.dtype(node.outputs[0].type.dtype.numpy)


def _with_inplace(run: Callable[..., Any], nin: int, dtype: np.dtype) -> Callable[..., Any]:
    """Mark ``run(*args, out=None)`` fresh and give it in-place variants for every input."""
    run.fresh = True
    run.inplace = {k: ufunc_inplace(run, k, nin, dtype) for k in range(nin)}
    return run


@kernel("Add", "Sub", "Mul")
def binary(node, attrs):
    if node.op == "Mul" and _dtype(node) == np.float32 and native.available() and _may_scale_rows(node):
        return _with_inplace(_mul_scaling_rows, 2, np.dtype(np.float32))
    return _BINARY_FLOAT_SAFE[node.op]


def _may_scale_rows(node) -> bool:
    """Whether the input types allow one operand to scale the other's rows (the same rank, one with a trailing
    dim of 1): only such Muls take _mul_scaling_rows's checks, the rest stay the bare ufunc."""
    shapes = [None if v is None or v.type is None else v.type.shape for v in node.inputs]
    return (len(shapes) == 2 and None not in shapes and len(shapes[0]) == len(shapes[1]) >= 2
            and any(shape[-1] == 1 for shape in shapes))


# Tensors of at least this many floats scaled row by row natively (_mul_scaling_rows); smaller ones stay numpy's.
SCALE_MIN_FLOATS = 1 << 14


def _mul_scaling_rows(a, b, out=None):
    """a * b, where one operand scales the other's rows (a squeeze-excite block's [N, C, H, W] by [N, C, 1, 1]) on
    the native pass over several threads (numpy broadcast the factor at one thread: 10-40 us a MobileNetV3-style
    block at batch 1-8); numpy's multiply otherwise. The same bits either way."""
    x, s = (a, b) if a.size >= b.size else (b, a)
    if x.size >= SCALE_MIN_FLOATS and s.ndim == x.ndim and x.dtype == s.dtype == np.float32 and native.rows_ok(x) \
            and s.flags.c_contiguous and (out is None or out is x):
        k = s.ndim
        while k > 0 and s.shape[k - 1] == 1:
            k -= 1
        if 0 < k < s.ndim and s.shape[:k] == x.shape[:k]:  # a factor per row of x's trailing dims
            n = x.size // s.size
            y = np.empty_like(x) if out is None else out
            native.scale_rows(x, s, y, n)
            return y
    return np.multiply(a, b, out=out)


@kernel("Neg", "Abs", "Floor", "Ceil")
def unary_exact(node, attrs):
    return _UNARY_EXACT[node.op]


@kernel("Div")
def div(node, attrs):
    dt = _dtype(node)
    if dt not in _CORRECTLY_ROUNDED:  # integers truncate toward zero; half types keep the reference
        return reference_kernel(node, attrs)

    def run(a, b, out=None):
        with np.errstate(divide="ignore", invalid="ignore"):  # x/0 is inf or nan, quietly
            return np.divide(a, b, out=out)
    return _with_inplace(run, 2, dt)


@kernel("Sqrt")
def sqrt(node, attrs):
    dt = _dtype(node)
    if dt not in _CORRECTLY_ROUNDED:
        return reference_kernel(node, attrs)

    def run(x, out=None):
        with np.errstate(invalid="ignore"):  # sqrt of a negative is nan, quietly
            return np.sqrt(x, out=out)
    return _with_inplace(run, 1, dt)


@kernel("Relu")
def relu(node, attrs):
    dt = _dtype(node)
    zero = dt.type(0)

    def run(x, out=None):
        return np.maximum(x, zero, out=out)
    return _with_inplace(run, 1, dt)


@kernel("Identity")
def identity(node, attrs):
    return lambda x: x


# Powers by a constant scalar exponent (issue 24): ``x ** 3`` in a hand-written GELU approximation took 471 µs
# through the reference (np.power in float64, a transcendental per element) where the product takes microseconds.
# Each form below gives the reference's float32 result: x*x and 1/x are correctly rounded in float32 (so equal the
# exact float64 value rounded once), sqrt too (with pow's own answers at -0 and -inf); the cube, fourth power and
# the negative ones are computed in float64 (x*x exact there, one more operation rounded once) and rounded to
# float32 once, as the reference rounds its float64 pow: equal but where two float64 values a few units apart
# straddle a float32 rounding boundary (about 2^-28 of inputs; none in the op suite's checks). The special values
# follow np.power, the reference: pow(-0, -0.5) = +inf, pow(-inf, -0.5) = 0. In float64 only the correctly
# rounded forms (2, -1, 0.5) are taken: a float64 product is not the float64 pow.
_EXACT_IN_FLOAT64 = (2.0, -1.0, 0.5)
def _rsqrt_pow(w):
    r = 1.0 / np.abs(np.sqrt(w))  # np.power(-0, -0.5) is +inf
    if np.isneginf(w).any():
        r[np.isneginf(w)] = 0.0  # np.power(-inf, -0.5) is 0 where 1/sqrt(-inf) is nan
    return r


def _wide(fn):
    def run(x, out=None):
        w = fn(x.astype(np.float64))
        if out is None:
            return w.astype(x.dtype)
        np.copyto(out, w, casting="same_kind")
        return out
    return run


_POWERS = {
    2.0: lambda x, out=None: np.multiply(x, x, out=out),
    -1.0: lambda x, out=None: np.divide(x.dtype.type(1), x, out=out),
    0.5: lambda x, out=None: np.sqrt(x, out=out),
    3.0: _wide(lambda w: np.multiply(np.multiply(w, w), w, out=w)),
    4.0: _wide(lambda w: np.square(np.multiply(w, w, out=w), out=w)),
    -2.0: _wide(lambda w: np.divide(1.0, np.multiply(w, w, out=w), out=w)),
    -0.5: _wide(_rsqrt_pow),
}


@kernel("Pow")
def pow_(node, attrs):
    dt = _dtype(node)
    e = node.inputs[1].const
    if dt not in _CORRECTLY_ROUNDED or e is None or np.size(e) != 1 or node.inputs[0].type is None \
            or node.inputs[0].type.shape is None or np.ndim(e) > len(node.inputs[0].type.shape):
        return reference_kernel(node, attrs)  # (an exponent of higher rank would broadcast the result's shape)
    power = float(np.asarray(e).reshape(-1)[0])
    fn = _POWERS.get(power)
    if fn is None or (dt == np.float64 and power not in _EXACT_IN_FLOAT64):
        return reference_kernel(node, attrs)

    def run(x, y, out=None):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(x, out=out)
    return _with_inplace(run, 2, dt)
