"""Pooling over strided views: one max/add per kernel tap into a fresh result, instead of the
reference's window view reduced over its tap axes (which numpy walks element by element). MaxPool splits the padded
input into stride phases first (nn.phase_geometry), so every tap is a contiguous flat slice
and the maxima run at full SIMD speed, one sample at a time to stay in cache."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.ir.ops.nn import make_window, pad_spatial, static_pads, window_out_shape
from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, input_dtype
from kiln.runtime.kernels.cpu.nn import fill_phases, phase_geometry, tap_offsets, tap_view

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


@kernel("MaxPool")
def max_pool(node, attrs) -> Callable[..., Any]:
    dt = input_dtype(node)
    if dt not in MAX_DTYPES or len(attrs["kernel_shape"]) != 2 or len(node.outputs) > 1:
        return reference_kernel(node, attrs)
    window = _window(attrs)
    lowest = -np.inf if dt.kind == "f" else np.iinfo(dt).min

    def run(x):
        n, c, h, w = x.shape
        begin, out, hq, wq = phase_geometry(window, (h, w), window.kernel)
        offsets = tap_offsets(window, window.kernel, wq)
        span = out[0] * wq
        sh, sw = window.strides
        buf = np.full((c, sh * hq, sw * wq), lowest, x.dtype)   # the padding never wins a max
        y = np.empty((n, c, out[0], out[1]), x.dtype)
        for s in range(n):
            phases = fill_phases(buf, x[s], begin, (sh, sw), hq, wq)
            a, b, off = offsets[0]
            acc = phases[a, b, :, off:off + span].copy()
            for a, b, off in offsets[1:]:
                np.maximum(acc, phases[a, b, :, off:off + span], out=acc)
            y[s] = acc.reshape(c, out[0], wq)[:, :, :out[1]]
        return y
    return run


@kernel("AveragePool")
def average_pool(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES or len(attrs["kernel_shape"]) != 2:
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


@kernel("GlobalAveragePool")
def global_average_pool(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)

    def run(x):
        n, c = x.shape[:2]
        # One contiguous axis: numpy's pairwise sum runs along it at full speed.
        y = x.reshape(n, c, -1).mean(axis=2)
        return y.reshape((n, c) + (1,) * (x.ndim - 2))
    return run
