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

from kiln.runtime.kernels.cpu import kernel, reference_kernel
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
    return _BINARY_FLOAT_SAFE[node.op]


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
