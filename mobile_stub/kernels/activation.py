"""Activations as numpy ufuncs writing straight into the output view (no temporaries, except
Gelu's erf, which needs one buffer for its rational approximation's denominator).

numpy has no erf: Gelu (exact) uses Eigen's float rational approximation (|error| < 5e-7) from kiln.numerics,
the one kiln's CPU runtime uses for Erf (the bundle carries that numpy-only file).
"""
from __future__ import annotations

import math

import numpy as np

from kiln.numerics import erf_into  # noqa: F401  (the CPU runtime's approximation; Gelu below uses it)

F32 = np.float32


def relu(ins, outs, attrs):
    np.maximum(ins[0], 0, out=outs[0])


def leaky_relu(ins, outs, attrs):
    x, y = ins[0], outs[0]
    np.multiply(x, F32(attrs.get("alpha", 0.01)), out=y)
    np.maximum(x, y, out=y)


def sigmoid(ins, outs, attrs):
    y = outs[0]
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: 1/inf is the right 0
        np.negative(ins[0], out=y)
        np.exp(y, out=y)
    y += 1
    np.reciprocal(y, out=y)


def tanh(ins, outs, attrs):
    np.tanh(ins[0], out=outs[0])


def _hard_sigmoid(x, y, alpha, beta):
    np.multiply(x, F32(alpha), out=y)
    y += F32(beta)
    np.clip(y, 0, 1, out=y)


def hard_sigmoid(ins, outs, attrs):
    _hard_sigmoid(ins[0], outs[0], attrs.get("alpha", 0.2), attrs.get("beta", 0.5))


def hard_swish(ins, outs, attrs):
    _hard_sigmoid(ins[0], outs[0], 1.0 / 6.0, 0.5)
    outs[0] *= ins[0]


def gelu(ins, outs, attrs):
    x, y = ins[0], outs[0]
    if attrs.get("approximate", "none") == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        np.power(x, 3, out=y)
        y *= F32(0.044715)
        y += x
        y *= F32(math.sqrt(2 / math.pi))
        np.tanh(y, out=y)
    else:  # 0.5 x (1 + erf(x / sqrt 2))
        erf_into(x, y, 1 / math.sqrt(2))
    y += 1
    y *= x
    y *= F32(0.5)


def clip(ins, outs, attrs):
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else None
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else None
    if lo is None and hi is None:
        np.copyto(outs[0], ins[0])
    else:
        np.clip(ins[0], lo, hi, out=outs[0])


KERNELS = {"Relu": relu, "LeakyRelu": leaky_relu, "Sigmoid": sigmoid, "Tanh": tanh, "HardSigmoid": hard_sigmoid,
           "HardSwish": hard_swish, "Gelu": gelu, "Clip": clip}
SUPPORTS = {op: {"float32"} for op in KERNELS}
