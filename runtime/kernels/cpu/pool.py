"""Pooling over strided views: one max/add per kernel tap into a fresh result, instead of the
reference's window view reduced over its tap axes (which numpy walks element by element).

MaxPool is separable (the max over a kh x kw window is the max over kw of the max over kh), so
it runs as kh-1 maxima over whole input rows (the row stride and dilation are free in a view:
the inner axis stays contiguous), then kw-1 maxima along the rows of that sh-times smaller
result. Padding never takes part and is never materialized: each tap is clipped to the output
positions whose input index exists (_tap_range), and positions no tap reaches get the lowest
value. Work goes in blocks of whole planes (sample x channel) of about POOL_BLOCK_BYTES so the
row result is still in cache when the column maxima read it. On a 2-core Xeon, ResNet's 3x3/2
pool on [1, 64, 112, 112] went from 1.8-2.4 ms (stride-phase split, then nine maxima over
arrays larger than L2) to about 0.7 ms; what is left is numpy's per-row loop overhead. Where the native extension
is built, float32 MaxPool runs its kernel (the same separable maxima in C: 0.6 -> 0.1 ms there on a Zen 5).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from kiln.ir.ops.nn import make_window, pad_spatial, static_pads, window_out_shape
from kiln.ir.ops.pool import max_pool_values
from kiln.runtime.kernels.cpu import kernel, native, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, input_dtype
from kiln.runtime.kernels.cpu.nn import tap_view

MAX_DTYPES = BLAS_DTYPES + (np.dtype(np.int8), np.dtype(np.uint8))


def _window(attrs: dict):
    return make_window(attrs["kernel_shape"], strides=attrs["strides"], dilations=attrs.get("dilations"),
                       pads=attrs["pads"], auto_pad=attrs["auto_pad"], ceil_mode=attrs["ceil_mode"])


def _geometry(x: np.ndarray, window, fill: float) -> tuple:
    """(x padded to cover every window, output sizes, begin pads, end pads, end reach)."""
    sizes = x.shape[2:]
    begin, end, reach = static_pads(window, sizes)
    out = window_out_shape(window, sizes)
    if any(begin) or any(reach):
        x = pad_spatial(x, begin, reach, fill)
    return x, out, begin, end, reach


def _taps(window) -> list:
    return [(i, j) for i in range(window.kernel[0]) for j in range(window.kernel[1])]


# Planes per block: the input rows a block reads plus its row result stay within L2.
POOL_BLOCK_BYTES = 512 << 10


@kernel("MaxPool")
def max_pool(node, attrs) -> Callable[..., Any]:
    dt = input_dtype(node)
    if len(node.outputs) > 1:  # Y and Indices
        return reference_kernel(node, attrs)
    if dt not in MAX_DTYPES or len(attrs["kernel_shape"]) != 2:  # Y only: the reference's values part
        values = {k: v for k, v in attrs.items() if k != "storage_order"}
        return lambda x: max_pool_values(x, **values)[0]
    window = _window(attrs)
    lowest = dt.type(-np.inf if dt.kind == "f" else np.iinfo(dt).min)
    direct = native.max_pool2d(window) if native.available() and dt == np.float32 else None

    def run(x):
        if direct is not None and native.rows_ok(x):  # one native pass (the same maxima)
            return direct(x)
        n, c, h, w = x.shape
        (top, left), _, _ = static_pads(window, (h, w))
        out = window_out_shape(window, (h, w))
        planes = x.reshape(n * c, h, w)
        y = np.empty((n * c, out[0], out[1]), x.dtype)
        if y.size == 0:
            return y.reshape(n, c, out[0], out[1])
        block = max(1, POOL_BLOCK_BYTES // max(1, h * w * x.dtype.itemsize))
        for start in range(0, n * c, block):
            rows = _max_rows(planes[start:start + block], window, out[0], top, lowest)
            _max_cols(rows, window, out[1], left, lowest, y[start:start + block])
        return y.reshape(n, c, out[0], out[1])
    return run


def _tap_range(n_out: int, stride: int, shift: int, size: int) -> tuple:
    """The output positions [lo, hi) whose input index o*stride + shift lies in [0, size)."""
    lo = min(n_out, max(0, -(shift // stride)))
    hi = min(n_out, max(0, -((shift - size) // stride)))
    return lo, max(lo, hi)


def _max_taps(dst: np.ndarray, taps: list, lowest) -> None:
    """dst[..., lo:hi] = max of the (lo, hi, view) taps over the last axis of ``dst``, positions
    that no tap covers (all padding) the lowest value."""
    taps = [t for t in taps if t[0] < t[1]]
    if not taps:
        dst[...] = lowest
        return
    lo, hi, src = taps[0]
    dst[..., :lo] = lowest
    dst[..., hi:] = lowest
    dst[..., lo:hi] = src
    for lo, hi, src in taps[1:]:
        np.maximum(dst[..., lo:hi], src, out=dst[..., lo:hi])


def _max_rows(x: np.ndarray, window, oh: int, top: int, lowest) -> np.ndarray:
    """[P, OH, W]: per output row, the max over the kernel's row taps (input columns kept)."""
    kh, sh, dh = window.kernel[0], window.strides[0], window.dilations[0]
    p, h, w = x.shape
    v = np.empty((p, oh, w), x.dtype)
    taps = []
    for i in range(kh):
        shift = i * dh - top
        lo, hi = _tap_range(oh, sh, shift, h)
        taps.append((lo, hi, x[:, lo * sh + shift:(hi - 1) * sh + shift + 1:sh]))
    # The tap ranges are along the row axis: run them on the [P, W, OH] view.
    _max_taps(v.transpose(0, 2, 1), [(lo, hi, t.transpose(0, 2, 1)) for lo, hi, t in taps], lowest)
    return v


def _max_cols(v: np.ndarray, window, ow: int, left: int, lowest, y: np.ndarray) -> None:
    """y[..., o] = max over the kernel's column taps j of v[..., o*sw + j*dw - left]."""
    kw, sw, dw = window.kernel[1], window.strides[1], window.dilations[1]
    w = v.shape[2]
    taps = []
    for j in range(kw):
        shift = j * dw - left
        lo, hi = _tap_range(ow, sw, shift, w)
        taps.append((lo, hi, v[:, :, lo * sw + shift:(hi - 1) * sw + shift + 1:sw]))
    _max_taps(y, taps, lowest)


@kernel("AveragePool")
def average_pool(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES or len(attrs["kernel_shape"]) != 2 or any(
            d != 1 for d in attrs.get("dilations") or ()):
        return reference_kernel(node, attrs)
    window = _window(attrs | {"dilations": None})
    taps = _taps(window)
    include_pad = attrs["count_include_pad"]

    def run(x):
        xp, out, begin, end, reach = _geometry(x, window, 0)
        y = tap_view(xp, window, taps[0], out).copy()
        for tap in taps[1:]:
            y += tap_view(xp, window, tap, out)
        y /= _counts(x, window, out, (begin, end, reach), include_pad, taps)
        return y
    return run


def _counts(x: np.ndarray, window, out: list, pads: tuple, include_pad: int, taps: list):
    """How many positions each window averages (the reference's rule): a scalar when no
    window touches padding."""
    begin, end, reach = pads
    if not any(begin) and not any(reach):
        return x.dtype.type(len(taps))
    ones = np.ones((1, 1) + x.shape[2:], x.dtype)
    if include_pad:
        counted = pad_spatial(ones, begin, end, 1)
        counted = pad_spatial(counted, [0, 0], [r - e for r, e in zip(reach, end)], 0)
    else:
        counted = pad_spatial(ones, begin, reach, 0)
    total = np.zeros((1, 1) + tuple(out), x.dtype)
    for tap in taps:
        total += tap_view(counted, window, tap, out)
    return total


# Counts up to this are exact in float32: dividing by the count in the input's dtype then gives np.mean's bits.
_EXACT_COUNT = 1 << 24


@kernel("GlobalAveragePool")
def global_average_pool(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)

    def run(x):
        n, c = x.shape[:2]
        hw = math.prod(x.shape[2:])
        # The bits of x.reshape(n, c, -1).mean(axis=2) without mean's Python layers and its float64 division:
        # numpy's pairwise sum along the one spatial axis (contiguous in the usual layout, so it runs at full
        # speed), then the division by the count. np.mean divides by an np.intp count (a float64 loop on float32,
        # 4.5 us a call through casting buffers); float32 division by a float32 count is correctly rounded,
        # so for counts below 2^24 it gives the same bits as float64 division rounded to float32 (53 >= 2 * 24 + 2
        # bits; checked for every float32 numerator at the counts of 1x1 to 224x224 maps). hw, not -1: an empty
        # batch reshapes too.
        if hw and native.rows_ok(x):  # one native pass (its own, more exact, rounding: native.mean_rows)
            return native.mean_rows(x.reshape(n * c, hw)).reshape((n, c) + (1,) * (x.ndim - 2))
        y = np.add.reduce(x.reshape(n, c, hw), axis=2)
        if hw <= _EXACT_COUNT:
            np.true_divide(y, y.dtype.type(hw), out=y)
        else:
            np.true_divide(y, np.intp(hw), out=y, casting="unsafe")
        return y.reshape((n, c) + (1,) * (x.ndim - 2))
    return run
