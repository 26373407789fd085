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
