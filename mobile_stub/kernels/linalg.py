"""MatMul and Gemm, float32, with a float or an int8 per-output-column weight.

np.matmul writes into the output view. An int8 weight (a QWeight whose scale runs along the output
columns: MatMul's [K, N] axis 1, Gemm's B axis 0 with transB=1 or axis 1 without) is cast to float32
(a weight-sized temporary) and its scale multiplies the output; any other scale axis is dequantized
whole. Gemm's C with beta != 1 needs one temporary.
"""
from __future__ import annotations

import numpy as np

from kiln.mobile_stub.kernels import QWeight


def _weight(w, column_axis):
    """(float weight, per-output-column scale or None)."""
    if not isinstance(w, QWeight):
        return w, None
    if w.axis == column_axis:
        return w.q.astype(np.float32), w.scale
    return w.dequantize(), None


def matmul(ins, outs, attrs):
    a, (b, scale) = ins[0], _weight(ins[1], ins[1].q.ndim - 1 if isinstance(ins[1], QWeight) else -1)
    y = outs[0]
    np.matmul(a, b, out=y)
    if scale is not None:
        y *= scale


def gemm(ins, outs, attrs):
    a, bq = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    y = outs[0]
    trans_b = attrs.get("transB", 0)
    b, scale = _weight(bq, 0 if trans_b else 1)
    if attrs.get("transA", 0):
        a = a.T
    np.matmul(a, b.T if trans_b else b, out=y)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if scale is not None:
        y *= scale if alpha == 1.0 else scale * np.float32(alpha)
    elif alpha != 1.0:
        y *= np.float32(alpha)
    if c is not None and beta != 0.0:
        y += c if beta == 1.0 else c * np.float32(beta)


KERNELS = {"MatMul": matmul, "Gemm": gemm}
SUPPORTS = {"MatMul": {"float32"}, "Gemm": {"float32"}}
