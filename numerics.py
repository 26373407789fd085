"""Numerical kernels numpy lacks, shared by kiln's CPU runtime and the mobile stub (which bundles this file:
it imports numpy alone, and sits in the base layer of docs/ARCHITECTURE.md so that both may use it).

erf: Eigen's float rational approximation, erf(x) ~ x * P(x^2) / Q(x^2) on [-4, 4] (beyond, erf is +-1 to
within 2e-8; |error| < 5e-7), computed in float32 into a caller's buffer with one temporary.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
# Highest power first.
ERF_P = tuple(F32(c) for c in (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                               -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                               -1.60960333262415e-02))
ERF_Q = tuple(F32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                               -7.37332916720468e-03, -1.42647390514189e-02))


def horner_into(coefs: tuple, x2: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc = the polynomial with ``coefs`` (highest power first) at ``x2``, in place."""
    np.multiply(x2, coefs[0], out=acc)
    acc += coefs[1]
    for c in coefs[2:]:
        acc *= x2
        acc += c
    return acc


def erf_into(x: np.ndarray, out: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """out = erf(scale * x) in float32 (``out`` a float32 array of x's shape), with one temporary."""
    np.multiply(x, F32(scale), out=out)
    # Clipped: x2 <= 16 keeps the Horner sums tame; past +-4, erf rounds to +-1 in float32.
    np.clip(out, F32(-4.0), F32(4.0), out=out)
    x2 = np.square(out)
    num = horner_into(ERF_P, x2, np.empty_like(out))
    num *= out
    horner_into(ERF_Q, x2, out)  # out is spent: its buffer takes Q (x2 cannot, Horner reads it)
    np.divide(num, out, out=out)
    return out


def onnx_slice(start: int, end: int, step: int, dim: int) -> slice:
    """The Python slice taking what ONNX Slice takes along an axis of size ``dim`` (kiln.ir.ops.indexing's
    clamp_slice as a slice). Python's own clamping differs for a negative step: ONNX clamps start to
    [0, dim-1] (a start before the front takes element 0), Python to -1 (nothing)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    first, stop = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(first, None if stop < 0 else stop, step)
