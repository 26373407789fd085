"""Convolution, pooling, normalizations and softmax on the GPU with CuPy.

Conv (2-D) has two paths. The CuPy-only one is im2col + cuBLAS: the padded input is viewed as
[N, C, kh, kw, OH, OW] windows through strides (no per-tap loop), copied once into the column
buffer, and multiplied by the weights ([group, M/group, C/group*kh*kw], prepared at load) in
one batched GEMM; a 1x1 conv with no padding is one GEMM on a view. The other is cuDNN through
nvidia-cudnn-frontend (cudnn.py: float32, bias fused, TF32 engines deselected unless allowed),
used where that library imports and passes its self-test. Which one runs is decided per
convolution shape (input shape, weight shape, pads, strides, dilations, group, bias) the
first time it is seen outside a stream capture. In the default "auto" mode the rule is by
batch: cuDNN from ``CUDNN_MIN_BATCH`` samples up (on an H200 it ran ResNet-50's convolution
classes 1.3-2.4x faster than im2col at batch 32), im2col below it. Timing both paths per shape
on first use was tried and dropped: at batch 1 both times are host and launch overhead, which
picked cuDNN everywhere and made ResNet-50 at batch 1 under CUDA graphs 1.1 -> 2.1 ms.
``CONV_CHOICES`` records each shape's decision; a shape cuDNN refuses stays on im2col. ``cudnn.set_mode`` (or
KILN_CUDA_CONV=cudnn|im2col) forces one path. While a stream is capturing, an undecided shape
runs im2col (nothing is built or timed inside a capture), and so does every shape if cuDNN's
execute failed the capture probe. Pools reduce the same window view.
Softmax, LogSoftmax (last axis) and LayerNormalization (float32/float64) are one fused kernel
each (rowwise.py); other axes, InstanceNormalization and other dtypes are a few CuPy passes.

Kernels that keep their own device copy of a constant input (Conv's reshaped weights, the
folded BatchNorm) say which input positions they never read in ``run.ignores``: CudaProgram
then skips uploading that constant unless another node reads it, so weights are held once.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np
from cupy.lib.stride_tricks import as_strided

from kiln.ir.dtypes import DType
from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.ir.types import normalize_axis
from kiln.runtime.kernels.cuda import FLOATS, const_input, in_dtype, kernel
from kiln.runtime.kernels.cuda import cudnn, rowwise
from kiln.runtime.kernels.cuda.linalg import cublas_matmul


def _windows(x, window, fill) -> tuple:
    """([N, C, kh, kw, OH, OW] strided window view of the padded ``x``, [OH, OW])."""
    n, c, h, w = x.shape
    begin, _, reach = static_pads(window, (h, w))
    out = window_out_shape(window, (h, w))
    if any(begin) or any(reach):
        x = cp.pad(x, ((0, 0), (0, 0), (begin[0], max(reach[0], 0)), (begin[1], max(reach[1], 0))),
                   constant_values=fill)
    x = cp.ascontiguousarray(x)
    sn, sc, sh_, sw_ = x.strides
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.strides, window.dilations
    view = as_strided(x, (n, c, kh, kw, out[0], out[1]), (sn, sc, dh * sh_, dw * sw_, sh * sh_, sw * sw_))
    return view, out


# (x shape, w shape, pads, strides, dilations, group, bias) -> {"path": "cudnn"|"im2col",
# "cudnn_ms", "im2col_ms", "why"}: the auto mode's decisions, shared by every Conv of that shape.
CONV_CHOICES: dict = {}
# The auto mode's rule: cuDNN for convolutions of at least this many samples (module docstring).
CUDNN_MIN_BATCH = 8


@kernel("Conv")
def conv(node, attrs) -> Optional[Callable[..., Any]]:
    w = const_input(node, 1)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = const_input(node, 2)
    if in_dtype(node) not in FLOATS or w is None or w.ndim != 4 or (has_bias and bias is None):
        return None
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    group = attrs["group"]
    m, cg, kh, kw = w.shape
    bias_d = None if bias is None else cp.asarray(bias.reshape(1, m, 1, 1))
    pointwise = (kh, kw) == (1, 1) and group == 1 and not any(window.pads) and window.auto_pad == "NOTSET" \
        and window.strides == (1, 1)
    depthwise = group == m and cg == 1 and group > 1
    if pointwise:
        w2 = cp.asarray(np.ascontiguousarray(w.reshape(m, cg)))
    elif depthwise:
        wdw = cp.asarray(np.ascontiguousarray(w.reshape(1, m, kh, kw, 1, 1)))
    else:
        wg = cp.asarray(np.ascontiguousarray(w.reshape(group, m // group, cg * kh * kw)))
    exe = None
    if in_dtype(node) == np.float32 and cudnn.mode() != "im2col" and cudnn.available():
        exe = cudnn.Executor(cp.asarray(np.ascontiguousarray(w)), bias_d, window.strides, window.dilations)

    def im2col(x):
        n, c, h, wd = x.shape
        if pointwise:
            y = cublas_matmul(w2, x.reshape(n, c, h * wd)).reshape(n, m, h, wd)
        else:
            view, out = _windows(x, window, 0)
            if depthwise:
                y = (view * wdw).sum(axis=(2, 3))
            else:
                cols = cp.ascontiguousarray(view).reshape(n, group, cg * kh * kw, out[0] * out[1])
                y = cublas_matmul(wg, cols).reshape(n, m, out[0], out[1])
        if bias_d is not None:
            y += bias_d
        return y

    def decide(key, x, pre, post, out) -> str:
        """The path for this shape: cuDNN where it builds and (in auto mode) is faster."""
        entry = {"path": "im2col"}
        try:
            entry["fused_bias"] = exe.plan_for(x.shape, pre, post).fused_bias
            if cudnn.mode() == "cudnn" or x.shape[0] >= CUDNN_MIN_BATCH:
                entry["path"] = "cudnn"
            else:
                entry["why"] = f"batch {x.shape[0]} < {CUDNN_MIN_BATCH}: im2col (see the module docstring)"
        except cudnn.Unsupported as e:
            entry["why"] = str(e)
        CONV_CHOICES[key] = entry
        return entry["path"]

    def run(x, w_unused, b_unused=None):
        if exe is not None and x.dtype == np.float32 and x.ndim == 4:
            begin, end, _ = static_pads(window, x.shape[2:])
            out = window_out_shape(window, x.shape[2:])
            key = (x.shape, w.shape, tuple(begin), tuple(end), window.strides, window.dilations, group,
                   bias_d is not None)
            entry = CONV_CHOICES.get(key)
            if cudnn.capturing():
                path = entry["path"] if entry is not None and cudnn.capture_ok() else "im2col"
            else:
                path = entry["path"] if entry is not None else decide(key, x, begin, end, out)
            if path == "cudnn":
                try:
                    return exe(x, begin, end, out)
                except cudnn.Unsupported:  # e.g. a plan first needed inside a capture
                    pass
        return im2col(x)
    run.ignores = (1, 2)  # the weights and bias are read from the copies prepared above
    return run


def _pool_window(attrs: dict, dilations=True):
    return make_window(attrs["kernel_shape"], strides=attrs["strides"],
                       dilations=attrs.get("dilations") if dilations else None,
                       pads=attrs["pads"], auto_pad=attrs["auto_pad"], ceil_mode=attrs["ceil_mode"])


@kernel("MaxPool")
def max_pool(node, attrs) -> Optional[Callable[..., Any]]:
    dt = in_dtype(node)
    if dt is None or dt.kind not in "fiu" or dt.itemsize < 4 and dt.kind == "f" or \
            len(attrs["kernel_shape"]) != 2 or len(node.outputs) > 1:
        return None
    window = _pool_window(attrs)
    lowest = -np.inf if dt.kind == "f" else np.iinfo(dt).min

    def run(x):
        view, out = _windows(x, window, lowest)
        return view.max(axis=(2, 3))
    return run


@kernel("AveragePool")
def average_pool(node, attrs) -> Optional[Callable[..., Any]]:
    if in_dtype(node) not in FLOATS or len(attrs["kernel_shape"]) != 2:
        return None
    from kiln.runtime.kernels.cpu.pool import _counts, _taps
    window = _pool_window(attrs, dilations=False)
    taps = _taps(window)
    include_pad = attrs["count_include_pad"]
    counts: dict = {}

    def run(x):
        view, out = _windows(x, window, 0)
        key = (x.shape[2:], x.dtype)
        if key not in counts:
            begin, end, reach = static_pads(window, x.shape[2:])
            c = _counts(np.empty((1, 1) + x.shape[2:], x.dtype), window, out, (begin, end, reach), include_pad, taps)
            counts[key] = cp.asarray(c)
        return view.sum(axis=(2, 3)) / counts[key]
    return run


@kernel("GlobalAveragePool")
def global_average_pool(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    return lambda x: x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)


@kernel("GlobalMaxPool")
def global_max_pool(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    return lambda x: x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


@kernel("BatchNormalization")
def batch_norm(node, attrs):
    stats = [const_input(node, i) for i in range(1, 5)]
    dt = in_dtype(node)
    if dt not in FLOATS or any(s is None for s in stats) or len(node.outputs) > 1 or attrs["training_mode"]:
        return None
    scale, b, mean, var = (s.astype(dt) for s in stats)
    k = scale / np.sqrt(var + dt.type(attrs["epsilon"]))
    t = b - mean * k
    kd, td = cp.asarray(k), cp.asarray(t)

    def run(x, *unused):
        shape = (-1,) + (1,) * (x.ndim - 2)
        y = x * kd.reshape(shape)
        y += td.reshape(shape)
        return y
    run.ignores = (1, 2, 3, 4)
    return run


@kernel("LayerNormalization")
def layer_norm(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    eps = attrs["epsilon"]
    stash = DType(attrs["stash_type"]).numpy
    n_out = len(node.outputs)

    def run(x, scale, b=None):
        if x.dtype in FLOATS and scale.dtype == x.dtype and (b is None or b.dtype == x.dtype):
            axis = normalize_axis(attrs["axis"], x.ndim)
            out = rowwise.layer_norm(x, scale, b, axis, eps, stats=n_out > 1)
            if n_out > 1:
                y, mean, inv_std = out
                return (y, mean.astype(stash, copy=False), inv_std.astype(stash, copy=False))[:n_out]
            return out
        axes = tuple(range(normalize_axis(attrs["axis"], x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        inv_std = 1.0 / cp.sqrt(cp.square(d).mean(axis=axes, keepdims=True) + x.dtype.type(eps))
        d *= inv_std
        d *= scale
        if b is not None:
            d += b
        if n_out > 1:
            return (d, mean.astype(stash), inv_std.astype(stash))[:n_out]
        return d
    return run


@kernel("InstanceNormalization")
def instance_norm(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    eps = attrs["epsilon"]

    def run(x, scale, b):
        axes = tuple(range(2, x.ndim))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        var = cp.square(d).mean(axis=axes, keepdims=True)
        d /= cp.sqrt(var + x.dtype.type(eps))
        d *= scale.reshape(shape)
        d += b.reshape(shape)
        return d
    return run


@kernel("Softmax")
def softmax(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    axis = attrs["axis"]

    def run(x):
        if x.ndim and normalize_axis(axis, x.ndim) == x.ndim - 1 and x.dtype in FLOATS:
            return rowwise.softmax_last(x)
        y = x - x.max(axis=axis, keepdims=True)
        cp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        return y
    return run


@kernel("LogSoftmax")
def log_softmax(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    axis = attrs["axis"]

    def run(x):
        if x.ndim and normalize_axis(axis, x.ndim) == x.ndim - 1 and x.dtype in FLOATS:
            return rowwise.softmax_last(x, log=True)
        s = x - x.max(axis=axis, keepdims=True)
        s -= cp.log(cp.exp(s).sum(axis=axis, keepdims=True))
        return s
    return run
