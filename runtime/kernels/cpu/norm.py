"""Normalizations in few passes: one fresh temporary per op, updated in place.

The float32/float64 paths do the reference's arithmetic in the reference's order (its compute
dtype is the input's there), only without its copies; narrow floats keep the reference.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.types import normalize_axis
from kiln.runtime.kernels.cpu import kernel, native, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, const_input, input_dtype


@kernel("BatchNormalization")
def batch_norm(node, attrs) -> Callable[..., Any]:
    stats = [const_input(node, i) for i in range(1, 5)]
    if (input_dtype(node) not in BLAS_DTYPES or any(s is None for s in stats) or len(node.outputs) > 1
            or attrs["training_mode"]):  # training mode normalizes with the batch's statistics
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
        if not stats_wanted and native.rows_ok(x) and _per_column(x, attrs["axis"], scale, b) \
                and scale.dtype == x.dtype and (b is None or b.dtype == x.dtype):
            return native.layer_norm(x, scale, b, eps)  # one native pass per row
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


# Elements per row block of a large last-axis LayerNorm or Softmax: their passes then run in
# cache ([32, 128, 128] LayerNorm: 1.38 ms whole, 1.09 ms in 64K blocks; 16K and 256K blocks
# were slower).
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


def _per_column(x: np.ndarray, axis: int, scale: np.ndarray, b) -> bool:
    """A LayerNorm over the last axis alone, with per-column scale and bias."""
    return (x.ndim > 0 and scale.ndim <= 1 and (b is None or b.ndim <= 1)
            and normalize_axis(axis, x.ndim) == x.ndim - 1)


def _blockable(x: np.ndarray, axis: int, scale: np.ndarray, b) -> bool:
    """A large LayerNorm over the last axis alone, with per-column scale and bias."""
    return _per_column(x, axis, scale, b) and x.size > _BLOCK


def _layer_norm_rows(rows: np.ndarray, scale: np.ndarray, b, eps: float, out: np.ndarray) -> None:
    """LayerNorm of 2-D ``rows`` over the last axis into ``out`` (the reference's steps, except the
    sums, which BLAS and einsum order their own way: float32 rounding differences only)."""
    n = rows.shape[-1]
    # Row means as one matrix-vector product: numpy's last-axis reductions pay per row.
    mean = rows @ np.full(n, 1.0 / n, rows.dtype)
    np.subtract(rows, mean[:, None], out=out)
    # sum(d * d) / n in one pass, without a squared temporary.
    var = np.einsum("ij,ij->i", out, out)[:, None]
    var /= n
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
        if x.ndim and x.size and normalize_axis(axis, x.ndim) == x.ndim - 1:
            if native.rows_ok(x):
                return native.softmax(x)  # exp and sum in one native pass per row
            return _by_row_blocks(x, _softmax_rows)
        return _softmax_exact(x, axis)
    return run


def _softmax_exact(x: np.ndarray, axis: int) -> np.ndarray:
    """The reference's steps: shift by each row's max, exponentiate, divide by the row sums."""
    y = x - x.max(axis=axis, keepdims=True)
    np.exp(y, out=y)
    y /= y.sum(axis=axis, keepdims=True)
    return y


# Row sums of exp(x - block max) below this mean the row's max sits so far below the block's
# that exp(x - block max) could reach float32's subnormals for an output of 1e-7 or more
# (x - row max >= -16, row max - block max >= -55 - ln(n)): those rows are redone exactly.
_SHIFT_FLOOR = 2.0 ** -80


def _softmax_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """Softmax of 2-D ``rows`` over the last axis into ``out``.

    Softmax does not depend on the shift, which only has to keep exp from overflowing (x - shift
    <= 0) and the outputs that matter out of underflow. The block's max is one fast reduction;
    each row's max is a last-axis reduction that numpy pays per row (it took a third of the
    reference's time). So the block max shifts every row, and the rare rows whose sum shows
    they sit far below it (or a block with inf or nan) take the exact per-row path."""
    top = rows.max()
    if not np.isfinite(top):
        out[...] = _softmax_exact(rows, -1)
        return
    np.subtract(rows, top, out=out)
    np.exp(out, out=out)
    # Row sums as one matrix-vector product: numpy's last-axis reductions pay per row.
    sums = out @ np.ones(rows.shape[-1], rows.dtype)
    low = np.flatnonzero(sums < _SHIFT_FLOOR)
    if low.size:
        out[low] = _softmax_exact(rows[low], -1)
        sums[low] = 1.0
    np.divide(1.0, sums, out=sums)
    out *= sums[:, None]


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
