"""Normalizations in few passes: one fresh temporary per op, updated in place.

The float32/float64 paths do the reference's arithmetic in the reference's order (its compute
dtype is the input's there), only without its copies; narrow floats keep the reference.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.types import normalize_axis
from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, const_input, input_dtype


@kernel("BatchNormalization")
def batch_norm(node, attrs) -> Callable[..., Any]:
    stats = [const_input(node, i) for i in range(1, 5)]
    if input_dtype(node) not in BLAS_DTYPES or any(s is None for s in stats) or len(node.outputs) > 1:
        return reference_kernel(node, attrs)
    scale, b, mean, var = (s.astype(input_dtype(node)) for s in stats)
    # Folded once: y = x * k + t with k = scale / sqrt(var + eps), t = B - mean * k.
    k = scale / np.sqrt(var + var.dtype.type(attrs["epsilon"]))
    t = b - mean * k

    def run(x, *unused):
        shape = (-1,) + (1,) * (x.ndim - 2)
        y = x * k.reshape(shape)
        y += t.reshape(shape)
        return y
    return run


@kernel("LayerNormalization")
def layer_norm(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)
    eps = attrs["epsilon"]
    stash = DType(attrs["stash_type"]).numpy
    stats_wanted = len(node.outputs) > 1

    def run(x, scale, b=None):
        if _blockable(x, attrs["axis"], scale, b) and not stats_wanted:
            return _by_row_blocks(x, lambda rows, out: _layer_norm_rows(rows, scale, b, eps, out))
        axes = tuple(range(normalize_axis(attrs["axis"], x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        sq = np.square(d)
        inv_std = sq.mean(axis=axes, keepdims=True)
        inv_std += x.dtype.type(eps)
        np.sqrt(inv_std, out=inv_std)
        np.divide(1.0, inv_std, out=inv_std)
        d *= inv_std
        d *= scale
        if b is not None:
            d += b
        if stats_wanted:
            return d, mean.astype(stash), inv_std.astype(stash)
        return d
    return run


# Elements per row block of a large last-axis LayerNorm: its passes then run in cache ([32, 128, 128]:
# 1.38 ms whole, 1.09 ms in blocks; Softmax gained nothing, exp dominates it).
_BLOCK = 1 << 16


def _by_row_blocks(x: np.ndarray, fn: Callable) -> np.ndarray:
    """Apply ``fn(rows, out)`` to blocks of rows of ``x`` viewed as [rows, last]; a fresh result."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    out = np.empty(flat.shape, x.dtype)
    step = max(1, _BLOCK // max(n, 1))
    for start in range(0, flat.shape[0], step):
        fn(flat[start:start + step], out[start:start + step])
    return out.reshape(x.shape)


def _blockable(x: np.ndarray, axis: int, scale: np.ndarray, b) -> bool:
    """A large LayerNorm over the last axis alone, with per-column scale and bias."""
    per_column = scale.ndim <= 1 and (b is None or b.ndim <= 1)
    return per_column and x.size > _BLOCK and normalize_axis(axis, x.ndim) == x.ndim - 1


def _layer_norm_rows(rows: np.ndarray, scale: np.ndarray, b, eps: float, out: np.ndarray) -> None:
    """LayerNorm of 2-D ``rows`` over the last axis into ``out`` (the reference's steps, except the
    variance's sum, which einsum orders its own way: float32 rounding differences only)."""
    mean = rows.mean(axis=-1, keepdims=True)
    np.subtract(rows, mean, out=out)
    # sum(d * d) / n in one pass, without a squared temporary.
    var = np.einsum("ij,ij->i", out, out)[:, None]
    var /= rows.shape[-1]
    var += rows.dtype.type(eps)
    np.sqrt(var, out=var)
    np.divide(1.0, var, out=var)
    out *= var
    out *= scale
    if b is not None:
        out += b


@kernel("Softmax")
def softmax(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)
    axis = attrs["axis"]

    def run(x):
        y = x - x.max(axis=axis, keepdims=True)
        np.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        return y
    return run


@kernel("LogSoftmax")
def log_softmax(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)
    axis = attrs["axis"]

    def run(x):
        s = x - x.max(axis=axis, keepdims=True)
        e = np.exp(s)
        s -= np.log(e.sum(axis=axis, keepdims=True))
        return s
    return run
