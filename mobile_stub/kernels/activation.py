"""Activations as numpy ufuncs writing straight into the output view (no temporaries, except
Gelu's erf, which needs one buffer for its rational approximation's denominator).

numpy has no erf: Gelu (exact) uses Eigen's float rational approximation (|error| < 5e-7), the
same one kiln's CPU runtime uses for Erf.
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
_ERF_P = tuple(F32(c) for c in (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                               -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                               -1.60960333262415e-02))
_ERF_Q = tuple(F32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                               -7.37332916720468e-03, -1.42647390514189e-02))


def _horner(coefs, x2, acc):
    np.multiply(x2, coefs[0], out=acc)
    acc += coefs[1]
    for c in coefs[2:]:
        acc *= x2
        acc += c
    return acc


def erf_into(x, out, scale=1.0):
    """out = erf(scale * x), float32, with one temporary the size of x."""
    np.multiply(x, F32(scale), out=out)
    np.clip(out, F32(-4), F32(4), out=out)
    x2 = np.square(out)
    num = _horner(_ERF_P, x2, np.empty_like(out))
    num *= out
    _horner(_ERF_Q, x2, out)
    np.divide(num, out, out=out)
    return out


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
