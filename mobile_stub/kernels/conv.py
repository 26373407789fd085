"""Conv (1-D and 2-D; grouped and depthwise), float32, with a float or an int8 per-channel weight.

A strided view over the (padded) input gives every window without copying ([N, C, kh, kw, oh, ow]).
Depthwise convs (one input channel per group) accumulate one multiply per kernel tap into the output
view; other convs reshape each group's windows into an im2col matrix and matmul into the output view.
Temporaries: the padded input when pads are non-zero, the im2col matrix unless the conv is 1x1 with
stride 1, one output-sized product per tap for depthwise, and for an int8 weight its float32 cast
(the per-output-channel scale multiplies the output, not the weight).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kiln.mobile_stub.kernels import QWeight


def _pads(attrs, sizes, kernel, strides, dilations):
    """(begin, end) pads per spatial dim, resolving auto_pad like ONNX."""
    auto = attrs.get("auto_pad", "NOTSET")
    n = len(sizes)
    if auto in ("NOTSET", "", None):
        p = list(attrs.get("pads") or [0] * 2 * n)
        return p[:n], p[n:]
    if auto == "VALID":
        return [0] * n, [0] * n
    begin, end = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(big if auto == "SAME_LOWER" else small)
        end.append(small if auto == "SAME_LOWER" else big)
    return begin, end


MAX_PADDED_FLOOR = 1 << 20  # elements a padded copy may always have (tiny inputs with large pads)


def windows(x, kernel, strides, dilations, begin, end, fill=0.0, expect=None):
    """[N, C, *k, *out] strided view of x padded with ``fill`` (a padded copy only when pads are set).
    2-D only: 1-D callers add a unit height. ``expect``: the output's spatial shape, checked against the
    attributes before the padded copy is made (a file's pads cannot make the kernel allocate more than
    its declared output implies)."""
    geometry = (tuple(kernel), tuple(strides), tuple(dilations), tuple(begin), tuple(end))
    if any(len(g) != 2 for g in geometry) or min(kernel) < 1 or min(strides) < 1 or min(dilations) < 1 \
            or min(begin) < 0 or min(end) < 0:
        raise ValueError(f"bad window geometry: kernel {list(kernel)}, strides {list(strides)}, dilations "
                         f"{list(dilations)}, pads {list(begin) + list(end)}")
    # The padded copy is the one allocation the attributes size: bounded by the input (a file's pads
    # cannot ask for gigabytes to make a few outputs). Real pads add a few rows and columns.
    padded = x.shape[0] * x.shape[1]
    for s, b, e in zip(x.shape[2:], begin, end):
        padded *= s + b + e
    if (any(begin) or any(end)) and padded > max(16 * x.size, MAX_PADDED_FLOOR):
        raise ValueError(f"pads {list(begin) + list(end)} would make a padded copy of {padded:,} elements from "
                         f"an input of {x.size:,} (kernel {list(kernel)})")
    out = [(s + b + e - (k - 1) * d - 1) // st + 1
           for s, b, e, k, d, st in zip(x.shape[2:], begin, end, kernel, dilations, strides)]
    if expect is not None and tuple(out) != tuple(expect) or min(out) < 1:
        raise ValueError(f"kernel {list(kernel)}, strides {list(strides)}, dilations {list(dilations)} and pads "
                         f"{list(begin) + list(end)} over {list(x.shape[2:])} make {out}, the output is "
                         f"{list(expect) if expect is not None else '?'}")
    if any(begin) or any(end):
        xp = np.full(x.shape[:2] + tuple(s + b + e for s, b, e in zip(x.shape[2:], begin, end)), fill, x.dtype)
        xp[(slice(None), slice(None)) + tuple(slice(b, b + s) for b, s in zip(begin, x.shape[2:]))] = x
        x = xp
    out = [(s - (k - 1) * d - 1) // st + 1 for s, k, d, st in zip(x.shape[2:], kernel, dilations, strides)]
    sn, sc, sh, sw = x.strides
    (dh, dw), (th, tw) = dilations, strides
    return as_strided(x, x.shape[:2] + tuple(kernel) + tuple(out), (sn, sc, sh * dh, sw * dw, sh * th, sw * tw),
                      writeable=False)


def conv(ins, outs, attrs):
    x, w, b = (list(ins) + [None, None])[:3]
    y = outs[0]
    if x.ndim == 3:  # 1-D: run as 2-D with a unit height
        x, y = x[:, :, None, :], y[:, :, None, :]
        w = QWeight(w.q[:, :, None, :], w.scale, w.axis) if isinstance(w, QWeight) else w[:, :, None, :]
        attrs = _as_2d(attrs)
    if x.ndim != 4:
        raise NotImplementedError(f"the mobile Conv kernel runs 1-D and 2-D convs, not {x.ndim - 2}-D")
    quant = isinstance(w, QWeight) and w.axis == 0
    wq = w.q if quant else (w.dequantize() if isinstance(w, QWeight) else w)
    kernel = tuple(wq.shape[2:])
    strides = tuple(attrs.get("strides") or (1, 1))
    dilations = tuple(attrs.get("dilations") or (1, 1))
    group = attrs.get("group", 1)
    begin, end = _pads(attrs, x.shape[2:], kernel, strides, dilations)
    cols = windows(x, kernel, strides, dilations, begin, end, expect=y.shape[2:])
    n, c = x.shape[:2]
    m, c_g = wq.shape[:2]
    m_g = m // group
    if c_g == 1 and m_g == 1:  # depthwise
        wf = wq.astype(np.float32) if quant else wq
        tmp = np.empty_like(y)
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                dst = y if i == j == 0 else tmp
                np.multiply(cols[:, :, i, j], wf[None, :, 0, i, j, None, None], out=dst)
                if dst is tmp:
                    y += tmp
    else:
        p = y.shape[2] * y.shape[3]
        yf = y.reshape(n, m, p)  # y is a contiguous arena view: this reshape is a view
        taps = c_g * kernel[0] * kernel[1]
        for g in range(group):
            cg = cols[:, g * c_g:(g + 1) * c_g].reshape(n, taps, p)  # im2col (a view for 1x1 stride 1)
            wg = wq[g * m_g:(g + 1) * m_g].reshape(m_g, taps)
            np.matmul(wg.astype(np.float32) if quant else wg, cg, out=yf[:, g * m_g:(g + 1) * m_g])
    if quant:
        y *= w.scale[:, None, None]
    if b is not None:
        y += b[:, None, None]


def _as_2d(attrs):
    a = dict(attrs)
    for k, unit in (("strides", 1), ("dilations", 1)):
        if a.get(k):
            a[k] = (unit,) + tuple(a[k])
    if a.get("pads"):
        a["pads"] = (0, a["pads"][0], 0, a["pads"][1])
    return a


KERNELS = {"Conv": conv}
SUPPORTS = {"Conv": {"float32"}}
