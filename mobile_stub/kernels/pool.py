"""MaxPool, AveragePool (2-D), GlobalAveragePool, GlobalMaxPool, float32.

Windows come from the conv module's strided view; the reduction writes into the output view.
Temporaries: the padded input when pads are set, and for AveragePool with pads the per-window
divisor (output-sized). ceil_mode is supported by padding the end far enough for the last window.
"""
from __future__ import annotations

import numpy as np

from kiln.mobile_stub.kernels.conv import _pads, windows


def _geometry(x, y, attrs):
    kernel = tuple(attrs["kernel_shape"])
    strides = tuple(attrs.get("strides") or (1,) * len(kernel))
    dilations = tuple(attrs.get("dilations") or (1,) * len(kernel))
    begin, end = _pads(attrs, x.shape[2:], kernel, strides, dilations)
    # Pad the end so that exactly y's windows fit (ceil_mode's partial last window included).
    reach = [(o - 1) * s + (k - 1) * d + 1 - size - b
             for o, s, k, d, size, b in zip(y.shape[2:], strides, kernel, dilations, x.shape[2:], begin)]
    return kernel, strides, dilations, begin, end, [max(r, 0) for r in reach]


def _sizes_2d(x, y):
    if x.ndim == 3:
        return x[:, :, None, :], y[:, :, None, :], True
    if x.ndim != 4:
        raise NotImplementedError(f"the mobile pool kernels run 1-D and 2-D pools, not {x.ndim - 2}-D")
    return x, y, False


def _lift(attrs):
    a = dict(attrs)
    a["kernel_shape"] = (1,) + tuple(a["kernel_shape"])
    for k in ("strides", "dilations"):
        if a.get(k):
            a[k] = (1,) + tuple(a[k])
    if a.get("pads"):
        a["pads"] = (0, a["pads"][0], 0, a["pads"][1])
    return a


def max_pool(ins, outs, attrs):
    x, y, lifted = _sizes_2d(ins[0], outs[0])
    attrs = _lift(attrs) if lifted else attrs
    kernel, strides, dilations, begin, _, reach = _geometry(x, y, attrs)
    cols = windows(x, kernel, strides, dilations, begin, reach, fill=-np.inf, expect=y.shape[2:])
    np.max(cols, axis=(2, 3), out=y)


def average_pool(ins, outs, attrs):
    x, y, lifted = _sizes_2d(ins[0], outs[0])
    attrs = _lift(attrs) if lifted else attrs
    kernel, strides, dilations, begin, end, reach = _geometry(x, y, attrs)
    cols = windows(x, kernel, strides, dilations, begin, reach, expect=y.shape[2:])
    np.sum(cols, axis=(2, 3), out=y)
    if not any(begin) and not any(reach):
        y /= np.float32(kernel[0] * kernel[1])
        return
    # The divisor: the positions each window covers (pads count with count_include_pad, ceil's extra never).
    ones = np.ones((1, 1) + x.shape[2:], np.float32)
    if attrs.get("count_include_pad", 0):
        ones = np.pad(ones, [(0, 0), (0, 0)] + [(b, e) for b, e in zip(begin, end)], constant_values=1)
        counts = windows(ones, kernel, strides, dilations, [0, 0], [max(r - e, 0) for r, e in zip(reach, end)],
                         expect=y.shape[2:])
    else:
        counts = windows(ones, kernel, strides, dilations, begin, reach, expect=y.shape[2:])
    y /= counts.sum(axis=(2, 3))


def global_average_pool(ins, outs, attrs):
    x = ins[0]
    np.mean(x, axis=tuple(range(2, x.ndim)), keepdims=True, out=outs[0])


def global_max_pool(ins, outs, attrs):
    x = ins[0]
    np.max(x, axis=tuple(range(2, x.ndim)), keepdims=True, out=outs[0])


KERNELS = {"MaxPool": max_pool, "AveragePool": average_pool, "GlobalAveragePool": global_average_pool,
           "GlobalMaxPool": global_max_pool}
SUPPORTS = {op: {"float32"} for op in KERNELS}
