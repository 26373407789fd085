"""Activations with numpy ufuncs, in place on one fresh temporary.

The references compute in float64 and round once; float32 here computes in float32 (a few
ulps, inside the conformance tolerance). numpy lacks erf: a rational approximation (Eigen's
float erf; |error| < 5e-7 in float32, < 1e-7 in float64) replaces the reference's per-element
``math.erf``, in float32 except where that error would not be small against the result (Gelu's
negative tail). Other dtypes keep the reference.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.runtime.kernels.cpu.linalg import input_dtype

F32 = np.dtype(np.float32)
# erf(x) ~ x * P(x^2) / Q(x^2) on [-4, 4] (beyond, erf is +-1 to within 2e-8); highest power first.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _horner(coefs: tuple, x2: np.ndarray) -> np.ndarray:
    acc = np.full_like(x2, coefs[0])
    for c in coefs[1:]:
        acc *= x2
        acc += c
    return acc


def erf_wide(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """erf(scale * x) as a fresh float64 array (float32 Horner sums cancel too much)."""
    # Flat, so that 0-d inputs stay arrays through the arithmetic (ufuncs return scalars there).
    t = np.multiply(x.reshape(-1), scale, dtype=np.float64)
    np.clip(t, -4.0, 4.0, out=t)
    # Past the clip erf is +-1: exactly, so that x * (1 + erf(x)) is 0, not x * 1e-8, for huge -x.
    saturated = np.abs(t) == 4.0
    x2 = np.square(t)
    y = t * _horner(_ERF_P, x2)
    y /= _horner(_ERF_Q, x2)
    np.copyto(y, np.sign(t), where=saturated)
    return y.reshape(x.shape)


_ERF_P32 = tuple(F32.type(c) for c in _ERF_P)
_ERF_Q32 = tuple(F32.type(c) for c in _ERF_Q)
# Below this x, Gelu's float32 value x * (1 + erf) / 2 has an error (|x| * 5e-7 / 2) not small
# against the tolerance (1e-6 + 1e-5 * |gelu|, gelu -> 0): those few elements use erf_wide.
_GELU_WIDE_BELOW = F32.type(-2.0)


def _horner_into(coefs: tuple, x2: np.ndarray, acc: np.ndarray) -> np.ndarray:
    np.multiply(x2, coefs[0], out=acc)
    acc += coefs[1]
    for c in coefs[2:]:
        acc *= x2
        acc += c
    return acc


def erf_f32(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """erf(scale * x) as a fresh float32 array, in float32 (about 25 passes over 3 buffers)."""
    # Flat, so that 0-d inputs stay arrays through the arithmetic (ufuncs return scalars there).
    t = np.multiply(x.reshape(-1), F32.type(scale), dtype=F32)
    # Clipped, x2 <= 16 keeps the Horner sums tame; past +-4, erf rounds to +-1 in float32.
    np.clip(t, F32.type(-4.0), F32.type(4.0), out=t)
    x2 = np.square(t)
    p = _horner_into(_ERF_P32, x2, np.empty_like(t))
    p *= t
    q = _horner_into(_ERF_Q32, x2, t)  # t is spent: its buffer takes Q (x2 cannot, Horner reads it)
    p /= q
    return p.reshape(x.shape)


def fresh(x: np.ndarray) -> np.ndarray:
    """A new array like ``x`` (an ndarray even for 0-d ``x``, where ufuncs would give scalars)."""
    return np.empty(x.shape, x.dtype)


def _float32_only(fast: Callable) -> Callable:
    """Register ``fast(node, attrs)`` for float32 inputs; the reference serves other dtypes."""
    def factory(node, attrs):
        if input_dtype(node) != F32:
            return reference_kernel(node, attrs)
        return fast(node, attrs)
    factory.__name__ = fast.__name__
    factory.__doc__ = fast.__doc__
    return factory


@kernel("Erf")
@_float32_only
def erf(node, attrs) -> Callable[..., Any]:
    return erf_f32


@kernel("Gelu")
@_float32_only
def gelu(node, attrs) -> Callable[..., Any]:
    if attrs["approximate"] == "tanh":
        return _gelu_tanh
    if attrs["approximate"] != "none":
        return reference_kernel(node, attrs)

    return _gelu_erf


# Elements per block of the many-pass float32 kernels: their 3 temporaries (768 KiB) stay in
# cache between passes; a [128, 3072] Gelu ran 3.2 ms whole, 2.1 ms in blocks (8K blocks: 4.4,
# the per-call overhead wins).
_BLOCK = 1 << 16


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    if x.size <= _BLOCK:
        return _gelu_erf_block(x)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, F32)
    for start in range(0, flat.size, _BLOCK):
        out[start:start + _BLOCK] = _gelu_erf_block(flat[start:start + _BLOCK])
    return out.reshape(x.shape)


def _gelu_erf_block(x: np.ndarray) -> np.ndarray:
    y = erf_f32(x, 1.0 / math.sqrt(2.0))
    y += 1.0
    y *= x
    y *= 0.5
    tail = np.flatnonzero(x < _GELU_WIDE_BELOW)
    if tail.size:
        xt = x.reshape(-1)[tail]
        wide = erf_wide(xt, 1.0 / math.sqrt(2.0))
        wide += 1.0
        wide *= xt
        wide *= 0.5
        y.reshape(-1)[tail] = wide
    return y


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    inner = np.multiply(x, x, out=fresh(x))
    inner *= 0.044715
    inner += 1.0
    inner *= x
    inner *= F32.type(math.sqrt(2.0 / math.pi))
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= x
    inner *= 0.5
    return inner


@kernel("Tanh")
@_float32_only
def tanh(node, attrs) -> Callable[..., Any]:
    def run(x):
        return np.tanh(x, out=fresh(x))
    return run


@kernel("Sigmoid")
@_float32_only
def sigmoid(node, attrs) -> Callable[..., Any]:
    def run(x):
        # 0.5 * (1 + tanh(x / 2)): tanh never overflows, so no exp(-x) = inf warnings.
        y = np.multiply(x, F32.type(0.5), out=fresh(x))
        np.tanh(y, out=y)
        y += 1.0
        y *= 0.5
        return y
    return run


@kernel("HardSigmoid")
@_float32_only
def hard_sigmoid(node, attrs) -> Callable[..., Any]:
    alpha, beta = attrs["alpha"], attrs["beta"]

    def run(x):
        y = np.multiply(x, F32.type(alpha), out=fresh(x))
        y += F32.type(beta)
        np.clip(y, 0.0, 1.0, out=y)
        return y
    return run


@kernel("HardSwish")
@_float32_only
def hard_swish(node, attrs) -> Callable[..., Any]:
    def run(x):
        y = np.multiply(x, F32.type(1.0 / 6.0), out=fresh(x))
        y += 0.5
        np.clip(y, 0.0, 1.0, out=y)
        y *= x
        return y
    return run
