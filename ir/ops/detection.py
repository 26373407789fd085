"""Object-detection ops: ``NonMaxSuppression`` (ai.onnx 10/11), ``RoiAlign`` (10/16/22) and ``DeformConv`` (19/22).
The rules, down to where ONNX compares strictly and where it rounds, follow ONNX's reference evaluator
(onnx/reference/ops/op_non_max_suppression.py, op_roi_align.py, op_deform_conv.py); the kernels here are
vectorized with numpy.

``NonMaxSuppression`` boxes [B, N, 4] (float32), scores [B, C, N] -> selected_indices [K, 3] int64 rows
(batch, class, box), batch-major, then class, then in selection order; K is known only at run time. Per (batch,
class): boxes whose score is strictly greater than ``score_threshold`` (all boxes when it is omitted) are taken in
descending score order (equal scores: the lower box index first); a box is kept unless its IoU with a box already
kept is strictly greater than ``iou_threshold`` (default 0), until ``max_output_boxes_per_class`` (default 0: no
output; a negative value counts as 0) are kept. ``center_point_box`` 0: [y1, x1, y2, x2], any two opposite corners;
1: [x_center, y_center, width, height]. Boxes that do not overlap, or that have no positive area, never suppress.
NonMaxSuppression-10 and -11 have the same schema (11 only states that an IoU equal to the threshold keeps the box,
which 10 already did); kiln implements 11 and imports 10 through the version converter, which leaves it as it is.
Empty optional inputs count as omitted, as in the reference.

``RoiAlign`` X [N, C, H, W], rois [R, 4] ([x1, y1, x2, y2] in the input image's coordinates), batch_indices [R]
int64 -> Y [R, C, output_height, output_width]. Each output bin averages (``mode='avg'``) or takes the max
(``mode='max'``) of a sampling_ratio x sampling_ratio grid of bilinear samples (``sampling_ratio=0``: an adaptive
ceil(roi_size / output_size) grid per RoI). ``coordinate_transformation_mode`` (added in RoiAlign-16, default
'half_pixel') shifts the scaled RoI by -0.5; 'output_half_pixel' does not and makes RoIs at least 1x1: that is
RoiAlign-10's only behaviour, and onnx.version_converter sets it when it upgrades a RoiAlign-10 node (the model
importer relies on this). RoiAlign-22 only adds bfloat16. As in ONNX's reference (and ONNX Runtime), 'max' takes
the max over samples of the max of the four *weighted* corner values (w1*v1, ..., w4*v4), not of the interpolated
value; a sample more than one pixel outside the map is 0, and a bin of an adaptive grid with no sample (a RoI of
size 0 with 'half_pixel') is 0. A non-finite RoI coordinate is an error (the reference fails on it, ONNX Runtime
refuses it).

``DeformConv`` X [N, C, D1..Dn], W [oC, C/group, k1..kn], offset [N, offset_group*k1*..*kn*n, o1..on], optional
B [oC] and mask [N, offset_group*k1*..*kn, o1..on] -> Y [N, oC, o1..on]. Kernel tap k of output position o reads
X at (o * strides - pads_begin + k * dilations + offset[k, :, o]) by (multi)linear interpolation, 0 outside X,
scaled by mask; the input channels are split into offset_group groups that each have their own offsets and mask.
Any number of spatial dims (the reference evaluator does 2-D only; its N-D rule is the same). The output size is
the Conv one and must match offset's spatial dims. DeformConv-22 only adds bfloat16 to 19.

Narrow floats (float16, bfloat16) compute in float32 and round once on the way out; sampling positions and
interpolation weights of DeformConv are computed in float64.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.ops.nn import make_window, window_out_shape
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType, dims_compatible, merge_dim

F32 = frozenset({DType.FLOAT32})
I64 = frozenset({DType.INT64})


def _rank_is(ctx: InferContext, i: int, name: str, rank: int, form: str) -> "tuple | None":
    """Input i's shape (None when unknown), after checking its rank."""
    s = ctx.input(i).shape
    if s is not None and len(s) != rank:
        ctx.fail(f"{name} must have rank {rank} ({form}), got shape {list(s)}")
    return s


def _same(ctx: InferContext, what: str, a, b) -> None:
    if not dims_compatible(a, b):
        ctx.fail(what)


# --------------------------------------------------------------------------- NonMaxSuppression


def _infer_nms(ctx: InferContext) -> TensorType:
    if ctx.attrs["center_point_box"] not in (0, 1):
        ctx.fail(f"center_point_box must be 0 ([y1, x1, y2, x2]) or 1 ([x_center, y_center, width, height]), "
                 f"not {ctx.attrs['center_point_box']}")
    boxes = _rank_is(ctx, 0, "boxes", 3, "[num_batches, spatial_dimension, 4]")
    scores = _rank_is(ctx, 1, "scores", 3, "[num_batches, num_classes, spatial_dimension]")
    if boxes is not None:
        _same(ctx, f"boxes' last dim must be 4 (one box), got shape {list(boxes)}", boxes[2], 4)
    if boxes is not None and scores is not None:
        _same(ctx, f"boxes {list(boxes)} and scores {list(scores)} have different num_batches", boxes[0], scores[0])
        _same(ctx, f"boxes {list(boxes)} and scores {list(scores)} have different spatial_dimension (number of "
                   f"boxes)", boxes[1], scores[2])
    # How many boxes survive is data: the row count is known at run time only.
    return TensorType(DType.INT64, (None, 3))


def _given(a):
    """A scalar input's value, None when omitted or empty (the reference treats both as omitted)."""
    return None if a is None or a.size == 0 else a.reshape(-1)[0]


def _extents(boxes: np.ndarray, center_point_box: int) -> tuple:
    """(x_min, x_max, y_min, y_max, area) of every box, float32, as the reference computes them."""
    if center_point_box == 0:
        y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
        x_min, x_max, y_min, y_max = np.minimum(x1, x2), np.maximum(x1, x2), np.minimum(y1, y2), np.maximum(y1, y2)
    else:
        xc, yc, w, h = np.moveaxis(boxes, -1, 0)
        half_w, half_h = w / boxes.dtype.type(2), h / boxes.dtype.type(2)
        x_min, x_max, y_min, y_max = xc - half_w, xc + half_w, yc - half_h, yc + half_h
    return x_min, x_max, y_min, y_max, (x_max - x_min) * (y_max - y_min)


def _greedy(ext: tuple, order: np.ndarray, iou_threshold, limit: int) -> np.ndarray:
    """The boxes of ``order`` (best first) that survive, at most ``limit``: each kept box drops, at once, the later
    candidates it overlaps too much (IoU is symmetric, so this is the reference's test of each candidate against
    the boxes kept before it)."""
    x0, x1, y0, y1, area = (e[order] for e in ext)
    rest = np.arange(order.size)  # positions in `order` still candidates, best first
    kept = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        while rest.size and len(kept) < limit:
            i, rest = rest[0], rest[1:]
            kept.append(i)
            ix0, ix1 = np.maximum(x0[rest], x0[i]), np.minimum(x1[rest], x1[i])
            iy0, iy1 = np.maximum(y0[rest], y0[i]), np.minimum(y1[rest], y1[i])
            inter = (ix1 - ix0) * (iy1 - iy0)
            union = area[rest] + area[i] - inter
            overlap = (ix1 > ix0) & (iy1 > iy0) & (inter > 0) & (area[rest] > 0) & (area[i] > 0) & (union > 0)
            rest = rest[~(overlap & (inter / union > iou_threshold))]
    return order[np.array(kept, np.int64)]


@op("NonMaxSuppression",
    inputs=[In("boxes", F32), In("scores", F32),
            In("max_output_boxes_per_class", I64, optional=True, max_elements=1),
            In("iou_threshold", F32, optional=True, max_elements=1),
            In("score_threshold", F32, optional=True, max_elements=1)],
    outputs=[Out("selected_indices", I64)],
    attrs=[Attr("center_point_box", AttrKind.INT, 0)],
    infer=_infer_nms)
def non_max_suppression(boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None,
                        *, center_point_box=0):
    """[K, 3] (batch, class, box) rows of the boxes greedy IoU suppression keeps (module docstring)."""
    n_batch, n_boxes = boxes.shape[:2]
    n_class = scores.shape[1]
    if scores.shape[0] != n_batch or scores.shape[2] != n_boxes:
        raise ValueError(f"boxes {list(boxes.shape)} and scores {list(scores.shape)} do not describe the same boxes")
    limit = _given(max_output_boxes_per_class)
    limit = 0 if limit is None else int(min(max(int(limit), 0), n_boxes))
    iou = _given(iou_threshold)
    iou = np.float32(0) if iou is None else np.float32(iou)
    score_min = _given(score_threshold)
    rows = [np.zeros((0, 3), np.int64)]
    if limit == 0:
        return rows[0]
    ext = _extents(boxes, center_point_box)
    for b in range(n_batch):
        ext_b = tuple(e[b] for e in ext)
        for c in range(n_class):
            s = scores[b, c]
            cand = np.arange(n_boxes) if score_min is None else np.flatnonzero(s > np.float32(score_min))
            order = cand[np.argsort(-s[cand], kind="stable")]  # stable: equal scores keep the lower index first
            kept = _greedy(ext_b, order, iou, limit)
            rows.append(np.stack([np.full(kept.size, b), np.full(kept.size, c), kept], axis=1).astype(np.int64))
    return np.concatenate(rows, axis=0)


# --------------------------------------------------------------------------- RoiAlign

_ROI_MODES = ("avg", "max")
_ROI_TRANSFORMS = ("half_pixel", "output_half_pixel")


def _infer_roi_align(ctx: InferContext) -> TensorType:
    a = ctx.attrs
    if a["mode"] not in _ROI_MODES:
        ctx.fail(f"mode must be one of {list(_ROI_MODES)}, not {a['mode']!r}")
    if a["coordinate_transformation_mode"] not in _ROI_TRANSFORMS:
        ctx.fail(f"coordinate_transformation_mode must be one of {list(_ROI_TRANSFORMS)}, "
                 f"not {a['coordinate_transformation_mode']!r}")
    for name in ("output_height", "output_width"):
        if a[name] < 1:
            ctx.fail(f"{name} must be >= 1, got {a[name]}")
    if a["sampling_ratio"] < 0:
        ctx.fail(f"sampling_ratio must be >= 0 (0: adaptive), got {a['sampling_ratio']}")
    x, rois = ctx.input(0), ctx.input(1)
    if rois.dtype is not x.dtype:
        ctx.fail(f"rois is {rois.dtype} but X is {x.dtype}; they must share one float type")
    xs = _rank_is(ctx, 0, "X", 4, "[N, C, H, W]")
    rs = _rank_is(ctx, 1, "rois", 2, "[num_rois, 4]")
    bs = _rank_is(ctx, 2, "batch_indices", 1, "[num_rois]")
    if rs is not None:
        _same(ctx, f"rois' last dim must be 4 ([x1, y1, x2, y2]), got shape {list(rs)}", rs[1], 4)
    num_rois = bs[0] if bs is not None else None
    if rs is not None:
        _same(ctx, f"rois {list(rs)} and batch_indices {list(bs or ())} have different num_rois", rs[0], num_rois)
        num_rois = merge_dim(num_rois, rs[0])
    b = ctx.const(2)
    if b is not None and xs is not None and isinstance(xs[0], int) and b.size:
        bad = b[(b < 0) | (b >= xs[0])]
        if bad.size:
            ctx.fail(f"batch_indices {bad.tolist()[:8]} are out of range [0, {xs[0]}) for X of batch {xs[0]}")
    return TensorType(x.dtype, (num_rois, None if xs is None else xs[1], a["output_height"], a["output_width"]))


def _roi_samples(start: np.ndarray, bin_size: np.ndarray, bins: int, grid: int, cd) -> np.ndarray:
    """[R, bins, grid] sample coordinates along one axis, in the reference's float order."""
    p = np.arange(bins, dtype=cd)[None, :, None]
    i = (np.arange(grid, dtype=cd) + cd.type(0.5))[None, None, :]
    s, b = start[:, None, None], bin_size[:, None, None]
    return s + p * b + i * b / cd.type(grid)


def _roi_axis(v: np.ndarray, size: int, cd) -> tuple:
    """(low index, high index, low weight, high weight, valid) of bilinear taps along one axis: a sample more than
    one pixel outside is invalid (weight 0, index 0); one at or past the last pixel reads the last pixel only."""
    ok = (v >= -1) & (v <= size)
    v = np.where(ok, np.maximum(v, cd.type(0)), cd.type(0))
    lo = np.floor(v).astype(np.int64)
    edge = lo >= size - 1
    lo = np.where(edge, size - 1, lo)
    hi = np.where(edge, size - 1, lo + 1)
    v = np.where(edge, lo.astype(cd), v)
    frac = v - lo.astype(cd)
    return lo, hi, cd.type(1) - frac, frac, ok


@op("RoiAlign", inputs=[In("X", FLOAT, rank=4), In("rois", FLOAT, rank=2), In("batch_indices", I64, rank=1)],
    outputs=["Y"],
    attrs=[Attr("coordinate_transformation_mode", AttrKind.STRING, "half_pixel"), Attr("mode", AttrKind.STRING, "avg"),
           Attr("output_height", AttrKind.INT, 1), Attr("output_width", AttrKind.INT, 1),
           Attr("sampling_ratio", AttrKind.INT, 0), Attr("spatial_scale", AttrKind.FLOAT, 1.0)],
    infer=_infer_roi_align)
def roi_align(x, rois, batch_indices, *, coordinate_transformation_mode="half_pixel", mode="avg", output_height=1,
              output_width=1, sampling_ratio=0, spatial_scale=1.0):
    """Bilinearly sampled average (or max) of each RoI bin (module docstring)."""
    n, c, h, w = x.shape
    oh, ow = int(output_height), int(output_width)
    b = np.asarray(batch_indices, np.int64).reshape(-1)
    r = b.size
    if rois.shape != (r, 4):
        raise ValueError(f"rois must have shape [{r}, 4] for {r} batch_indices, got {list(rois.shape)}")
    if ((b < 0) | (b >= n)).any():
        raise IndexError(f"batch_indices {b[(b < 0) | (b >= n)].tolist()[:8]} are out of range [0, {n})")
    cd = compute_dtype(x.dtype)
    y = np.zeros((r, c, oh, ow), cd)
    if r == 0 or c == 0 or h == 0 or w == 0:
        return y.astype(x.dtype)
    half_pixel = coordinate_transformation_mode == "half_pixel"
    box = rois.astype(cd) * cd.type(spatial_scale) - cd.type(0.5 if half_pixel else 0.0)
    start_w, start_h, end_w, end_h = box.T
    roi_w, roi_h = end_w - start_w, end_h - start_h
    if not half_pixel:  # malformed RoIs become 1x1
        roi_w, roi_h = np.maximum(roi_w, cd.type(1)), np.maximum(roi_h, cd.type(1))
    bin_h, bin_w = roi_h / cd.type(oh), roi_w / cd.type(ow)
    if not np.isfinite(box).all():
        bad = np.flatnonzero(~np.isfinite(box).all(axis=1))
        raise ValueError(f"rois {bad.tolist()[:8]} have non-finite coordinates (after spatial_scale {spatial_scale})")
    if sampling_ratio > 0:
        grid_h = grid_w = np.full(r, sampling_ratio, np.int64)
    else:  # a negative size (an inverted RoI with 'half_pixel') samples nothing
        grid_h, grid_w = (np.maximum(np.ceil(v), 0).astype(np.float64) for v in (bin_h, bin_w))
        if (grid_h * grid_w > 2.0 ** 31).any():
            raise ValueError(f"rois {np.flatnonzero(grid_h * grid_w > 2.0 ** 31).tolist()[:8]} ask for adaptive "
                             f"sampling grids of over 2**31 points per bin (sampling_ratio=0)")
        grid_h, grid_w = grid_h.astype(np.int64), grid_w.astype(np.int64)
    data = np.ascontiguousarray(np.moveaxis(x, 1, -1), dtype=cd)  # [N, H, W, C], C contiguous for the gathers
    for gh, gw in sorted(set(zip(grid_h.tolist(), grid_w.tolist()))):
        if gh == 0 or gw == 0:
            continue  # no sample: the bins stay 0
        sel = np.flatnonzero((grid_h == gh) & (grid_w == gw))
        ylo, yhi, hy, ly, yok = _roi_axis(_roi_samples(start_h[sel], bin_h[sel], oh, gh, cd), h, cd)
        xlo, xhi, hx, lx, xok = _roi_axis(_roi_samples(start_w[sel], bin_w[sel], ow, gw, cd), w, cd)

        def Y(a):  # [S, oh, gh] -> [S, oh, gh, 1, 1]
            return a[:, :, :, None, None]

        def X(a):  # [S, ow, gw] -> [S, 1, 1, ow, gw]
            return a[:, None, None, :, :]

        bb = b[sel][:, None, None, None, None]
        ok = Y(yok) & X(xok)  # an invalid sample reads pixel (0, 0) with weight 0, as the reference does
        acc = None
        for yi, wy in ((ylo, hy), (yhi, ly)):
            for xi, wx in ((xlo, hx), (xhi, lx)):
                tap = data[bb, np.where(ok, Y(yi), 0), np.where(ok, X(xi), 0)]  # [S, oh, gh, ow, gw, C]
                tap *= np.where(ok, Y(wy) * X(wx), cd.type(0))[..., None]
                if acc is None:
                    acc = tap
                elif mode == "avg":
                    acc += tap
                else:
                    np.maximum(acc, tap, out=acc)
        if mode == "avg":
            out = acc.sum(axis=(2, 4)) / cd.type(gh * gw)
        else:
            out = acc.max(axis=(2, 4))
        y[sel] = np.moveaxis(out, -1, 1)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- DeformConv


def _infer_deform_conv(ctx: InferContext) -> TensorType:
    a = ctx.attrs
    x = ctx.input(0)
    names = ["X", "W", "offset", "B", "mask"]
    for i in range(1, 5):
        if ctx.has_input(i) and ctx.input(i).dtype is not x.dtype:
            ctx.fail(f"{names[i]} is {ctx.input(i).dtype} but X is {x.dtype}; all inputs share one float type")
    for name in ("group", "offset_group"):
        if a[name] < 1:
            ctx.fail(f"{name} must be >= 1, got {a[name]}")
    xs, ws, offs = x.shape, ctx.input(1).shape, ctx.input(2).shape
    if xs is not None and len(xs) < 3:
        ctx.fail(f"X must have rank >= 3 ([N, C, D1, ...]), got shape {list(xs)}")
    rank = len(xs) if xs is not None else len(ws) if ws is not None else len(offs) if offs is not None else None
    for i in (1, 2, 4):
        s = ctx.input(i).shape if ctx.has_input(i) else None
        if s is not None and (len(s) != rank or len(s) < 3):
            ctx.fail(f"{names[i]} must have the rank of X ({rank}), got shape {list(s)}")
    if rank is None:
        return TensorType(x.dtype, None)
    n = rank - 2
    ks = a["kernel_shape"]
    if ks is not None:
        if len(ks) != n or (ws is not None and not all(dims_compatible(k, d) for k, d in zip(ks, ws[2:]))):
            ctx.fail(f"kernel_shape {list(ks)} does not match W of shape {list(ws) if ws else None} "
                     f"({n} spatial dims)")
        kernel = tuple(ks)
    else:
        kernel = tuple(ws[2:]) if ws is not None else (None,) * n
    try:
        window = make_window(kernel, strides=a["strides"], dilations=a["dilations"], pads=a["pads"])
        out = window_out_shape(window, xs[2:]) if xs is not None else [None] * n
    except ValueError as e:
        ctx.fail(str(e))
    group, og = a["group"], a["offset_group"]
    batch = xs[0] if xs is not None else None
    channels = xs[1] if xs is not None else None
    m = ws[0] if ws is not None else None
    if ws is not None and isinstance(channels, int) and isinstance(ws[1], int) and channels != ws[1] * group:
        ctx.fail(f"X has {channels} channels but W {list(ws)} with group={group} expects {ws[1] * group}")
    for what, d, k in (("input channels C", channels, group), ("output channels oC", m, group),
                       ("input channels C", channels, og)):
        if isinstance(d, int) and d % k:
            ctx.fail(f"{what} ({d}) is not divisible by {'group' if k is group else 'offset_group'} ({k})")
    taps = math.prod(kernel) if all(isinstance(k, int) for k in kernel) else None
    if ctx.has_input(3):
        bs = ctx.input(3).shape
        if bs is not None and (len(bs) != 1 or not dims_compatible(bs[0], m)):
            ctx.fail(f"bias B must have shape [{m}] (one value per output channel), got {list(bs)}")
    for i, per_tap in ((2, n), (4, 1)):
        s = ctx.input(i).shape if ctx.has_input(i) else None
        if s is None:
            continue
        want = None if taps is None else og * taps * per_tap
        form = f"[N, offset_group*{'*'.join(map(str, kernel))}{'*' + str(n) if per_tap > 1 else ''}, " \
               f"{', '.join(map(str, out))}]"
        if not dims_compatible(s[0], batch) or not dims_compatible(s[1], want) or \
                not all(dims_compatible(d, o) for d, o in zip(s[2:], out)):
            ctx.fail(f"{names[i]} must have shape {form} for X {list(xs) if xs else None}, kernel {list(kernel)} "
                     f"and offset_group={og}, got {list(s)}")
        batch = merge_dim(batch, s[0])
        out = [merge_dim(o, d) for o, d in zip(out, s[2:])]
    return TensorType(x.dtype, (batch, m, *out))


@op("DeformConv",
    inputs=[In("X", FLOAT), In("W", FLOAT), In("offset", FLOAT), In("B", FLOAT, optional=True, rank=1),
            In("mask", FLOAT, optional=True)],
    outputs=["Y"],
    attrs=[Attr("dilations", AttrKind.INTS, None), Attr("group", AttrKind.INT, 1),
           Attr("kernel_shape", AttrKind.INTS, None), Attr("offset_group", AttrKind.INT, 1),
           Attr("pads", AttrKind.INTS, None), Attr("strides", AttrKind.INTS, None)],
    infer=_infer_deform_conv)
def deform_conv(x, w, offset, b=None, mask=None, *, dilations=None, group=1, kernel_shape=None, offset_group=1,
                pads=None, strides=None):
    """Convolution whose kernel taps read X at learned offsets, by linear interpolation (module docstring)."""
    n_sp = x.ndim - 2
    kernel = tuple(int(k) for k in (kernel_shape or w.shape[2:]))
    window = make_window(kernel, strides=strides, dilations=dilations, pads=pads)
    out = tuple(window_out_shape(window, x.shape[2:]))
    batch, channels, *dims = x.shape
    og = int(offset_group)
    taps = math.prod(kernel)
    if offset.shape != (batch, og * taps * n_sp, *out):
        raise ValueError(f"offset must have shape {[batch, og * taps * n_sp, *out]}, got {list(offset.shape)}")
    if mask is not None and mask.shape != (batch, og * taps, *out):
        raise ValueError(f"mask must have shape {[batch, og * taps, *out]}, got {list(mask.shape)}")
    cd = compute_dtype(x.dtype)
    m = w.shape[0]
    y = np.zeros((batch, m, *out), cd)
    if y.size and channels and taps:
        # Sampling positions [N, og, *kernel, *out] per spatial dim, float64.
        off = offset.astype(np.float64).reshape(batch, og, *kernel, n_sp, *out)
        lead = (slice(None),) * (2 + n_sp)
        pos = []
        for i in range(n_sp):
            k_at = np.arange(kernel[i]).reshape((-1,) + (1,) * (n_sp - 1 - i + n_sp))
            o_at = np.arange(out[i]).reshape((-1,) + (1,) * (n_sp - 1 - i))
            base = o_at * window.strides[i] - window.pads[i] + k_at * window.dilations[i]
            pos.append(base + off[lead + (i,)])
        cg = channels // og
        data = np.ascontiguousarray(np.moveaxis(x.reshape(batch, og, cg, *dims), 2, -1), dtype=cd)  # [N, og, *dims, Cg]
        at_n = np.arange(batch).reshape((-1,) + (1,) * (1 + 2 * n_sp))
        at_g = np.arange(og).reshape((1, -1) + (1,) * (2 * n_sp))
        floors = [np.floor(p) for p in pos]
        fracs = [p - f for p, f in zip(pos, floors)]
        floors = [f.astype(np.int64) for f in floors]
        cols = np.zeros((batch, og, *kernel, *out, cg), cd)
        for corner in itertools.product((0, 1), repeat=n_sp):
            weight = np.ones(pos[0].shape, np.float64)
            index = []
            for i, bit in enumerate(corner):
                idx = floors[i] + bit
                weight = weight * (fracs[i] if bit else 1 - fracs[i]) * ((idx >= 0) & (idx < dims[i]))
                index.append(np.clip(idx, 0, dims[i] - 1))
            cols += data[(at_n, at_g, *index)] * weight.astype(cd)[..., None]
        if mask is not None:
            cols *= mask.reshape(batch, og, *kernel, *out).astype(cd)[..., None]
        # [N, og, *kernel, *out, Cg] -> [N, group, C/group * taps, prod(out)], against W [group, oC/group, C/group*taps]
        cols = np.moveaxis(cols, -1, 2).reshape(batch, channels, taps, -1)
        cols = cols.reshape(batch, group, (channels // group) * taps, -1)
        wg = w.astype(cd).reshape(group, m // group, (channels // group) * taps)
        y = np.matmul(wg[None], cols).reshape(batch, m, *out)
    if b is not None:
        y = y + b.astype(cd).reshape((-1,) + (1,) * n_sp)
    return y.astype(x.dtype)
