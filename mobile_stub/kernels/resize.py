"""Resize (ONNX Resize-19, every mode and attribute), float32, and uint8/int8 (images, masks).

The same per-axis description as kiln.ir.ops.resize, written again here because a bundle may not
import kiln.ir: for every output index of a resized axis, its input indices ("taps") and weights,
applied one axis at a time with ``np.take``. tests/mobile/test_resize.py checks it against the IR
reference mode by mode. The output view fixes the output shape (pack made every shape static), so
``sizes``/``scales`` only set the coordinate scale. Temporaries: the float64 working copy and
one intermediate per resized axis; integers round half to even and saturate, as the reference.
"""
from __future__ import annotations

import math

import numpy as np


def _given(a):
    return a is not None and a.size > 0


def _geometry(x, y, ins, attrs):
    """Per axis of x: (scale, roi pair or None) and the axes the op resizes."""
    rank = x.ndim
    axes = [int(a) % rank for a in attrs.get("axes") or range(rank)]
    roi, scales, sizes = (list(ins[1:]) + [None] * 3)[:3]
    scale = [1.0] * rank
    if _given(scales):
        for a, s in zip(axes, np.asarray(scales, np.float32).reshape(-1)):
            scale[a] = float(s)
    else:
        ratios = [int(s) / x.shape[a] for a, s in zip(axes, np.asarray(sizes).reshape(-1))]
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            ratios = [min(ratios) if policy == "not_larger" else max(ratios)] * len(axes)
        for a, r in zip(axes, ratios):
            scale[a] = r
    pairs = [None] * rank
    if _given(roi):
        r = list(np.asarray(roi).reshape(-1))  # in the roi's dtype, as the reference computes
        for j, a in enumerate(axes):
            pairs[a] = (r[j], r[j + len(axes)])
    return scale, pairs


def _coordinates(n_in, n_out, scale, mode, roi):
    y = np.arange(n_out, dtype=np.float64)
    width = scale * n_in
    if mode == "asymmetric":
        return y / scale, None
    if mode == "pytorch_half_pixel":
        return (np.full(n_out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "align_corners":
        return (np.zeros(n_out) if width == 1 else y * (n_in - 1) / (width - 1)), None
    if mode == "half_pixel_symmetric":
        return n_in / 2 * (1 - n_out / width) + (y + 0.5) / scale - 0.5, None
    if mode == "tf_crop_and_resize":
        start, end = roi if roi is not None else (0.0, 1.0)
        x = np.full(n_out, (end - start) * (n_in - 1) / 2) if width == 1 else \
            y * (end - start) * (n_in - 1) / (width - 1)
        x = x + start * (n_in - 1)
        return x, (x < 0) | (x > n_in - 1)
    return (y + 0.5) / scale - 0.5, None  # half_pixel


def _keys(d, a):
    near = (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    far = a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _taps(n_in, n_out, scale, attrs, roi):
    """(index [out, taps], weight [out, taps] or None for nearest, outside mask or None)."""
    x, outside = _coordinates(n_in, n_out, scale, attrs.get("coordinate_transformation_mode", "half_pixel"), roi)
    floor = np.floor(x)
    mode = attrs.get("mode", "nearest")
    if mode == "nearest":
        frac = x - floor
        rule = attrs.get("nearest_mode", "round_prefer_floor")
        up = {"round_prefer_floor": frac > 0.5, "round_prefer_ceil": frac >= 0.5, "floor": frac < 0,
              "ceil": frac > 0}[rule]
        return np.clip(floor.astype(np.int64) + up, 0, n_in - 1)[:, None], None, outside
    aa = bool(attrs.get("antialias", 0))
    stretch = min(scale, 1.0) if aa else 1.0
    if mode == "linear":
        n = 2 - 2 * int(math.floor(-1 / stretch) + 1) if aa else 2
        kernel = lambda d: np.clip(1 - d, 0, None)  # noqa: E731
    else:
        n = 2 - 2 * int(math.floor(-2 / stretch) + 1) if aa else 4
        a = float(attrs.get("cubic_coeff_a", -0.75))
        kernel = lambda d: _keys(d, a)  # noqa: E731
    first = np.where(x == floor, floor - n // 2, floor - n // 2 + 1).astype(np.int64)
    index = first[:, None] + np.arange(n)
    weight = kernel(np.abs(index - x[:, None]) * stretch)
    if aa:
        weight = weight / weight.sum(axis=1, keepdims=True)
    if attrs.get("exclude_outside", 0):
        weight = np.where((index < 0) | (index >= n_in), 0.0, weight)
        total = weight.sum(axis=1, keepdims=True)
        weight = weight / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, n_in - 1), weight, outside


def resize(ins, outs, attrs):
    x, y = ins[0], outs[0]
    scale, pairs = _geometry(x, y, ins, attrs)
    z = x.astype(np.float64)
    fills = []
    for a in range(x.ndim):
        whole = pairs[a] is None or (abs(float(pairs[a][0])) < 1e-9 and math.isclose(float(pairs[a][1]), 1.0))
        if math.isclose(scale[a], 1.0) and y.shape[a] == x.shape[a] and whole:
            continue
        if y.shape[a] == 0 or x.shape[a] == 0:
            continue
        index, weight, outside = _taps(x.shape[a], y.shape[a], scale[a], attrs, pairs[a])
        if weight is None:
            z = np.take(z, index[:, 0], axis=a)
        else:
            shape = [1] * z.ndim
            shape[a] = y.shape[a]
            z = sum(np.take(z, index[:, t], axis=a) * weight[:, t].reshape(shape) for t in range(index.shape[1]))
        if outside is not None and outside.any():
            fills.append((a, np.flatnonzero(outside)))
    z = np.array(z, copy=True).reshape(y.shape) if fills else z.reshape(y.shape)
    for a, where in fills:
        idx = [slice(None)] * z.ndim
        idx[a] = where
        z[tuple(idx)] = attrs.get("extrapolation_value", 0.0)
    if y.dtype.kind in "iu":
        info = np.iinfo(y.dtype)
        z = np.clip(np.round(z), info.min, info.max)
    np.copyto(y, z, casting="unsafe")


KERNELS = {"Resize": resize}
SUPPORTS = {"Resize": {"float32", "uint8", "int8"}}
