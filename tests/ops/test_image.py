"""AffineGrid, Col2Im, CenterCropPad and MaxUnpool (kiln.ir.ops.image) against ONNX's reference evaluator over
their attributes, with 2-D and 3-D forms, empty tensors, negative axes, narrow and integer dtypes, symbolic batch,
shape inputs given at run time, and the named inference and run-time errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph, evaluate
from op_harness import build_single, check_op, i64, inferred, onnx_reference

RNG = np.random.default_rng(20)


def _f(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- AffineGrid


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # ONNX's reference on a 1-wide dim, aligned
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 2, 4), (2, 3, 1, 1), (2, 1, 1, 3, 1)])
def test_affine_grid_matches_onnx_reference(size, align):
    r = len(size) - 2
    theta = _f(2, r, r + 1)
    want = onnx_reference("AffineGrid", [theta, i64(*size)], {"align_corners": align}, opset=20)
    check_op("AffineGrid", [theta, i64(*size)], want, {"align_corners": align}, const_inputs=(1,), rtol=1e-6,
             atol=1e-6)


def test_affine_grid_with_the_size_given_at_run_time_and_a_symbolic_batch():
    theta = _f(3, 2, 3)
    want = onnx_reference("AffineGrid", [theta, i64(3, 2, 4, 6)], {}, opset=20)
    check_op("AffineGrid", [theta, i64(3, 2, 4, 6)], want, {}, rtol=1e-6, atol=1e-6)
    assert inferred("AffineGrid", [theta, i64(3, 2, 4, 6)]) == [("batch", None, None, 2)]
    assert inferred("AffineGrid", [theta, i64(3, 2, 4, 6)], const_inputs=(1,)) == [(3, 4, 6, 2)]


def test_affine_grid_identity_theta_gives_the_base_grid():
    theta = np.array([[[1, 0, 0], [0, 1, 0]]], np.float32)
    (grid,) = check_op("AffineGrid", [theta, i64(1, 1, 2, 3)], None, {"align_corners": 1}, const_inputs=(1,))
    np.testing.assert_allclose(grid[0, :, :, 0], [[-1, 0, 1], [-1, 0, 1]])
    np.testing.assert_allclose(grid[0, :, :, 1], [[-1, -1, -1], [1, 1, 1]])
    (grid,) = check_op("AffineGrid", [theta, i64(1, 1, 2, 4)], None, {"align_corners": 0}, const_inputs=(1,))
    np.testing.assert_allclose(grid[0, 0, :, 0], [-0.75, -0.25, 0.25, 0.75])
    np.testing.assert_allclose(grid[0, :, 0, 1], [-0.5, 0.5])


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_affine_grid_keeps_theta_dtype(dtype):
    theta = _f(2, 3, 4, dtype=dtype)
    want = onnx_reference("AffineGrid", [theta.astype(np.float32), i64(2, 1, 2, 3, 4)], {"align_corners": 1}, opset=20)
    (got,) = check_op("AffineGrid", [theta, i64(2, 1, 2, 3, 4)], None, {"align_corners": 1}, const_inputs=(1,))
    assert got.dtype == dtype
    tol = 2e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def test_affine_grid_empty():
    (got,) = check_op("AffineGrid", [_f(0, 2, 3), i64(0, 3, 4, 5)], None, {}, const_inputs=(1,))
    assert got.shape == (0, 4, 5, 2)
    (got,) = check_op("AffineGrid", [_f(2, 2, 3), i64(2, 3, 0, 5)], None, {}, const_inputs=(1,))
    assert got.shape == (2, 0, 5, 2)


@pytest.mark.parametrize("theta_shape,size,attrs,match", [
    ((2, 2, 4), (2, 3, 4, 5), {}, r"theta must be \[N, 2, 3\]"),
    ((2, 4, 5), (2, 3, 4, 5), {}, r"theta must be \[N, 2, 3\]"),
    ((2, 6), (2, 3, 4, 5), {}, "theta must have rank 3"),
    ((2, 2, 3), (2, 3, 4, 5, 6), {}, r"size must hold 4 \(\[N, C, H, W\]\) elements"),
    ((2, 3, 4), (2, 3, 4, 5), {}, r"size must hold 5 \(\[N, C, D, H, W\]\) elements"),
    ((2, 2, 3), (3, 3, 4, 5), {}, "size's batch 3 is not theta's 2"),
    ((2, 2, 3), (2, 3, -4, 5), {}, "negative dim"),
    ((2, 2, 3), (2, 3, 4, 5), {"align_corners": 2}, "align_corners must be 0 or 1"),
])
def test_affine_grid_inference_names_what_is_wrong(theta_shape, size, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("AffineGrid", [np.zeros(theta_shape, np.float32), i64(*size)], attrs, const_inputs=(1,))


def test_affine_grid_size_at_run_time_is_checked():
    g, feeds = build_single("AffineGrid", [_f(2, 2, 3), i64(3, 1, 4, 5)], {})
    with pytest.raises(KilnError, match="size's batch 3 is not theta's 2"):
        evaluate(g, feeds)


# --------------------------------------------------------------------------- Col2Im


COL2IM_CASES = [  # (C, image, block, attrs)
    (1, (5, 5), (1, 5), {}),
    (3, (5, 5), (2, 2), {}),
    (2, (6, 7), (2, 3), {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 0, 2]}),
    (1, (5, 5), (1, 5), {"pads": [0, 1, 0, 1]}),
    (2, (3, 4, 5), (1, 2, 2), {"strides": [1, 2, 1]}),
    (2, (9,), (3,), {"strides": [2], "dilations": [2], "pads": [1, 2]}),
]


def _blocks(image, block, attrs):
    n = len(image)
    st, dl = attrs.get("strides", [1] * n), attrs.get("dilations", [1] * n)
    pads = attrs.get("pads", [0] * 2 * n)
    return int(np.prod([(d + pads[i] + pads[i + n] - (dl[i] * (b - 1) + 1)) // st[i] + 1
                        for i, (d, b) in enumerate(zip(image, block))]))


@pytest.mark.parametrize("c,image,block,attrs", COL2IM_CASES)
def test_col2im_matches_onnx_reference(c, image, block, attrs):
    x = _f(2, c * int(np.prod(block)), _blocks(image, block, attrs))
    want = onnx_reference("Col2Im", [x, i64(*image), i64(*block)], attrs)
    check_op("Col2Im", [x, i64(*image), i64(*block)], want, attrs, const_inputs=(1, 2), rtol=1e-6, atol=1e-6,
             symbolic_batch=True)


def test_col2im_shapes_given_at_run_time():
    c, image, block, attrs = COL2IM_CASES[2]
    x = _f(1, c * int(np.prod(block)), _blocks(image, block, attrs))
    want = onnx_reference("Col2Im", [x, i64(*image), i64(*block)], attrs)
    check_op("Col2Im", [x, i64(*image), i64(*block)], want, attrs, rtol=1e-6, atol=1e-6)
    assert inferred("Col2Im", [x, i64(*image), i64(*block)], attrs) == [("batch", None, None, None)]


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.uint8, np.bool_])
def test_col2im_dtypes(dtype):
    x = (RNG.integers(0, 3, (1, 2 * 4, 16)) if dtype != np.float16 else _f(1, 8, 16)).astype(dtype)
    want = onnx_reference("Col2Im", [x.astype(np.float64), i64(5, 5), i64(2, 2)], {})
    (got,) = check_op("Col2Im", [x, i64(5, 5), i64(2, 2)], None, {}, const_inputs=(1, 2))
    assert got.dtype == dtype
    if dtype == np.bool_:
        want = want > 0  # overlapping blocks: a logical or
    np.testing.assert_allclose(got.astype(np.float64), want.astype(dtype).astype(np.float64), rtol=1e-3, atol=1e-3)


def test_col2im_empty_batch():
    (got,) = check_op("Col2Im", [_f(0, 4, 16), i64(5, 5), i64(2, 2)], None, {}, const_inputs=(1, 2))
    assert got.shape == (0, 1, 5, 5)


@pytest.mark.parametrize("x_shape,image,block,attrs,match", [
    ((1, 7, 16), (5, 5), (2, 2), {}, r"dim 1 \(7\) is not a multiple of prod\(block_shape"),
    ((1, 4, 15), (5, 5), (2, 2), {}, "input has 15 blocks"),
    ((1, 4, 16), (5, 5, 5), (2, 2), {}, "image_shape has 3 elements and block_shape 2"),
    ((1, 4, 16), (5, 5), (2, 2), {"strides": [1]}, "must have 2, 2 and 4 entries"),
    ((1, 4, 16), (5, 5), (2, 2), {"strides": [0, 1]}, "must be >= 1"),
    ((1, 4, 16), (5, 5), (2, 2), {"pads": [0, 0, -1, 0]}, "pads .* must be >= 0"),
    ((1, 4, 16), (5, 5), (0, 2), {}, "block_shape .* must be >= 1"),
    ((1, 36, 1), (5, 5), (6, 6), {}, "spans 6 .* more than the padded image"),
    ((4, 16), (5, 5), (2, 2), {}, "input must have rank 3"),
])
def test_col2im_inference_names_what_is_wrong(x_shape, image, block, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("Col2Im", [np.zeros(x_shape, np.float32), i64(*image), i64(*block)], attrs, const_inputs=(1, 2))


def test_col2im_run_time_shapes_are_checked():
    g, feeds = build_single("Col2Im", [_f(1, 4, 15), i64(5, 5), i64(2, 2)], {})
    with pytest.raises(KilnError, match="input has 15 blocks"):
        evaluate(g, feeds)


# --------------------------------------------------------------------------- CenterCropPad


@pytest.mark.parametrize("x_shape,shape,axes", [
    ((20, 10, 3), (10, 7, 3), None),     # crop, odd difference
    ((10, 7, 3), (20, 10, 3), None),     # pad, odd difference
    ((20, 8, 3), (10, 10, 3), None),     # crop one axis, pad another
    ((20, 8, 3), (10, 9), [0, 1]),
    ((3, 20, 8), (10, 9), [1, 2]),
    ((20, 8, 3), (11, 9), [-3, -2]),
    ((2, 5, 6), (7,), [-1]),
    ((4, 6), (0, 6), None),              # to an empty output
    ((0, 6), (3, 2), None),              # from an empty input: all zeros
])
def test_center_crop_pad_matches_onnx_reference(x_shape, shape, axes):
    x = _f(*x_shape)
    attrs = {} if axes is None else {"axes": axes}
    want = onnx_reference("CenterCropPad", [x, i64(*shape)], attrs)
    check_op("CenterCropPad", [x, i64(*shape)], want, attrs, const_inputs=(1,))
    check_op("CenterCropPad", [x, i64(*shape)], want, attrs)  # the shape given at run time


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.uint64, np.bool_, np.int64])
def test_center_crop_pad_dtypes_and_int32_shape(dtype):
    x = RNG.integers(0, 5, (4, 5)).astype(dtype)
    shape = np.array([3, 8], np.int32)
    want = onnx_reference("CenterCropPad", [x, shape], {})
    (got,) = check_op("CenterCropPad", [x, shape], want, {}, const_inputs=(1,))
    assert got.dtype == dtype


def test_center_crop_pad_inference():
    x = _f(2, 9, 4)
    assert inferred("CenterCropPad", [x, i64(5, 6)], {"axes": [-1, 1]}, const_inputs=(1,)) == [("batch", 6, 5)]
    assert inferred("CenterCropPad", [x, i64(5, 6)], {"axes": [2, 1]}) == [("batch", None, None)]


@pytest.mark.parametrize("shape,attrs,match", [
    ((5, 6), {}, r"shape has 2 elements but there are 3 axes"),
    ((5, 6), {"axes": [1, -2]}, "name an axis twice"),
    ((5,), {"axes": [3]}, "out of range"),
    ((5, -1), {"axes": [1, 2]}, "negative dim"),
])
def test_center_crop_pad_inference_names_what_is_wrong(shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("CenterCropPad", [_f(2, 9, 4), i64(*shape)], attrs, const_inputs=(1,))


def test_center_crop_pad_run_time_shape_is_checked():
    g = Graph("g")
    x, shape = g.add_input("x", "float32", [2, 9, 4]), g.add_input("shape", "int64", [None])
    g.outputs = [g.op("CenterCropPad", x, shape)]
    assert g.outputs[0].type.shape == (None, None, None)
    with pytest.raises(KilnError, match="one element per axis"):
        evaluate(g, [_f(2, 9, 4), i64(5, 6)])


# --------------------------------------------------------------------------- MaxUnpool


def _pool_indices(x_shape, kernel, strides, pads, out_spatial):
    """Valid MaxPool-style flat indices: one position inside each window of an image of out_spatial dims."""
    n, c, *dims = x_shape
    r = len(dims)
    idx = np.zeros(x_shape, np.int64)
    for pos in itertools.product(*(range(v) for v in x_shape)):
        nn_, cc, *win = pos
        spot = [min(max(w * s - pads[i] + RNG.integers(0, k), 0), out_spatial[i] - 1)
                for i, (w, s, k) in enumerate(zip(win, strides, kernel))]
        idx[pos] = np.ravel_multi_index((nn_, cc, *spot), (n, c, *out_spatial))
    assert r == len(kernel)
    return idx


@pytest.mark.parametrize("x_shape,attrs", [
    ((1, 1, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 3, 3, 4), {"kernel_shape": [2, 3], "strides": [2, 1]}),
    ((2, 3, 3, 3), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 0]}),
    ((1, 2, 5), {"kernel_shape": [2]}),                                   # strides default to 1: windows overlap
    ((1, 2, 2, 2, 2), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
])
def test_max_unpool_matches_onnx_reference(x_shape, attrs):
    r = len(x_shape) - 2
    st, pads = attrs.get("strides", [1] * r), attrs.get("pads", [0] * 2 * r)
    out = [(d - 1) * s - pads[i] - pads[i + r] + k for i, (d, s, k) in enumerate(zip(x_shape[2:], st, attrs["kernel_shape"]))]
    x = _f(*x_shape)
    idx = _pool_indices(x_shape, attrs["kernel_shape"], st, pads, out)
    want = onnx_reference("MaxUnpool", [x, idx], attrs)
    check_op("MaxUnpool", [x, idx], want, attrs, symbolic_batch=True)


@pytest.mark.parametrize("output_shape", [(1, 2, 4, 4), (1, 2, 5, 5), (1, 2, 4, 7)])
def test_max_unpool_output_shape_extends_the_unpooled_shape(output_shape):
    x = _f(1, 2, 2, 2)
    idx = _pool_indices(x.shape, [2, 2], [2, 2], [0] * 4, [4, 4])
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    want = onnx_reference("MaxUnpool", [x, idx, i64(*output_shape)], attrs)
    check_op("MaxUnpool", [x, idx, i64(*output_shape)], want, attrs, const_inputs=(2,))
    check_op("MaxUnpool", [x, idx, i64(*output_shape)], want, attrs)  # output_shape given at run time
    assert inferred("MaxUnpool", [x, idx, i64(*output_shape)], attrs, const_inputs=(2,)) == [output_shape]
    assert inferred("MaxUnpool", [x, idx, i64(*output_shape)], attrs) == [("batch", 2, None, None)]


def test_max_unpool_repeated_index_keeps_the_last_element():
    x = np.array([[[1, 2, 3]]], np.float32)
    idx = np.array([[[1, 1, 3]]], np.int64)
    (got,) = check_op("MaxUnpool", [x, idx], None, {"kernel_shape": [2]})
    np.testing.assert_array_equal(got, [[[0, 2, 0, 3]]])


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_max_unpool_dtypes(dtype):
    x = _f(1, 1, 2, 2).astype(dtype)
    idx = np.array([[[[5, 7], [13, 15]]]], np.int64)
    want = onnx_reference("MaxUnpool", [x, idx], {"kernel_shape": [2, 2], "strides": [2, 2]})
    (got,) = check_op("MaxUnpool", [x, idx], want, {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert got.dtype == dtype


def test_max_unpool_empty():
    (got,) = check_op("MaxUnpool", [_f(0, 2, 2, 2), np.zeros((0, 2, 2, 2), np.int64)], None,
                      {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert got.shape == (0, 2, 4, 4)


@pytest.mark.parametrize("x_shape,i_shape,attrs,output_shape,match", [
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2]}, None, "must have 2, 2 and 4 entries"),
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2, 0]}, None, "must be >= 1"),
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2, 2], "pads": [0, 0, -1, 0]}, None, "pads .* must be >= 0"),
    ((1, 1, 2, 2), (1, 1, 2, 3), {"kernel_shape": [2, 2]}, None, "I must have X's shape"),
    ((1, 2), (1, 2), {"kernel_shape": []}, None, "X must have rank >= 3"),
    ((1, 1, 1, 1), (1, 1, 1, 1), {"kernel_shape": [1, 1], "pads": [1, 0, 1, 0]}, None, "unpools to -1"),
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 1, 4), "must have 4 elements"),
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 2, 4, 4), "keep X's N and C"),
    ((1, 1, 2, 2), (1, 1, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 1, 3, 4), "smaller than"),
])
def test_max_unpool_inference_names_what_is_wrong(x_shape, i_shape, attrs, output_shape, match):
    inputs = [np.zeros(x_shape, np.float32), np.zeros(i_shape, np.int64)]
    if output_shape is not None:
        inputs.append(i64(*output_shape))
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("MaxUnpool", inputs, attrs, const_inputs=(2,))


@pytest.mark.parametrize("bad", [16, -1])
def test_max_unpool_index_out_of_range_is_an_error(bad):
    g, feeds = build_single("MaxUnpool", [_f(1, 1, 2, 2), np.array([[[[0, 1], [2, bad]]]], np.int64)],
                            {"kernel_shape": [2, 2], "strides": [2, 2]})
    with pytest.raises(KilnError, match=rf"index {bad} is outside \[0, 16\)"):
        evaluate(g, feeds)


def test_max_unpool_run_time_output_shape_is_checked():
    g, feeds = build_single("MaxUnpool", [_f(1, 1, 2, 2), np.zeros((1, 1, 2, 2), np.int64), i64(1, 1, 3, 3)],
                            {"kernel_shape": [2, 2], "strides": [2, 2]})
    with pytest.raises(KilnError, match="at least the unpooled shape"):
        evaluate(g, feeds)


# --------------------------------------------------------------------------- ONNX import and export


def _onnx_model(op, inputs, attrs, opset):
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    names = [f"i{k}" for k in range(len(inputs))]
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in zip(names, inputs)]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", vis,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [9, 10, 11, 18, 22])
def test_max_unpool_imports_at_every_version(opset):
    import kiln
    from kiln.serializer.onnx_import import import_onnx
    x, idx = _f(1, 1, 2, 2), np.array([[[[5, 7], [13, 15]]]], np.int64)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    g = import_onnx(_onnx_model("MaxUnpool", [x, idx, i64(1, 1, 5, 5)], attrs, opset))
    assert g.outputs[0].type.shape == (1, 1, None, None)
    got = kiln.load(g).run([x, idx, i64(1, 1, 5, 5)], as_list=True)[0]
    np.testing.assert_array_equal(got, onnx_reference("MaxUnpool", [x, idx, i64(1, 1, 5, 5)], attrs, opset=22))


def test_affine_grid_export_needs_opset_20():
    pytest.importorskip("onnx")
    from kiln.serializer import onnx as kx
    g, _ = build_single("AffineGrid", [_f(2, 2, 3), i64(2, 1, 3, 4)], {}, const_inputs=(1,))
    assert kx.default_opset(g) == 20
    assert [n.op_type for n in kx.to_onnx_model(g).graph.node] == ["AffineGrid"]
    with pytest.raises(KilnError, match="opset 18 has no op 'AffineGrid'"):
        kx.to_onnx_model(g, opset=18)


def test_max_unpool_bfloat16_export_needs_opset_22():
    pytest.importorskip("onnx")
    from kiln.ir.dtypes import DType
    from kiln.serializer import onnx as kx
    g = Graph("g")
    x, idx = g.add_input("x", DType.BFLOAT16, [1, 1, 2, 2]), g.add_input("i", "int64", [1, 1, 2, 2])
    g.outputs = [g.op("MaxUnpool", x, idx, kernel_shape=[2, 2], strides=[2, 2])]
    assert kx.default_opset(g) == 22
    assert [n.op_type for n in kx.to_onnx_model(g).graph.node] == ["MaxUnpool"]
    with pytest.raises(KilnError, match="MaxUnpool of bfloat16 needs ai.onnx opset 22"):
        kx.to_onnx_model(g, opset=18)


def test_center_crop_pad_int32_shape_is_cast_on_export():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer import onnx as kx
    x, shape = _f(3, 4, 5), np.array([2, 7, 5], np.int32)
    g, feeds = build_single("CenterCropPad", [x, shape], {})
    model = kx.to_onnx_model(g)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Cast", "CenterCropPad"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), feeds)})[0]
    np.testing.assert_array_equal(got, evaluate(g, feeds)[0])
