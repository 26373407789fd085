"""Conv: 2-D convolutions as GEMMs over an im2col buffer, 1x1 convs as one GEMM on a view,
depthwise convs as a sum over kernel taps of shifted views times per-channel weights.

Weights are constants in a loaded model, so their GEMM layout ([group, M/g, C/g*kh*kw]) is made
once in the factory. Anything else (1-D/3-D, narrow floats, computed weights) runs the
reference. float32 products go through BLAS in float32, as the reference does.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.runtime.kernels.cpu.linalg import BLAS_DTYPES, const_input, input_dtype


@kernel("Conv")
def conv(node, attrs) -> Callable[..., Any]:
    w = const_input(node, 1)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = const_input(node, 2)
    if input_dtype(node) not in BLAS_DTYPES or w is None or w.ndim != 4 or (has_bias and bias is None):
        return reference_kernel(node, attrs)
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    group = attrs["group"]
    m = w.shape[0]
    bias_col = None if bias is None else bias.reshape(m, 1)
    if group == m and w.shape[1] == 1 and group > 1:
        body = _depthwise(w, window)
    elif w.shape[2:] == (1, 1) and group == 1 and window.pads == (0,) * 4 and window.auto_pad == "NOTSET":
        body = _pointwise(w, window)
    else:
        body = _im2col(w, window, group)

    def run(x, w_unused, b_unused=None):
        y = body(x)  # fresh [N, M, OH, OW]
        if bias_col is not None:
            y3 = y.reshape(y.shape[0], m, -1)
            y3 += bias_col
        return y
    return run


def _padded(x: np.ndarray, window, fill: float = 0) -> tuple:
    """(x padded as the window asks, output spatial sizes); np.pad only when pads are non-zero."""
    sizes = x.shape[2:]
    begin, end, reach = static_pads(window, sizes)
    out = window_out_shape(window, sizes)
    if any(begin) or any(reach):
        widths = [(0, 0), (0, 0)] + list(zip(begin, reach))
        x = np.pad(x, widths, constant_values=fill)
    return x, out


def tap_view(xp: np.ndarray, window, tap: tuple, out: list) -> np.ndarray:
    """The [N, C, OH, OW] strided view of ``xp`` that kernel tap (i, j) multiplies."""
    (i, j), (sh, sw), (dh, dw) = tap, window.strides, window.dilations
    return xp[:, :, i * dh: i * dh + sh * (out[0] - 1) + 1: sh, j * dw: j * dw + sw * (out[1] - 1) + 1: sw]


def _pointwise(w: np.ndarray, window) -> Callable:
    w2 = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]))
    sh, sw = window.strides

    def run(x):
        if (sh, sw) != (1, 1):
            x = x[:, :, ::sh, ::sw]
        n, c, h, wd = x.shape
        return np.matmul(w2, x.reshape(n, c, h * wd)).reshape(n, -1, h, wd)
    return run


def _im2col(w: np.ndarray, window, group: int) -> Callable:
    m, c_g, kh, kw = w.shape
    wg = np.ascontiguousarray(w.reshape(group, m // group, c_g * kh * kw))
    taps = [(i, j) for i in range(kh) for j in range(kw)]

    def run(x):
        xp, out = _padded(x, window)
        n, c = x.shape[:2]
        # Columns laid out [N, C, kh, kw, OH, OW]: per group a [C/g*kh*kw, OH*OW] matrix, no transpose.
        cols = np.empty((n, c, kh, kw, out[0], out[1]), x.dtype)
        for i, j in taps:
            cols[:, :, i, j] = tap_view(xp, window, (i, j), out)
        y = np.matmul(wg, cols.reshape(n, group, c_g * kh * kw, out[0] * out[1]))
        return y.reshape(n, m, out[0], out[1])
    return run


def _depthwise(w: np.ndarray, window) -> Callable:
    c, _, kh, kw = w.shape
    per_tap = [(i, j, np.ascontiguousarray(w[:, 0, i, j]).reshape(c, 1, 1)) for i in range(kh) for j in range(kw)]

    def run(x):
        xp, out = _padded(x, window)
        first_i, first_j, first_w = per_tap[0]
        y = np.multiply(tap_view(xp, window, (first_i, first_j), out), first_w)
        tmp = np.empty_like(y)
        for i, j, wt in per_tap[1:]:
            np.multiply(tap_view(xp, window, (i, j), out), wt, out=tmp)
            y += tmp
        return y
    return run
