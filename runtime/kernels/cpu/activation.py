"""Activations with numpy ufuncs, in place on one fresh temporary.

The references compute in float64 and round once; float32 here computes in float32 (a few
ulps, inside the conformance tolerance). numpy lacks erf: Erf uses a rational approximation
(Eigen's float erf, |error| < 5e-7) in place of the reference's per-element ``math.erf``, and
exact (erf) Gelu a logistic form fitted to float64 erfc (see ``_GELU_NEG_H``), both in float32,
Gelu in cache-sized blocks. Other dtypes keep the reference.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from kiln.numerics import erf_into, horner_into
from kiln.runtime.kernels.cpu import kernel, native, reference_kernel
from kiln.runtime.kernels.cpu.linalg import input_dtype
from kiln.runtime.plan import ufunc_inplace

try:  # the clip ufunc itself: np.clip reaches it through three Python layers (about 2 us a call)
    from numpy._core.umath import clip as _clip
except ImportError:  # numpy < 2
    from numpy.core.umath import clip as _clip

F32 = np.dtype(np.float32)


def erf_f32(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """erf(scale * x) as a fresh float32 array (kiln.numerics.erf_into: the approximation the mobile stub
    shares)."""
    # Flat, so that 0-d inputs stay arrays through the arithmetic (ufuncs return scalars there).
    out = np.empty(x.size, F32)
    erf_into(x.reshape(-1), out, scale)
    return out.reshape(x.shape)


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


# Elements per block of the many-pass float32 kernels: the block and its scratch (256 KiB each)
# stay in cache between passes, and the per-call overhead of ~17 ufunc calls stays small
# ([32, 128, 512] Gelu: 8K blocks 6.6 ms, 16K 5.9, 32K 5.3, 64K 5.0, 128K 5.2).
_BLOCK = 1 << 16

# Exact Gelu as x * sigmoid(y) with y = logit(Phi(x)) = x * h(x^2): y is odd and h smooth, so
# a polynomial in x^2 fits h (weighted minimax on |x| <= 5.5 against float64 erfc; highest power
# first, negated so that the kernel gets -y directly). So Gelu takes ~15 cheap passes, one exp
# and one divide, and x / (1 + exp(-y)) keeps its relative accuracy in the negative tail, where
# x * (1 + erf(x / sqrt 2)) / 2 cancels in float32. Its error is below 0.08x the conformance
# tolerance (1e-5 relative + 1e-6 absolute) over all float32 inputs. Past the fit h keeps
# growing (the leading term dominates), so |y| only grows: exp(-y) goes to 0 (Gelu -> x) or
# overflows to inf (Gelu -> -0), both right, hence errstate(over="ignore").
_GELU_NEG_H = tuple(F32.type(-c) for c in (
    3.507530019654803e-09, -2.6156392150408376e-07, 7.837862042960535e-06, -1.0961259429044801e-04,
    -6.977991844739546e-05, 7.267460300584773e-02, 1.5957653281068669))


_GELU_NEG_H_ARRAY = np.array(_GELU_NEG_H, F32)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    if native.rows_ok(x):  # the same formula and polynomial in one native pass
        return native.gelu(x, _GELU_NEG_H_ARRAY)
    # Flat, so that 0-d inputs stay arrays through the arithmetic (ufuncs return scalars there).
    flat = x.reshape(-1)
    out = np.empty(flat.shape, F32)
    sq = np.empty(min(flat.size, _BLOCK), F32)
    with np.errstate(over="ignore"):
        for start in range(0, flat.size, _BLOCK):
            xb = flat[start:start + _BLOCK]
            _gelu_erf_block(xb, sq[:xb.size], out[start:start + _BLOCK])
    return out.reshape(x.shape)


def _gelu_erf_block(x: np.ndarray, sq: np.ndarray, y: np.ndarray) -> None:
    """Gelu of the 1-D block ``x`` into ``y``, with ``sq`` (as large) for scratch."""
    np.multiply(x, x, out=sq)
    horner_into(_GELU_NEG_H, sq, y)
    y *= x                  # -y
    np.exp(y, out=y)
    y += F32.type(1.0)
    np.divide(x, y, out=y)  # x * sigmoid(y)


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
    alpha, beta = F32.type(attrs["alpha"]), F32.type(attrs["beta"])

    def run(x, out=None):
        if out is None and native.rows_ok(x):  # one native pass
            return native.activation(x, native.ACTIVATIONS["HardSigmoid"], alpha, beta)
        # Every pass in place on one buffer: the fresh result, or (in-place variant) the dying input.
        y = np.multiply(x, alpha, out=fresh(x) if out is None else out)
        np.add(y, beta, out=y)
        _clip(y, 0.0, 1.0, out=y)
        return y
    run.fresh = True
    run.inplace = {0: ufunc_inplace(run, 0, 1, F32)}
    return run


_SIXTH, _HALF = F32.type(1.0 / 6.0), F32.type(0.5)


@kernel("HardSwish")
@_float32_only
def hard_swish(node, attrs) -> Callable[..., Any]:
    # x * clip(x / 6 + 0.5, 0, 1): four ufunc passes in place on the result (no in-place variant: the last
    # pass reads x, so writing into a dying x would still need this scratch). Blocks kept in cache between
    # the passes were slower here: numpy's per-call cost outweighed the cache misses they save.
    def run(x):
        if native.rows_ok(x):  # one native pass
            return native.activation(x, native.ACTIVATIONS["HardSwish"], 1.0 / 6.0, 0.5)
        y = np.multiply(x, _SIXTH, out=fresh(x))
        np.add(y, _HALF, out=y)
        _clip(y, 0.0, 1.0, out=y)
        np.multiply(y, x, out=y)
        return y
    return run
