"""GridSample: every mode, padding mode and align_corners setting against ONNX's reference evaluator, on grids
that reach past the borders; 3-D (volumetric) input; GridSample-16's mode names; named inference errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from op_harness import build_single, check_op

ref = pytest.importorskip("onnx.reference.ops.op_grid_sample")
RNG = np.random.default_rng(16)


def onnx_grid_sample(x, grid, **attrs):
    node = ref.GridSample.__new__(ref.GridSample)
    node.mode, node.padding_mode, node.align_corners = "linear", "zeros", 0  # what _run falls back to
    return node._run(x, grid, mode=attrs.get("mode", "linear"), padding_mode=attrs.get("padding_mode", "zeros"),
                     align_corners=attrs.get("align_corners", 0))[0]


@pytest.mark.parametrize("mode,padding,align", list(itertools.product(["linear", "nearest", "cubic"],
                                                                        ["zeros", "border", "reflection"], [0, 1])))
def test_2d_matches_onnx_reference(mode, padding, align):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    grid = RNG.uniform(-1.6, 1.6, (2, 3, 6, 2)).astype(np.float32)  # some positions outside the image
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_op("GridSample", [x, grid], onnx_grid_sample(x, grid, **attrs), attrs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_3d_volumetric(mode):
    x = RNG.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    grid = RNG.uniform(-1.2, 1.2, (1, 2, 3, 2, 3)).astype(np.float32)
    attrs = {"mode": mode, "padding_mode": "reflection"}
    check_op("GridSample", [x, grid], onnx_grid_sample(x, grid, **attrs), attrs, rtol=1e-5, atol=1e-5)


def test_opset_16_mode_names_are_taken():
    x = RNG.standard_normal((1, 1, 3, 3)).astype(np.float32)
    grid = RNG.uniform(-1, 1, (1, 2, 2, 2)).astype(np.float32)
    (a,) = check_op("GridSample", [x, grid], None, {"mode": "bilinear"})
    (b,) = check_op("GridSample", [x, grid], None, {"mode": "linear"})
    np.testing.assert_array_equal(a, b)


def test_identity_grid_with_align_corners_returns_the_image():
    x = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)
    ys, xs = np.meshgrid(np.linspace(-1, 1, 3), np.linspace(-1, 1, 4), indexing="ij")
    grid = np.stack([xs, ys], -1)[None].astype(np.float32)
    check_op("GridSample", [x, grid], x, {"align_corners": 1}, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x_shape,grid_shape,attrs,match", [
    ((1, 1, 3, 3), (1, 2, 2, 3), {}, "last dim must be 2"),
    ((1, 1, 3, 3), (1, 2, 2), {}, "grid must have rank 4"),
    ((1, 1, 3, 3, 3), (1, 2, 2, 2, 3), {"mode": "cubic"}, "cubic mode takes 4-D"),
    ((1, 1, 3, 3), (1, 2, 2, 2), {"mode": "area"}, "mode must be one of"),
    ((1, 1, 3, 3), (1, 2, 2, 2), {"padding_mode": "wrap"}, "padding_mode must be one of"),
])
def test_inference_names_what_is_wrong(x_shape, grid_shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("GridSample", [np.zeros(x_shape, np.float32), np.zeros(grid_shape, np.float32)], attrs)
