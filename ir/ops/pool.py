"""Pooling: MaxPool, AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool, GlobalLpPool, MaxRoiPool (ONNX semantics).

The window geometry (pads, auto_pad, ceil_mode) is the one Conv uses, from kiln.ir.ops.nn.
Padded positions never win a max and, for AveragePool, count in the divisor only with
count_include_pad=1; the extra positions a ceil_mode window reaches past the pads never count.

``GlobalLpPool`` (ai.onnx 2; 22 only adds bfloat16): (sum of |x|^p over every spatial dim)^(1/p), the spatial
dims kept as size 1, computed as ONNX Runtime does (and as LpPool with the whole map as its window in ONNX's
reference evaluator, which has no GlobalLpPool). ``p`` is an integer; 0 is refused (1/p), a negative p is the
same formula.

``MaxRoiPool`` (ai.onnx 1; 22 only adds bfloat16): X [N, C, H, W], rois [R, 5] rows [batch_index, x1, y1, x2,
y2] -> Y [R, C, pooled_h, pooled_w], Caffe's ROIPool as ONNX Runtime's CPU kernel computes it (ONNX's reference
evaluator has no MaxRoiPool): the batch index truncates toward zero and must lie in [0, N); each coordinate is
scaled by ``spatial_scale`` (in the rois' type, float32 for the narrow types) and rounded half away from zero;
the RoI spans rows y1..y2 and columns x1..x2 inclusive, at least 1x1 (a malformed RoI becomes 1x1); bin i of
``pooled`` bins over a RoI of ``size`` covers [floor(i * size / pooled), ceil((i + 1) * size / pooled)) from
its start, computed in float32 as ONNX Runtime does, clipped to the map; a bin left empty (all outside) is 0.
The max propagates NaN (ONNX Runtime's scan keeps or drops a NaN depending on where it lies in the bin). A
non-finite RoI, or one whose rounded coordinates leave int32 (where ONNX Runtime's int conversion is
undefined), is an error.
"""
from __future__ import annotations

import math

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.ops.nn import Window, make_window, pad_spatial, static_pads, window_out_shape, windows
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType, dims_compatible

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


def infer_max_pool(ctx: InferContext) -> list:
    """Y as every pool; the optional Indices (int64) has Y's shape."""
    if ctx.attrs["storage_order"] not in (0, 1):
        ctx.fail(f"storage_order must be 0 (row major) or 1 (column major), got {ctx.attrs['storage_order']}")
    y = infer_pool(ctx)
    return [y, TensorType(DType.INT64, y.shape)][:ctx.num_outputs]


def _lowest(dtype: np.dtype) -> float:
    return -np.inf if dtype.kind not in "iu" else np.iinfo(dtype).min


def max_pool_values(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, dilations=None) -> tuple:
    """(Y, the window view Y was reduced from, the window, (begin, end, reach, out))."""
    attrs = {"auto_pad": auto_pad, "ceil_mode": ceil_mode, "kernel_shape": kernel_shape,
             "pads": pads, "strides": strides, "dilations": dilations}
    cols, window, geometry = _pool_views(x, attrs, _lowest(x.dtype))
    return cols.max(axis=tuple(range(-window.rank, 0))).astype(x.dtype), cols, window, geometry


def max_pool_indices(x: np.ndarray, y: np.ndarray, cols: np.ndarray, window: Window, geometry: tuple,
                     storage_order: int) -> np.ndarray:
    """Where each maximum was read, as ONNX's MaxPool Indices output: the flat index into X of the
    first window position (in row-major window order) that holds Y, padding never counted; the
    spatial part row major (storage_order 0) or column major (1), the [N, C] part always row major,
    so an index lies in [0, N*C*D1*...*Dn). A NaN maximum points at the window's first NaN, a
    window with no input position at all (only padding) at -1."""
    rank = window.rank
    sizes = x.shape[2:]
    begin, _, _, out = geometry
    # Whether (output position o, tap t) reads an input position, from its coordinate o*s - begin + t*d
    # along each spatial axis, shaped to broadcast against cols [N, C, *out, *kernel].
    valid = np.ones((1, 1) + tuple(out) + tuple(window.kernel), bool)
    for i in range(rank):
        shape = [1] * (2 + 2 * rank)
        shape[2 + i], shape[2 + rank + i] = out[i], window.kernel[i]
        c = (np.arange(out[i])[:, None] * window.strides[i] - begin[i]
             + np.arange(window.kernel[i])[None, :] * window.dilations[i]).reshape(shape)
        valid = valid & (c >= 0) & (c < sizes[i])
    taps = tuple(range(-rank, 0))
    peak = np.expand_dims(y, taps)
    hit = cols == peak
    if x.dtype.kind not in "iub":
        hit |= np.isnan(cols) & np.isnan(peak)
    hit &= valid
    flat = hit.reshape(hit.shape[:2 + rank] + (int(np.prod(window.kernel)),))
    tap = flat.argmax(axis=-1)
    found = np.take_along_axis(flat, tap[..., None], axis=-1)[..., 0]
    # The tap's coordinate along each axis, then the spatial offset in the storage order asked for.
    tap_coords = np.unravel_index(tap, window.kernel)
    spatial = np.zeros(tap.shape, np.int64)
    order = range(rank) if storage_order == 0 else reversed(range(rank))
    for i in order:
        o = np.arange(out[i]).reshape([-1 if j == 2 + i else 1 for j in range(2 + rank)])
        at = o * window.strides[i] - begin[i] + tap_coords[i] * window.dilations[i]
        spatial = spatial * sizes[i] + at
    n, c = x.shape[:2]
    plane = np.arange(n * c, dtype=np.int64).reshape(n, c, *([1] * rank)) * int(np.prod(sizes, dtype=np.int64))
    return np.where(found, plane + spatial, -1).astype(np.int64)


@op("MaxPool", inputs=[In("X", MAXPOOL_T)],
    outputs=[Out("Y", MAXPOOL_T), Out("Indices", {DType.INT64}, optional=True)],
    attrs=_POOL_ATTRS + [Attr("dilations", AttrKind.INTS, None), Attr("storage_order", AttrKind.INT, 0)],
    infer=infer_max_pool)
def max_pool(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, dilations, storage_order):
    """The largest element of each window (pads hold the dtype's lowest value so never win) and,
    as the second output, where it was read (:func:`max_pool_indices`). Kernels serving only Y
    call :func:`max_pool_values`."""
    y, cols, window, geometry = max_pool_values(x, auto_pad=auto_pad, ceil_mode=ceil_mode, kernel_shape=kernel_shape,
                                                pads=pads, strides=strides, dilations=dilations)
    return y, max_pool_indices(x, y, cols, window, geometry, storage_order)


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


def _check_p(ctx: InferContext) -> None:
    if ctx.attrs["p"] == 0:
        ctx.fail("p must not be 0: the result is (sum of |x|^p)^(1/p)")


def infer_lp_pool(ctx: InferContext) -> TensorType:
    _check_p(ctx)
    return infer_pool(ctx)


@op("LpPool", inputs=[In("X", FLOAT)],
    attrs=_POOL_ATTRS + [Attr("dilations", AttrKind.INTS, None), Attr("p", AttrKind.INT, 2)], infer=infer_lp_pool)
def lp_pool(x, *, auto_pad, ceil_mode, kernel_shape, pads, strides, dilations=None, p=2):
    """(sum of |x|^p over each window)^(1/p), LpPool-18; pads add nothing to the sum."""
    attrs = {"auto_pad": auto_pad, "ceil_mode": ceil_mode, "kernel_shape": kernel_shape,
             "pads": pads, "strides": strides, "dilations": dilations}
    acc = compute_dtype(x.dtype)
    cols, window, _ = _pool_views(np.abs(x.astype(acc)) ** p, attrs, 0)
    return (cols.sum(axis=tuple(range(-window.rank, 0))) ** (1.0 / p)).astype(x.dtype)


def infer_global_lp_pool(ctx: InferContext) -> TensorType:
    _check_p(ctx)
    return infer_global_pool(ctx)


@op("GlobalLpPool", inputs=[In("X", FLOAT)], attrs=[Attr("p", AttrKind.INT, 2)], infer=infer_global_lp_pool)
def global_lp_pool(x, *, p=2):
    """(sum of |x|^p over every spatial dim)^(1/p), the spatial dims kept as size 1 (module docstring)."""
    acc = compute_dtype(x.dtype)
    with np.errstate(divide="ignore", over="ignore"):  # |0|^p for p < 0, and overflow, are inf as in ONNX Runtime
        total = (np.abs(x.astype(acc)) ** p).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
        return (total ** (1.0 / p)).astype(x.dtype)


# --------------------------------------------------------------------------- MaxRoiPool

def _roi_batch(rois: np.ndarray, n: int) -> np.ndarray:
    """The batch index of each RoI (rois[:, 0] truncated toward zero), checked to lie in [0, n)."""
    batch = np.trunc(rois[:, 0].astype(np.float64))
    bad = ~((batch >= 0) & (batch < n))
    if bad.any():
        raise IndexError(f"rois {np.flatnonzero(bad).tolist()[:8]} have batch indices "
                         f"{rois[bad, 0].astype(np.float64).tolist()[:8]} outside [0, {n}) for X of batch {n}")
    return batch.astype(np.int64)


def infer_max_roi_pool(ctx: InferContext) -> TensorType:
    a = ctx.attrs
    pooled = list(a["pooled_shape"])
    if len(pooled) != 2 or min(pooled) < 1:
        ctx.fail(f"pooled_shape must be 2 ints >= 1 (pooled height, width), got {pooled}")
    if not (math.isfinite(a["spatial_scale"]) and a["spatial_scale"] > 0):
        ctx.fail(f"spatial_scale must be a positive finite number, got {a['spatial_scale']}")
    x, rois = ctx.input(0), ctx.input(1)
    if rois.dtype is not x.dtype:
        ctx.fail(f"rois is {rois.dtype} but X is {x.dtype}; they must share one float type")
    xs, rs = x.shape, rois.shape
    if xs is not None and len(xs) != 4:
        ctx.fail(f"X must have rank 4 ([N, C, H, W]), got shape {list(xs)}")
    if rs is not None and len(rs) != 2:
        ctx.fail(f"rois must have rank 2 ([num_rois, 5]), got shape {list(rs)}")
    if rs is not None and not dims_compatible(rs[1], 5):
        ctx.fail(f"rois' last dim must be 5 ([batch_index, x1, y1, x2, y2]), got shape {list(rs)}")
    r = ctx.const(1)
    if r is not None and r.ndim == 2 and r.shape[1] == 5:
        bad = ~np.isfinite(r.astype(np.float64)).all(axis=1)
        if bad.any():
            ctx.fail(f"rois {np.flatnonzero(bad).tolist()[:8]} have non-finite values")
        if xs is not None and isinstance(xs[0], int):
            try:
                _roi_batch(r, xs[0])
            except IndexError as e:
                ctx.fail(str(e))
    return TensorType(x.dtype, (None if rs is None else rs[0], None if xs is None else xs[1], *pooled))


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's round(): to the nearest integer, halves away from zero, exactly in v's type."""
    whole = np.trunc(v)
    return whole + np.sign(v) * (np.abs(v - whole) >= 0.5)


def _roi_bins(start: np.ndarray, size: np.ndarray, bins: int, limit: int) -> tuple:
    """[R, bins] first and past-the-end input index of each bin along one axis, clipped to [0, limit]: the
    bin boundaries are floor(i * bin_size) and ceil((i + 1) * bin_size) in float32, as ONNX Runtime's."""
    bin_size = size.astype(np.float32) / np.float32(bins)
    i = np.arange(bins, dtype=np.float32)[None, :]
    lo = np.floor(i * bin_size[:, None]).astype(np.int64)
    hi = np.ceil((i + np.float32(1)) * bin_size[:, None]).astype(np.int64)
    return np.clip(lo + start[:, None], 0, limit), np.clip(hi + start[:, None], 0, limit)


def _bin_max(a: np.ndarray, axis: int, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The max of ``a`` over [start[i], end[i]) along ``axis`` for every bin i, as one max per offset into the
    bins (the longest bin's length of them), a bin's offsets past its end reading its last element again. An
    empty bin reads some element of ``a``: the caller zeroes it."""
    last = np.clip(end - 1, 0, a.shape[axis] - 1)
    first = np.minimum(start, last)
    out = np.take(a, first, axis=axis)
    for t in range(1, int((last - first).max()) + 1):
        np.maximum(out, np.take(a, np.minimum(first + t, last), axis=axis), out=out)
    return out


@op("MaxRoiPool", inputs=[In("X", FLOAT, rank=4), In("rois", FLOAT, rank=2)],
    attrs=[Attr("pooled_shape", AttrKind.INTS), Attr("spatial_scale", AttrKind.FLOAT, 1.0)],
    infer=infer_max_roi_pool)
def max_roi_pool(x, rois, *, pooled_shape, spatial_scale=1.0):
    """The max of X over each bin of each RoI (module docstring). Per RoI, vectorized over its bins and the
    channels: the max over each bin's rows of the RoI's part of the map, then over each bin's columns
    (:func:`_bin_max`), so the work is about the RoIs' area, as in ONNX Runtime's kernel. (np.maximum.reduceat
    does the same passes about ten times slower, and one pass over all RoIs at once reduces whole rows of the
    map for every bin row.)"""
    n, c, h, w = x.shape
    ph, pw = (int(v) for v in pooled_shape)
    if rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(f"rois must have shape [num_rois, 5], got {list(rois.shape)}")
    num = rois.shape[0]
    y = np.zeros((num, c, ph, pw), x.dtype)
    if num == 0:
        return y
    cd = compute_dtype(rois.dtype)
    rv = rois.astype(cd)
    finite = np.isfinite(rv).all(axis=1)
    if not finite.all():
        raise ValueError(f"rois {np.flatnonzero(~finite).tolist()[:8]} have non-finite values")
    batch = _roi_batch(rv, n)
    box = _round_half_away(rv[:, 1:] * cd.type(np.float32(spatial_scale))).astype(np.float64)
    far = (np.abs(box) > np.iinfo(np.int32).max).any(axis=1)
    if far.any():
        raise ValueError(f"rois {np.flatnonzero(far).tolist()[:8]} have coordinates that, scaled by spatial_scale "
                         f"{spatial_scale} and rounded, lie outside the int32 range")
    x1, y1, x2, y2 = box.astype(np.int64).T
    hs, he = _roi_bins(y1, np.maximum(y2 - y1 + 1, 1), ph, h)  # [R, ph]
    ws, we = _roi_bins(x1, np.maximum(x2 - x1 + 1, 1), pw, w)  # [R, pw]
    if c == 0 or h == 0 or w == 0:
        return y  # no channel, or every bin empty
    for b in np.unique(batch):
        image = np.ascontiguousarray(np.moveaxis(x[b], 0, -1))  # [H, W, C]: each bin row/column is one vector op
        for j in np.flatnonzero(batch == b):
            # The bins' starts and ends rise with the bin index: the RoI covers [hs[0], he[-1]) x [ws[0], we[-1]).
            top, bottom, left, right = hs[j, 0], he[j, -1], ws[j, 0], we[j, -1]
            if bottom <= top or right <= left:
                continue  # every bin empty
            rows = _bin_max(image[top:bottom, left:right], 0, hs[j] - top, he[j] - top)  # [ph, RoI width, C]
            y[j] = np.moveaxis(_bin_max(rows, 1, ws[j] - left, we[j] - left), -1, 0)
    empty = (he <= hs)[:, :, None] | (we <= ws)[:, None, :]  # [R, ph, pw]
    y[np.broadcast_to(empty[:, None], y.shape)] = 0
    return y
