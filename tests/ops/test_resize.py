"""Resize (ONNX Resize-19): the reference against onnx.reference (every mode, coordinate mode,
nearest rounding rule, antialias, exclude_outside, scales/sizes/axes/keep_aspect_ratio_policy,
roi with extrapolation, dtypes) and against torch's kernels; inference with static and
symbolic dims; refusals. check_op also runs every case through the CPU runtime's kernel."""
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st
from op_harness import build_single, check_op, i64, inferred

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph
from kiln.ir.ops.resize import DEFAULTS, output_geometry, resize, source_coordinates
from kiln.ir.passes.shape_inference import infer_shapes

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

MODES = ["nearest", "linear", "cubic"]
COORDS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
          "tf_crop_and_resize"]
ROUNDING = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
               np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.uint8): TensorProto.UINT8,
               np.dtype(np.int32): TensorProto.INT32}


def onnx_resize(x, roi=None, scales=None, sizes=None, **attrs):
    """onnx.reference's Resize-19 on the same inputs."""
    names = ["X", "roi" if roi is not None else "", "scales" if scales is not None else "",
             "sizes" if sizes is not None else ""]
    while names[-1] == "":
        names.pop()
    ins = [helper.make_tensor_value_info("X", _ONNX_TYPES[x.dtype], x.shape)]
    feeds = {"X": x}
    for name, a, t in (("roi", roi, TensorProto.FLOAT), ("scales", scales, TensorProto.FLOAT),
                       ("sizes", sizes, TensorProto.INT64)):
        if a is not None:
            ins.append(helper.make_tensor_value_info(name, t, a.shape))
            feeds[name] = a
    if attrs.get("axes") is not None:  # onnx.reference does not take negative axes
        attrs = dict(attrs, axes=[a % x.ndim for a in attrs["axes"]])
    node = helper.make_node("Resize", names, ["Y"], **attrs)
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y", _ONNX_TYPES[x.dtype], None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    return ReferenceEvaluator(model).run(None, feeds)[0]


def check_against_onnx(x, roi=None, scales=None, sizes=None, tol=1e-5, **attrs):
    want = onnx_resize(x, roi, scales, sizes, **attrs)
    inputs = [x, roi, scales, sizes]
    while inputs[-1] is None:
        inputs.pop()
    got = check_op("Resize", inputs, attrs=attrs, const_inputs=(1, 2, 3))[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    return got


ROI = np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7], np.float32)


def _cases():
    for mode, coord in itertools.product(MODES, COORDS):
        rounding = ROUNDING if mode == "nearest" else ["round_prefer_floor"]
        filters = [(0, 0)] if mode == "nearest" else [(0, 0), (1, 0), (0, 1), (1, 1)]
        for rule, (aa, ex) in itertools.product(rounding, filters):
            yield mode, coord, rule, aa, ex


@pytest.mark.parametrize("mode,coord,rule,antialias,exclude", list(_cases()))
@pytest.mark.parametrize("how", ["scales", "sizes"])
def test_matches_onnx_reference(mode, coord, rule, antialias, exclude, how, rng):
    attrs = dict(mode=mode, coordinate_transformation_mode=coord, nearest_mode=rule, antialias=antialias,
                 exclude_outside=exclude, extrapolation_value=-3.0, cubic_coeff_a=-0.6)
    roi = ROI if coord == "tf_crop_and_resize" else None
    for shape, sc, sz in [((1, 2, 5, 7), [1, 1, 2.5, 0.6], [1, 2, 7, 3]),
                          ((2, 1, 9, 6), [1, 1, 0.25, 1.7], [2, 1, 4, 13])]:
        x = rng.standard_normal(shape).astype(np.float32)
        if how == "scales":
            check_against_onnx(x, roi, np.array(sc, np.float32), **attrs)
        else:
            check_against_onnx(x, roi, None, i64(*sz), **attrs)


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("axes", [None, [2, 3], [3, 2], [-1]])
def test_axes_and_aspect_policies(policy, axes, rng):
    x = rng.standard_normal((1, 2, 6, 9)).astype(np.float32)
    n = 4 if axes is None else len(axes)
    sizes = i64(*([1, 2, 10, 5][-n:] if axes != [3, 2] else [5, 10]))
    attrs = dict(mode="linear", keep_aspect_ratio_policy=policy)
    if axes is not None:
        attrs["axes"] = axes
    got = check_against_onnx(x, None, None, sizes, **attrs)
    if policy == "not_larger" and axes in ([2, 3], [3, 2]):
        assert got.shape == (1, 2, 3, 5)  # min(10/6, 5/9) = 5/9 on both axes


def test_scales_with_axes_and_roi_with_axes(rng):
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    check_against_onnx(x, None, np.array([0.5, 3.0], np.float32), axes=[3, 1], mode="nearest")
    roi = np.array([0.1, 0.25, 0.9, 0.75], np.float32)
    check_against_onnx(x, roi, None, i64(6, 4), axes=[2, 3], mode="linear",
                       coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=7.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.uint8, np.int32])
@pytest.mark.parametrize("mode", MODES)
def test_dtypes(dtype, mode, rng):
    x = (rng.standard_normal((1, 1, 6, 5)) * 40 + 100).astype(dtype)
    # onnx.reference evaluates the cubic kernel in float32 (its cubic_coeff_a is a numpy float32).
    tol = 1e-2 if dtype == np.float16 else 1e-5 if mode == "cubic" else 1e-9
    # Integer outputs round half to even and saturate (cubic overshoots past 255 here and there).
    check_against_onnx(x, None, np.array([1, 1, 1.8, 0.7], np.float32), tol=tol, mode=mode)


def test_nearest_rounding_rules_by_hand():
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # asymmetric x0.5 downsample of [0..3] to 8 samples at 0, .5, 1, ...
    half = dict(mode="nearest", coordinate_transformation_mode="asymmetric")
    s = np.array([1, 2], np.float32)
    cases = {"round_prefer_floor": [0, 0, 1, 1, 2, 2, 3, 3], "round_prefer_ceil": [0, 1, 1, 2, 2, 3, 3, 3],
             "floor": [0, 0, 1, 1, 2, 2, 3, 3], "ceil": [0, 1, 1, 2, 2, 3, 3, 3]}
    for rule, want in cases.items():
        check_op("Resize", [x, None, s], np.array([want], np.float32), attrs=dict(half, nearest_mode=rule),
                 const_inputs=(2,))


def test_linear_by_hand():
    x = np.array([[0.0, 10.0]], np.float32)
    want = np.array([[0.0, 2.5, 7.5, 10.0]], np.float32)  # half_pixel x2: 3/4-1/4 blends, clamped ends
    check_op("Resize", [x, None, np.array([1, 2], np.float32)], want, attrs={"mode": "linear"}, const_inputs=(2,))
    ac = np.array([[0.0, 10 / 3, 20 / 3, 10.0]], np.float32)
    check_op("Resize", [x, None, None, i64(1, 4)], ac, attrs={"mode": "linear",
             "coordinate_transformation_mode": "align_corners"}, const_inputs=(3,))


@st.composite
def resize_case(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(rank))
    mode = draw(st.sampled_from(MODES))
    attrs = dict(mode=mode, coordinate_transformation_mode=draw(st.sampled_from(COORDS[:-1])),
                 nearest_mode=draw(st.sampled_from(ROUNDING)),
                 antialias=draw(st.integers(0, 1)) if mode != "nearest" else 0,
                 exclude_outside=draw(st.integers(0, 1)) if mode != "nearest" else 0)
    if draw(st.booleans()):
        scales = np.array([draw(st.sampled_from([0.25, 0.5, 0.6, 1.0, 1.5, 2.0, 3.0])) for _ in shape], np.float32)
        scales = np.where(np.floor(scales * np.array(shape)) < 1, 1.0, scales).astype(np.float32)
        return shape, attrs, scales, None
    sizes = np.array([draw(st.integers(1, 9)) for _ in shape], np.int64)
    return shape, attrs, None, sizes


def _near_integer_coordinate(shape, attrs, scales, sizes) -> bool:
    """Whether some source coordinate lies within 1e-9 of an integer without being one. There
    onnx.reference takes the weights from x but the window from x + padding, where the float sum
    may round to the integer: it then reads the pixel left of x (half_pixel_symmetric x0.5 of 7
    pixels: x = 1.0000000000000002, the reference answers pixel 0, the math pixel 1)."""
    plan_attrs = {**DEFAULTS, **attrs}
    out, scale, _ = output_geometry(shape, None, scales, sizes, plan_attrs)
    for a, d in enumerate(shape):
        if out[a] and d:
            x, _ = source_coordinates(d, out[a], scale[a], plan_attrs["coordinate_transformation_mode"])
            off = np.abs(x - np.round(x))
            if np.any((off > 0) & (off < 1e-9)):
                return True
    return False


@given(resize_case(), st.integers(0, 2**31 - 1))
def test_hypothesis_matches_onnx_reference(case, seed):
    shape, attrs, scales, sizes = case
    assume(not _near_integer_coordinate(shape, attrs, scales, sizes))
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_against_onnx(x, None, scales, sizes, **attrs)


def test_a_coordinate_a_hair_past_an_integer_reads_that_pixel():
    # The case above: kiln stays continuous (weight 1 - 2e-16 on pixel 1), where the reference jumps.
    x = np.arange(7, dtype=np.float32) * 10
    got = resize(x, None, np.array([0.5], np.float32), None, mode="linear",
                 coordinate_transformation_mode="half_pixel_symmetric")
    np.testing.assert_allclose(got, [10, 30, 50], atol=1e-5)


# ---------------------------------------------------------------------------- against torch
def test_reference_matches_torch_kernels(torch, rng):
    F = torch.nn.functional
    x = rng.standard_normal((2, 3, 9, 14))
    tx = torch.from_numpy(x)
    size = i64(2, 3, 6, 31)
    pairs = [
        (F.interpolate(tx, size=(6, 31), mode="bilinear"), dict(mode="linear")),
        (F.interpolate(tx, size=(6, 31), mode="bilinear", align_corners=True),
         dict(mode="linear", coordinate_transformation_mode="align_corners")),
        (F.interpolate(tx, size=(6, 31), mode="bicubic"), dict(mode="cubic")),
        (F.interpolate(tx, size=(6, 31), mode="bicubic", antialias=True),
         dict(mode="cubic", cubic_coeff_a=-0.5, antialias=1, exclude_outside=1)),
        (F.interpolate(tx, size=(6, 31), mode="bilinear", antialias=True),
         dict(mode="linear", antialias=1, exclude_outside=1)),
        (F.interpolate(tx, size=(6, 31), mode="nearest"),
         dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
        (F.interpolate(tx, size=(6, 31), mode="nearest-exact"),
         dict(mode="nearest", nearest_mode="round_prefer_ceil")),
    ]
    for want, attrs in pairs:
        got = resize(x, None, None, size, **attrs)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-10, err_msg=str(attrs))


# ---------------------------------------------------------------------------- inference
def test_inference_static_and_symbolic():
    s2 = np.array([1, 1, 2, 2], np.float32)
    assert inferred("Resize", [np.zeros((3, 4, 5, 6), np.float32), None, s2], const_inputs=(2,)) == \
        [("batch", 4, 10, 12)]
    g = Graph("t")
    x = g.add_input("x", "float32", ["n", 3, "h", 8])
    sc = g.add_initializer("s", np.array([1, 1, 2, 0.5], np.float32))
    node = g.add_node("Resize", [x, None, sc], {"mode": "linear"})
    g.outputs = list(node.outputs)
    infer_shapes(g)
    # scale 1 keeps a symbol; symbol x 2 is no dim the IR can name; static dims are exact.
    assert g.outputs[0].type.shape == ("n", 3, None, 4)


def test_inference_keeps_symbolic_sizes():
    g = Graph("t")
    x = g.add_input("x", "float32", ["n", 3, "h", "w"])
    skip = g.add_input("skip", "float32", ["n", 6, "H", "W"])
    hw = g.add_node("Shape", [skip], {"start": 2}).outputs[0]
    node = g.add_node("Resize", [x, None, None, hw], {"mode": "linear", "axes": [2, 3]})
    g.outputs = list(node.outputs)
    infer_shapes(g)
    assert g.outputs[0].type.shape == ("n", 3, "H", "W")


def test_inference_aspect_policy_is_static():
    got = inferred("Resize", [np.zeros((1, 2, 6, 9), np.float32), None, None, i64(10, 5)],
                   {"axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}, const_inputs=(3,))
    assert got == [("batch", 2, 10, 15)]


@pytest.mark.parametrize("inputs,attrs,msg", [
    ([np.zeros((1, 4), np.float32), None, np.ones(2, np.float32), i64(1, 4)], {}, "not both"),
    ([np.zeros((1, 4), np.float32)], {}, "must be given"),
    ([np.zeros((1, 4), np.float32), None, np.ones(3, np.float32)], {}, "one per resized axis"),
    ([np.zeros((1, 4), np.float32), None, np.ones(2, np.float32)], {"mode": "bilinear"}, "mode 'bilinear'"),
    ([np.zeros((1, 4), np.float32), None, np.ones(2, np.float32)], {"nearest_mode": "round"}, "nearest_mode"),
    ([np.zeros((1, 4), np.float32), None, np.array([1, 0], np.float32)], {}, "positive"),
    ([np.zeros((1, 4), np.float32), None, None, i64(1, 4)], {"axes": [1, -1]}, "twice"),
])
def test_inference_refuses(inputs, attrs, msg):
    with pytest.raises(ShapeInferenceError, match=msg):
        build_single("Resize", inputs, attrs, const_inputs=(1, 2, 3))


def test_empty_scales_mean_absent(rng):
    # Resize-11/13 files spell "no scales" as an empty tensor.
    x = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    got = resize(x, np.zeros(0, np.float32), np.zeros(0, np.float32), i64(1, 1, 6, 2), mode="linear")
    np.testing.assert_allclose(got, resize(x, None, None, i64(1, 1, 6, 2), mode="linear"))
