"""NonMaxSuppression, RoiAlign and DeformConv (kiln.ir.ops.detection): each against ONNX's reference evaluator over
its attributes and modes, on inputs that reach the rules' edges (ties, boxes in any corner order, degenerate boxes,
IoU exactly at the threshold, RoIs past the map or inverted, offsets that sample outside X); DeformConv in 1-D and
3-D against a plain loop and, with zero offsets, against Conv; dtypes, empty inputs, named inference errors; import
of the older versions (NonMaxSuppression-10, RoiAlign-10, DeformConv-19) and export at the opsets kiln writes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import KilnError, ShapeInferenceError, UnsupportedOpError
from kiln.ir import evaluate
from kiln.ir.ops.nn import conv
from op_harness import build_single, check_op, inferred, onnx_reference

RNG = np.random.default_rng(2024)
F32 = np.float32


# --------------------------------------------------------------------------- NonMaxSuppression


def nms_inputs(batches=2, classes=3, boxes=40, center=False):
    if center:
        b = np.concatenate([RNG.uniform(0, 10, (batches, boxes, 2)), RNG.uniform(0.5, 4, (batches, boxes, 2))], -1)
    else:  # corners in any order (y1 > y2 and x1 > x2 happen)
        b = RNG.uniform(0, 10, (batches, boxes, 4))
    scores = RNG.uniform(0, 1, (batches, classes, boxes)).round(1)  # rounded: many equal scores (ties)
    return b.astype(F32), scores.astype(F32)


def scalar(v, dtype):
    return np.array([v], dtype)


def rows(*r):
    return np.array(r, np.int64).reshape(-1, 3)


@pytest.mark.parametrize("center,max_out,iou,score", list(itertools.product(
    [0, 1], [1, 5, 100], [0.0, 0.3, 0.7], [None, 0.5])))
def test_nms_matches_onnx_reference(center, max_out, iou, score):
    boxes, scores = nms_inputs(center=center)
    inputs = [boxes, scores, scalar(max_out, np.int64), scalar(iou, F32)]
    if score is not None:
        inputs.append(scalar(score, F32))
    attrs = {"center_point_box": center}
    want = onnx_reference("NonMaxSuppression", inputs, attrs, opset=11)
    (got,) = check_op("NonMaxSuppression", inputs, want, attrs, symbolic_batch=True)
    assert got.dtype == np.int64 and got.shape[1] == 3


def test_nms_scalar_inputs_as_rank_0_and_as_constants():
    boxes, scores = nms_inputs(1, 2, 25)
    inputs = [boxes, scores, np.array(4, np.int64), np.array(0.2, F32), np.array(0.1, F32)]
    # (the reference evaluator indexes [0]: it takes the 1-element form only)
    want = onnx_reference("NonMaxSuppression", [boxes, scores] + [a.reshape(1) for a in inputs[2:]], {}, opset=11)
    check_op("NonMaxSuppression", inputs, want, const_inputs=(2, 3, 4))
    check_op("NonMaxSuppression", inputs, want)


def test_nms_onnx_cases_edges():
    # Equal scores: the lower index first; identical boxes suppress each other (IoU 1 > 0.5).
    boxes = np.array([[[0, 0, 1, 1]] * 10], F32)
    scores = np.full((1, 1, 10), 0.9, F32)
    check_op("NonMaxSuppression", [boxes, scores, scalar(3, np.int64), scalar(0.5, F32)], rows([0, 0, 0]))
    # IoU exactly at the threshold keeps the box (strictly greater suppresses): two unit squares half overlapping
    # have IoU 1/3; 0.5-width overlap of 1x1 boxes: inter 0.5, union 1.5.
    boxes = np.array([[[0, 0, 1, 1], [0, 0.5, 1, 1.5]]], F32)
    scores = np.array([[[0.9, 0.8]]], F32)
    iou = np.float32(np.float32(0.5) / np.float32(1.5))
    check_op("NonMaxSuppression", [boxes, scores, scalar(2, np.int64), scalar(iou, F32)], rows([0, 0, 0], [0, 0, 1]))
    check_op("NonMaxSuppression", [boxes, scores, scalar(2, np.int64), scalar(np.nextafter(iou, F32(0)), F32)],
             rows([0, 0, 0]))


def test_nms_degenerate_and_touching_boxes_never_suppress():
    # A zero-area box, a box touching the first along an edge, an identical zero-area box: nothing overlaps with
    # positive area, so everything is kept even at iou_threshold 0.
    boxes = np.array([[[0, 0, 1, 1], [1, 0, 2, 1], [0.5, 0.5, 0.5, 0.9], [0.5, 0.5, 0.5, 0.9]]], F32)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6]]], F32)
    inputs = [boxes, scores, scalar(10, np.int64), scalar(0.0, F32)]
    want = onnx_reference("NonMaxSuppression", inputs, {}, opset=11)
    check_op("NonMaxSuppression", inputs, want)
    assert len(want) == 4


def test_nms_score_threshold_is_strict_and_limits_apply_per_class():
    boxes = np.array([[[0, 0, 1, 1], [5, 5, 6, 6], [10, 10, 11, 11]]], F32)
    scores = np.array([[[0.5, 0.6, 0.4], [0.1, 0.7, 0.8]]], F32)
    check_op("NonMaxSuppression", [boxes, scores, scalar(2, np.int64), scalar(0.5, F32), scalar(0.5, F32)],
             rows([0, 0, 1], [0, 1, 2], [0, 1, 1]))


@pytest.mark.parametrize("max_out", [None, np.zeros(0, np.int64), scalar(0, np.int64), scalar(-3, np.int64)])
def test_nms_no_output_without_a_positive_limit(max_out):
    boxes, scores = nms_inputs(1, 2, 5)
    (got,) = check_op("NonMaxSuppression", [boxes, scores, max_out], np.zeros((0, 3), np.int64))
    assert got.shape == (0, 3)


def test_nms_empty_optional_thresholds_count_as_omitted():
    boxes, scores = nms_inputs(2, 2, 12)
    empty = np.zeros(0, F32)
    # omitted: iou_threshold 0, no score threshold (the reference evaluator fails on an omitted iou_threshold)
    want = onnx_reference("NonMaxSuppression", [boxes, scores, scalar(5, np.int64), scalar(0, F32)], {}, opset=11)
    check_op("NonMaxSuppression", [boxes, scores, scalar(5, np.int64), empty, empty], want)


@pytest.mark.parametrize("shape_b,shape_s", [((2, 0, 4), (2, 3, 0)), ((0, 5, 4), (0, 3, 5)), ((2, 5, 4), (2, 0, 5))])
def test_nms_empty_inputs(shape_b, shape_s):
    check_op("NonMaxSuppression", [np.zeros(shape_b, F32), np.zeros(shape_s, F32), scalar(3, np.int64)],
             np.zeros((0, 3), np.int64))


def test_nms_output_rows_are_known_at_run_time_only():
    boxes, scores = nms_inputs(1, 1, 4)
    assert inferred("NonMaxSuppression", [boxes, scores, scalar(3, np.int64)]) == [(None, 3)]


def test_nms_many_boxes_against_reference():
    boxes, scores = nms_inputs(1, 2, 300)
    inputs = [boxes, scores, scalar(150, np.int64), scalar(0.4, F32), scalar(0.05, F32)]
    check_op("NonMaxSuppression", inputs, onnx_reference("NonMaxSuppression", inputs, {}, opset=11))


@pytest.mark.parametrize("boxes,scores,attrs,match", [
    ((1, 3, 4), (1, 1, 3), {"center_point_box": 2}, "center_point_box must be 0"),
    ((3, 4), (1, 1, 3), {}, "boxes must have rank 3"),
    ((1, 3, 5), (1, 1, 3), {}, "last dim must be 4"),
    ((1, 3, 4), (1, 3), {}, "scores must have rank 3"),
    ((2, 3, 4), (1, 1, 3), {}, "different num_batches"),
    ((1, 3, 4), (1, 1, 4), {}, "different spatial_dimension"),
])
def test_nms_inference_names_what_is_wrong(boxes, scores, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("NonMaxSuppression", [np.zeros(boxes, F32), np.zeros(scores, F32)], attrs)


def test_nms_takes_float32_only_as_onnx():
    with pytest.raises(KilnError, match="allowed: float32"):
        build_single("NonMaxSuppression", [np.zeros((1, 2, 4), np.float16), np.zeros((1, 1, 2), np.float16)])


# --------------------------------------------------------------------------- RoiAlign


def roi_inputs(dtype=F32, n=2, c=3, h=10, w=12, r=7):
    x = RNG.standard_normal((n, c, h, w)).astype(dtype)
    rois = np.array([[0, 0, 9, 9], [1.3, 2.7, 6.1, 8.9], [4, 4, 4.2, 4.1],  # ordinary, fractional, tiny
                     [-3, -2, 5, 14], [10, 8, 16, 13],  # reaching past the map
                     [7, 6, 2, 1],  # inverted (x2 < x1): negative size
                     [11.5, 9.5, 12, 10]], dtype)[:r]  # at the last pixel
    return x, rois, RNG.integers(0, n, r).astype(np.int64)


@pytest.mark.parametrize("mode,transform,ratio,scale", list(itertools.product(
    ["avg", "max"], ["half_pixel", "output_half_pixel"], [0, 2], [1.0, 0.5])))
def test_roi_align_matches_onnx_reference(mode, transform, ratio, scale):
    x, rois, b = roi_inputs()
    attrs = {"mode": mode, "coordinate_transformation_mode": transform, "sampling_ratio": ratio,
             "spatial_scale": scale, "output_height": 3, "output_width": 4}
    want = onnx_reference("RoiAlign", [x, rois, b], attrs, opset=16)
    check_op("RoiAlign", [x, rois, b], want, attrs, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(want, onnx_reference("RoiAlign", [x, rois, b], attrs, opset=22))


def test_roi_align_defaults_are_half_pixel_avg_1x1_adaptive():
    x, rois, b = roi_inputs(r=4)
    want = onnx_reference("RoiAlign", [x, rois, b], {"coordinate_transformation_mode": "half_pixel"}, opset=16)
    (got,) = check_op("RoiAlign", [x, rois, b], want, rtol=1e-5, atol=1e-6)
    assert got.shape == (4, 3, 1, 1)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float16, 2e-3)])
def test_roi_align_other_float_types(dtype, tol):
    x, rois, b = roi_inputs(dtype)
    attrs = {"mode": "avg", "output_height": 2, "output_width": 2, "sampling_ratio": 2}
    (got,) = check_op("RoiAlign", [x, rois, b], None, attrs)
    assert got.dtype == dtype
    want = onnx_reference("RoiAlign", [x.astype(np.float64), rois.astype(np.float64), b], attrs, opset=16)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def test_roi_align_bfloat16_rounds_the_float32_result():
    import ml_dtypes
    x, rois, b = roi_inputs()
    attrs = {"mode": "max", "output_height": 2, "output_width": 3}
    bf = ml_dtypes.bfloat16
    (got,) = check_op("RoiAlign", [x.astype(bf), rois.astype(bf), b], None, attrs)
    (ref,) = check_op("RoiAlign", [x.astype(bf).astype(F32), rois.astype(bf).astype(F32), b], None, attrs)
    np.testing.assert_array_equal(got, ref.astype(bf))


def test_roi_align_empty_rois_and_channels():
    x, rois, b = roi_inputs()
    (got,) = check_op("RoiAlign", [x, rois[:0], b[:0]], None, {"output_height": 2, "output_width": 3})
    assert got.shape == (0, 3, 2, 3)
    (got,) = check_op("RoiAlign", [x[:, :0], rois, b], None, {"output_height": 2})
    assert got.shape == (7, 0, 2, 1)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_roi_align_non_finite_roi_is_an_error(bad):
    x, rois, b = roi_inputs(r=3)
    rois[1, 2] = bad
    g, feeds = build_single("RoiAlign", [x, rois, b], {"output_height": 2, "output_width": 2})
    with pytest.raises(KilnError, match=r"rois \[1\] have non-finite coordinates"):
        evaluate(g, feeds)


def test_roi_align_huge_adaptive_grid_is_an_error():
    x, rois, b = roi_inputs(r=2)
    rois[1] = [0, 0, 1e30, 1e30]
    g, feeds = build_single("RoiAlign", [x, rois, b])
    with pytest.raises(KilnError, match=r"rois \[1\] ask for adaptive sampling grids of over 2\*\*31 points"):
        evaluate(g, feeds)


def test_roi_align_empty_adaptive_grid_gives_zero():
    # half_pixel does not widen RoIs: a 0-size RoI has an adaptive grid of 0 samples; an inverted one, a negative size.
    x, rois, b = roi_inputs(r=2)
    rois[0] = [3, 3, 3, 5]
    rois[1] = [6, 6, 2, 2]
    attrs = {"output_height": 2, "output_width": 2}
    (got,) = check_op("RoiAlign", [x, rois, b], None, attrs)
    assert (got == 0).all()
    want = onnx_reference("RoiAlign", [x, rois, b], {**attrs, "coordinate_transformation_mode": "half_pixel"}, opset=16)
    np.testing.assert_array_equal(got, want)


def test_roi_align_batch_index_out_of_range():
    x, rois, b = roi_inputs(r=2)
    g, feeds = build_single("RoiAlign", [x, rois, np.array([0, 2], np.int64)])
    with pytest.raises(KilnError, match=r"IndexError: batch_indices \[2\] are out of range \[0, 2\)"):
        evaluate(g, feeds)
    with pytest.raises(ShapeInferenceError, match=r"batch_indices \[-1\] are out of range"):
        build_single("RoiAlign", [x, rois, np.array([0, -1], np.int64)], const_inputs=(2,))


@pytest.mark.parametrize("x,rois,r,attrs,match", [
    ((1, 2, 4), (1, 4), 1, {}, "X must have rank 4"),
    ((1, 2, 4, 4), (1, 5), 1, {}, "last dim must be 4"),
    ((1, 2, 4, 4), (2, 4), 3, {}, "different num_rois"),
    ((1, 2, 4, 4), (1, 4), 1, {"mode": "sum"}, "mode must be one of"),
    ((1, 2, 4, 4), (1, 4), 1, {"coordinate_transformation_mode": "asymmetric"},
     "coordinate_transformation_mode must be one of"),
    ((1, 2, 4, 4), (1, 4), 1, {"output_height": 0}, "output_height must be >= 1"),
    ((1, 2, 4, 4), (1, 4), 1, {"sampling_ratio": -1}, "sampling_ratio must be >= 0"),
])
def test_roi_align_inference_names_what_is_wrong(x, rois, r, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("RoiAlign", [np.zeros(x, F32), np.zeros(rois, F32), np.zeros(r, np.int64)], attrs)


def test_roi_align_rois_must_share_x_dtype():
    with pytest.raises(ShapeInferenceError, match="rois is float64 but X is float32"):
        build_single("RoiAlign", [np.zeros((1, 1, 4, 4), F32), np.zeros((1, 4)), np.zeros(1, np.int64)])


def test_roi_align_output_shape_with_a_symbolic_batch():
    x, rois, b = roi_inputs(r=3)
    assert inferred("RoiAlign", [x, rois, b], {"output_height": 2}) == [(3, 3, 2, 1)]


# --------------------------------------------------------------------------- DeformConv


def deform_inputs(n=2, c=4, size=(6, 7), m=6, kernel=(3, 2), og=2, group=2, out=None, scale=1.5,
                  dtype=F32, bias=True, mask=True):
    out = out or tuple(s - k + 1 for s, k in zip(size, kernel))
    taps = int(np.prod(kernel))
    x = RNG.standard_normal((n, c, *size)).astype(dtype)
    w = RNG.standard_normal((m, c // group, *kernel)).astype(dtype)
    off = (RNG.standard_normal((n, og * taps * len(size), *out)) * scale).astype(dtype)
    b = RNG.standard_normal(m).astype(dtype) if bias else None
    msk = RNG.uniform(0, 1, (n, og * taps, *out)).astype(dtype) if mask else None
    return [x, w, off, b, msk]


@pytest.mark.parametrize("bias,mask,og,group", list(itertools.product([False, True], [False, True], [1, 2], [1, 2])))
def test_deform_conv_matches_onnx_reference(bias, mask, og, group):
    ins = deform_inputs(og=og, group=group, bias=bias, mask=mask)
    want = onnx_reference("DeformConv", ins, {"offset_group": og, "group": group}, opset=22)
    check_op("DeformConv", ins, want, {"offset_group": og, "group": group}, rtol=1e-5, atol=1e-5,
             symbolic_batch=True)


@pytest.mark.parametrize("pads,strides,dilations", [
    ([1, 1, 1, 1], [1, 1], [1, 1]), ([2, 0, 1, 3], [2, 1], [1, 1]), ([0, 1, 0, 1], [1, 2], [2, 1]),
    ([1, 2, 2, 1], [2, 3], [2, 2])])
def test_deform_conv_window_attributes_match_onnx_reference(pads, strides, dilations):
    size, kernel = (7, 8), (3, 2)
    out = tuple((s + pads[i] + pads[i + 2] - ((k - 1) * d + 1)) // st + 1
                for i, (s, k, d, st) in enumerate(zip(size, kernel, dilations, strides)))
    ins = deform_inputs(size=size, kernel=kernel, out=out, og=2, group=1, m=3)
    attrs = {"pads": pads, "strides": strides, "dilations": dilations, "kernel_shape": list(kernel),
             "offset_group": 2}
    want = onnx_reference("DeformConv", ins, attrs, opset=19)
    check_op("DeformConv", ins, want, attrs, rtol=1e-5, atol=1e-5)


def plain_deform_conv(x, w, off, b, msk, pads, strides, dilations, og, group):
    """A loop over every output element, kernel tap and interpolation corner (N-D)."""
    n, c, *dims = x.shape
    m, cpg, *kernel = w.shape
    nd = len(dims)
    out = off.shape[2:]
    off = off.reshape(n, og, *kernel, nd, *out)
    msk = np.ones((n, og, *kernel, *out)) if msk is None else msk.reshape(n, og, *kernel, *out)
    y = np.zeros((n, m, *out))
    for bi, oc, o in itertools.product(range(n), range(m), itertools.product(*map(range, out))):
        g = oc // (m // group)
        acc = 0.0 if b is None else float(b[oc])
        for ci in range(cpg):
            ic = g * cpg + ci
            gi = ic // (c // og)
            for k in itertools.product(*map(range, kernel)):
                p = [o[i] * strides[i] - pads[i] + k[i] * dilations[i] + off[(bi, gi, *k, i, *o)] for i in range(nd)]
                v = 0.0
                for corner in itertools.product((0, 1), repeat=nd):
                    idx = [int(np.floor(p[i])) + corner[i] for i in range(nd)]
                    if all(0 <= idx[i] < dims[i] for i in range(nd)):
                        wt = np.prod([(p[i] - np.floor(p[i])) if corner[i] else 1 - (p[i] - np.floor(p[i]))
                                      for i in range(nd)])
                        v += wt * x[(bi, ic, *idx)]
                acc += w[(oc, ci, *k)] * msk[(bi, gi, *k, *o)] * v
        y[(bi, oc, *o)] = acc
    return y


@pytest.mark.parametrize("size,kernel,pads,strides,dilations", [
    ((9,), (3,), [1, 2], [2], [1]), ((4, 5, 4), (2, 3, 2), [0, 1, 0, 1, 0, 1], [1, 2, 1], [1, 1, 2])])
def test_deform_conv_1d_and_3d_against_a_plain_loop(size, kernel, pads, strides, dilations):
    nd = len(size)
    out = tuple((s + pads[i] + pads[i + nd] - ((k - 1) * d + 1)) // st + 1
                for i, (s, k, d, st) in enumerate(zip(size, kernel, dilations, strides)))
    ins = deform_inputs(n=1, c=4, size=size, m=2, kernel=kernel, og=2, group=2, out=out)
    attrs = {"pads": pads, "strides": strides, "dilations": dilations, "offset_group": 2, "group": 2}
    want = plain_deform_conv(*[a if a is None else a.astype(np.float64) for a in ins], pads, strides, dilations, 2, 2)
    check_op("DeformConv", ins, want.astype(F32), attrs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,kernel", [((8,), (3,)), ((5, 6), (2, 3)), ((4, 3, 5), (2, 2, 3))])
def test_deform_conv_without_offsets_is_conv(size, kernel):
    nd = len(size)
    pads, strides = [1] * nd + [0] * nd, [2] + [1] * (nd - 1)
    out = tuple((s + pads[i] + pads[i + nd] - k) // strides[i] + 1 for i, (s, k) in enumerate(zip(size, kernel)))
    x, w, off, b, _ = deform_inputs(n=2, c=4, size=size, m=4, kernel=kernel, og=1, group=2, out=out, mask=False)
    off[:] = 0
    attrs = {"pads": pads, "strides": strides, "group": 2}
    want = conv(x, w, b, auto_pad="NOTSET", dilations=None, group=2, kernel_shape=None, pads=pads, strides=strides)
    check_op("DeformConv", [x, w, off, b], want, attrs, rtol=1e-5, atol=1e-5)
    # An integer offset of +1 along the last axis moves every window one place on: the conv with that axis's begin
    # padding (1) moved to its end.
    off[:, nd - 1::nd] = 1
    moved = list(pads)
    moved[nd - 1], moved[2 * nd - 1] = 0, pads[2 * nd - 1] + 1
    want = conv(x, w, b, auto_pad="NOTSET", dilations=None, group=2, kernel_shape=None, pads=moved, strides=strides)
    check_op("DeformConv", [x, w, off, b], want, attrs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float16, 1e-2)])
def test_deform_conv_other_float_types(dtype, tol):
    ins = deform_inputs(n=1, size=(4, 5), dtype=dtype, scale=0.8)
    (got,) = check_op("DeformConv", ins, None, {"offset_group": 2, "group": 2})
    assert got.dtype == dtype
    # (not the reference evaluator: its GridSample samples in float32)
    want = plain_deform_conv(*[a.astype(np.float64) for a in ins], [0] * 4, [1, 1], [1, 1], 2, 2)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


def test_deform_conv_empty_batch_and_bias_only_output():
    ins = deform_inputs(n=0)
    (got,) = check_op("DeformConv", ins, None, {"offset_group": 2, "group": 2})
    assert got.shape == (0, 6, 4, 6)
    x, w, off, b, msk = deform_inputs()
    # No input channels: the output is the bias.
    (got,) = check_op("DeformConv", [x[:, :0], w[:, :0], off, b, msk], None, {"offset_group": 2, "group": 2})
    np.testing.assert_array_equal(got, np.broadcast_to(b.reshape(-1, 1, 1), (2, 6, 4, 6)))


def _dc_error(ins, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("DeformConv", ins, attrs)


def test_deform_conv_inference_names_what_is_wrong():
    x, w, off, b, msk = deform_inputs()
    ok = {"offset_group": 2, "group": 2}
    _dc_error([x, w, off[:, :-1]], ok, r"offset must have shape \[N, offset_group\*3\*2\*2, 4, 6\]")
    _dc_error([x, w, off[..., :-1]], ok, "offset must have shape")
    _dc_error([x, w, off, b, msk[:, 1:]], ok, r"mask must have shape \[N, offset_group\*3\*2, 4, 6\]")
    _dc_error([x, w, off, b[:-1]], ok, r"bias B must have shape \[6\]")
    _dc_error([x, w, off], {"offset_group": 3, "group": 2}, r"input channels C \(4\) is not divisible by offset_group")
    _dc_error([x, w, off], {"offset_group": 2, "group": 1}, "X has 4 channels but W .* with group=1 expects 2")
    _dc_error([x, w[:5], off], ok, r"output channels oC \(5\) is not divisible by group")
    _dc_error([x, w, off], {**ok, "kernel_shape": [2, 2]}, r"kernel_shape \[2, 2\] does not match W")
    _dc_error([x, w, off], {**ok, "group": 0}, "group must be >= 1")
    _dc_error([x, w, off], {**ok, "pads": [0, 0]}, "pads has 2 values, expected 4")
    _dc_error([x[:, :, :2], w, off], ok, "smaller than the window extent 3")
    _dc_error([x, w[..., 0], off], ok, "W must have the rank of X")
    _dc_error([x, w.astype(np.float64), off], ok, "W is float64 but X is float32")


# --------------------------------------------------------------------------- import and export


def _model(op, inputs, attrs, opset, out_type=None):
    import onnx
    from onnx import helper
    out_type = onnx.TensorProto.UNDEFINED if out_type is None else out_type
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in zip(names, inputs)]
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run_imported(model, inputs):
    import kiln
    from kiln.serializer.onnx_import import import_onnx
    g = import_onnx(model)
    return g, kiln.load(g).run(inputs, as_list=True)[0]


def test_import_roi_align_10_means_output_half_pixel():
    ort = pytest.importorskip("onnxruntime")
    x, rois, b = roi_inputs()
    attrs = {"output_height": 3, "output_width": 2, "mode": "avg"}
    model = _model("RoiAlign", [x, rois, b], attrs, 10, out_type=1)  # float
    model.ir_version = 8  # what every onnxruntime reads (onnx 1.23's default, 14, is past onnxruntime 1.30's 13)
    g, got = _run_imported(model, [x, rois, b])
    assert g.nodes[0].attrs["coordinate_transformation_mode"] == "output_half_pixel"
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"i0": x, "i1": rois, "i2": b})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, onnx_reference("RoiAlign", [x, rois, b], {
        **attrs, "coordinate_transformation_mode": "output_half_pixel"}, opset=16), rtol=1e-5, atol=1e-6)


def test_import_nms_10_and_deform_conv_19():
    boxes, scores = nms_inputs(1, 2, 20)
    inputs = [boxes, scores, scalar(5, np.int64), scalar(0.4, F32)]
    _, got = _run_imported(_model("NonMaxSuppression", inputs, {}, 10), inputs)
    np.testing.assert_array_equal(got, onnx_reference("NonMaxSuppression", inputs, {}, opset=11))
    ins = deform_inputs(bias=False, mask=False)
    _, got = _run_imported(_model("DeformConv", ins[:3], {"offset_group": 2, "group": 2}, 19), ins[:3])
    np.testing.assert_allclose(got, onnx_reference("DeformConv", ins[:3], {"offset_group": 2, "group": 2}, opset=19),
                               rtol=1e-5, atol=1e-5)


def test_roi_align_export_runs_at_opset_18_and_checks_at_22():
    """RoiAlign exports as itself; ONNX Runtime has no RoiAlign-22 kernel (its CPU kernels stop at 16, the reason
    the onnx node tests test_roialign_* fail there), so opset 22 is checked with onnx.checker and run by ONNX's
    reference evaluator instead."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx.reference import ReferenceEvaluator

    from kiln.serializer import onnx as kx
    x, rois, b = roi_inputs()
    for attrs in ({"output_height": 3, "output_width": 2, "sampling_ratio": 2},
                  {"mode": "max", "coordinate_transformation_mode": "output_half_pixel", "spatial_scale": 0.5}):
        g, feeds = build_single("RoiAlign", [x, rois, b], attrs, symbolic_batch=True)
        want = evaluate(g, feeds)[0]
        assert kx.default_opset(g) == 18
        for opset in (18, 22):
            model = kx.to_onnx_model(g, opset=opset)
            onnx.checker.check_model(model, full_check=True)
            names = [i.name for i in model.graph.input]
            if opset == 18:
                got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
                    None, dict(zip(names, feeds)))[0]
            else:
                got = ReferenceEvaluator(model).run(None, dict(zip(names, feeds)))[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"opset {opset}")


def test_deform_conv_export_needs_opset_19_and_bfloat16_22():
    pytest.importorskip("onnx")
    import ml_dtypes

    from kiln.serializer import onnx as kx
    g, _ = build_single("DeformConv", deform_inputs()[:3], {"offset_group": 2, "group": 2})
    assert kx.default_opset(g) == 19
    with pytest.raises(UnsupportedOpError, match="opset 18 has no op 'DeformConv'"):
        kx.to_onnx_model(g, opset=18)
    bf = ml_dtypes.bfloat16
    g, _ = build_single("DeformConv", [a.astype(bf) for a in deform_inputs()[:3]], {"offset_group": 2, "group": 2})
    assert kx.default_opset(g) == 22
    x, rois, b = roi_inputs()
    g, _ = build_single("RoiAlign", [x.astype(bf), rois.astype(bf), b])
    assert kx.default_opset(g) == 22
