"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool (ONNX semantics).

The window geometry (pads, auto_pad, ceil_mode) is the one Conv uses, from kiln.ir.ops.nn.
Padded positions never win a max and, for AveragePool, count in the divisor only with
count_include_pad=1; the extra positions a ceil_mode window reaches past the pads never count.
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.ops.nn import Window, make_window, pad_spatial, static_pads, window_out_shape, windows
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType

MAXPOOL_T = FLOAT | frozenset({DType.INT8, DType.UINT8})

_POOL_ATTRS = [Attr("auto_pad", AttrKind.STRING, "NOTSET"), Attr("ceil_mode", AttrKind.INT, 0),
               Attr("kernel_shape", AttrKind.INTS), Attr("pads", AttrKind.INTS, None),
               Attr("strides", AttrKind.INTS, None)]


def _pool_window(attrs: dict) -> Window:
    return make_window(attrs["kernel_shape"], strides=attrs["strides"], dilations=attrs.get("dilations"),
                       pads=attrs["pads"], auto_pad=attrs["auto_pad"], ceil_mode=attrs["ceil_mode"])


def infer_pool(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, None)
    n = len(ctx.attrs["kernel_shape"])
    if len(x.shape) != n + 2:
        ctx.fail(f"X of shape {list(x.shape)} must have rank {n + 2}: [N, C] and one dim per "
                 f"kernel_shape entry {list(ctx.attrs['kernel_shape'])}")
    window = _pool_window(ctx.attrs)
    return TensorType(x.dtype, list(x.shape[:2]) + window_out_shape(window, x.shape[2:]))


def _pool_views(x: np.ndarray, attrs: dict, fill: float) -> tuple:
    """(window view of the padded input [N, C, *out, *k], the window, the pads in effect)."""
    window = _pool_window(attrs)
    sizes = x.shape[2:]
    begin, end, reach = static_pads(window, sizes)
    out = window_out_shape(window, sizes)
    return windows(pad_spatial(x, begin, reach, fill), window, out), window, (begin, end, reach, out)


# --------------------------------------------------------------------------- MaxPool


def infer_max_pool(ctx: InferContext) -> TensorType:
    if ctx.num_outputs > 1:
        ctx.fail("the Indices output of MaxPool is not supported; use only output Y")
    return infer_pool(ctx)


def _lowest(dtype: np.dtype) -> float:
    return -np.inf if dtype.kind not in "iu" else np.iinfo(dtype).min


@op("MaxPool", inputs=[In("X", MAXPOOL_T)],
    outputs=[Out("Y", MAXPOOL_T), Out("Indices", {DType.INT64}, optional=True)],
    attrs=_POOL_ATTRS + [Attr("dilations", AttrKind.INTS, None), Attr("storage_order", AttrKind.INT, 0)],
    infer=infer_max_pool)
def max_pool(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, dilations, storage_order):
    """The largest element of each window; pads hold the dtype's lowest value so never win."""
    attrs = {"auto_pad": auto_pad, "ceil_mode": ceil_mode, "kernel_shape": kernel_shape,
             "pads": pads, "strides": strides, "dilations": dilations}
    cols, window, _ = _pool_views(x, attrs, _lowest(x.dtype))
    return cols.max(axis=tuple(range(-window.rank, 0))).astype(x.dtype)


# --------------------------------------------------------------------------- AveragePool


@op("AveragePool", inputs=[In("X", FLOAT)],
    attrs=_POOL_ATTRS + [Attr("count_include_pad", AttrKind.INT, 0), Attr("dilations", AttrKind.INTS, None)],
    infer=infer_pool)
def average_pool(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, count_include_pad, dilations=None):
    """Mean of each window over the input positions it covers (and the pads it covers when
    count_include_pad=1). ``dilations`` (AveragePool-19) spaces the window's taps."""
    attrs = {"auto_pad": auto_pad, "ceil_mode": ceil_mode, "kernel_shape": kernel_shape,
             "pads": pads, "strides": strides, "dilations": dilations}
    acc = compute_dtype(x.dtype)
    cols, window, (begin, end, reach, out) = _pool_views(x.astype(acc), attrs, 0)
    taps = tuple(range(-window.rank, 0))
    # The divisor of each window: count a 1 for every position that is allowed to count.
    ones = np.ones((1, 1) + x.shape[2:], acc)
    if count_include_pad:
        counted = pad_spatial(ones, begin, end, 1)
        counted = pad_spatial(counted, [0] * window.rank, [r - e for r, e in zip(reach, end)], 0)
    else:
        counted = pad_spatial(ones, begin, reach, 0)
    counts = windows(counted, window, out).sum(axis=taps)
    return (cols.sum(axis=taps) / counts).astype(x.dtype)


# --------------------------------------------------------------------------- global pools


def infer_global_pool(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if len(x.shape) < 3:
        ctx.fail(f"X must have rank >= 3 ([N, C, *spatial]), got shape {list(x.shape)}")
    return TensorType(x.dtype, list(x.shape[:2]) + [1] * (len(x.shape) - 2))


@op("GlobalAveragePool", inputs=[In("X", FLOAT)], infer=infer_global_pool)
def global_average_pool(x):
    """Mean over every spatial dim, kept as size 1."""
    axes = tuple(range(2, x.ndim))
    return x.astype(compute_dtype(x.dtype)).mean(axis=axes, keepdims=True).astype(x.dtype)


@op("GlobalMaxPool", inputs=[In("X", FLOAT)], infer=infer_global_pool)
def global_max_pool(x):
    """Max over every spatial dim, kept as size 1."""
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


# --------------------------------------------------------------------------- LpPool


@op("LpPool", inputs=[In("X", FLOAT)],
    attrs=_POOL_ATTRS + [Attr("dilations", AttrKind.INTS, None), Attr("p", AttrKind.INT, 2)], infer=infer_pool)
def lp_pool(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, dilations=None, p=2):
    """(sum of |x|^p over each window)^(1/p), LpPool-18; pads add nothing to the sum."""
    attrs = {"auto_pad": auto_pad, "ceil_mode": ceil_mode, "kernel_shape": kernel_shape,
             "pads": pads, "strides": strides, "dilations": dilations}
    acc = compute_dtype(x.dtype)
    cols, window, _ = _pool_views(np.abs(x.astype(acc)) ** p, attrs, 0)
    return (cols.sum(axis=tuple(range(-window.rank, 0))) ** (1.0 / p)).astype(x.dtype)
