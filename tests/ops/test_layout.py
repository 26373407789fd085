"""Pad (Pad-19, with wrap), DepthToSpace and SpaceToDepth (SpaceToDepth-28, with CRD) against torch (F.pad,
pixel_shuffle), index loops and ONNX's reference evaluator."""
from __future__ import annotations

import numpy as np
import pytest
from op_harness import build_single, check_op, i64, inferred, onnx_reference

from kiln.errors import KilnError, ShapeInferenceError




def arange(shape, dtype=np.float32) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return np.arange(n).reshape(shape).astype(dtype)






# --------------------------------------------------------------------------- Pad

TORCH_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}


def torch_pad(torch, x, pads, axes, mode, value=0.0):
    """ONNX pads ([begins..., ends...] over axes) done one axis at a time with torch's F.pad,
    which pads the last axis of a (rows, length) view."""
    F = torch.nn.functional
    t = torch.from_numpy(x)
    n = len(axes)
    for j, a in enumerate(axes):
        moved = t.movedim(a, -1)
        flat = moved.reshape(-1, moved.shape[-1])
        if mode == "constant":
            flat = F.pad(flat, (pads[j], pads[j + n]), value=value)
        else:
            flat = F.pad(flat.unsqueeze(0), (pads[j], pads[j + n]), mode=TORCH_MODES[mode]).squeeze(0)
        t = flat.reshape(*moved.shape[:-1], flat.shape[-1]).movedim(-1, a)
    return t.numpy()


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("pads, axes", [((1, 2, 0, 1), None), ((2, 0, 1, 2), (1, 2)), ((1, 3), (-1,)),
                                        ((0, 0, 0, 0), (0, 2))])
def test_pad_modes(torch, mode, pads, axes):
    x = arange((2, 3, 4), np.float64)
    axes_list = list(axes) if axes is not None else [0, 1]
    if axes is None:
        pads = pads[:2] + (0,) + pads[2:] + (0,)
        axes_list = [0, 1, 2]
    axes_list = [a % 3 for a in axes_list]
    expected = torch_pad(torch, x, pads, axes_list, mode)
    inputs = [x, i64(*pads)] if axes is None else [x, i64(*pads), None, i64(*axes)]
    check_op("Pad", inputs, expected, {"mode": mode}, const_inputs=[1, 3])


@pytest.mark.parametrize("dtype, value", [(np.float32, 2.5), (np.int32, -7), (np.float16, 0.0)])
def test_pad_constant_value_and_crop(torch, dtype, value):
    x = arange((3, 5), dtype)
    pads = (1, -2, -1, 3)  # grow axis 0 at the front, crop it at the back; the reverse on axis 1
    expected = torch_pad(torch, x, pads, [0, 1], "constant", value)
    check_op("Pad", [x, i64(*pads), np.array(value, dtype)], expected, const_inputs=[1, 2])


def test_pad_hand_values():
    x = np.array([[1, 2, 3]], np.int64)
    check_op("Pad", [x, i64(0, 2, 0, 1)], np.array([[3, 2, 1, 2, 3, 2]]), {"mode": "reflect"}, const_inputs=[1])
    check_op("Pad", [x, i64(0, 2, 0, 1)], np.array([[1, 1, 1, 2, 3, 3]]), {"mode": "edge"}, const_inputs=[1])


def test_pad_inference():
    x = arange((2, 3, 4))
    assert inferred("Pad", [x, i64(0, 1, 0, 2), None, i64(0, 2)], const_inputs=[1, 3]) == [("batch", 3, 7)]
    assert inferred("Pad", [x, i64(1, 1)], const_inputs=[]) == [(None, None, None)]
    assert inferred("Pad", [x, i64(1, 1), None, i64(1)], const_inputs=[3]) == [("batch", None, 4)]
    with pytest.raises(ShapeInferenceError, match=r"node 'pad' \(Pad\).*2 values per padded axis"):
        build_single("Pad", [x, i64(1, 1)], const_inputs=[1])
    with pytest.raises(ShapeInferenceError, match="crop more"):
        build_single("Pad", [x, i64(0, -2, 0, 0, -2, 0)], const_inputs=[1])
    with pytest.raises(ShapeInferenceError, match=r"mode 'torus' is not one of constant, reflect, edge, wrap"):
        build_single("Pad", [x, i64(0, 0, 0, 0, 0, 0)], {"mode": "torus"}, const_inputs=[1])
    assert inferred("Pad", [x, i64(0, 5, -1, 0, 9, 2)], {"mode": "wrap"}, const_inputs=[1]) == [("batch", 17, 5)]
    with pytest.raises(ShapeInferenceError, match="constant_value is int64"):
        build_single("Pad", [x, i64(0, 0, 0, 0, 0, 0), np.array(1, np.int64)], const_inputs=[1, 2])


# --------------------------------------------------------------------------- Pad-19 wrap


def wrap_loops(x, pads, axes):
    """mode 'wrap' one axis at a time: negative pads crop first, then output position i reads (i - begin) mod n."""
    n_axes = len(axes)
    for j, a in enumerate(axes):
        begin, end = pads[j], pads[j + n_axes]
        x = np.moveaxis(x, a, 0)
        x = x[max(-begin, 0):x.shape[0] - max(-end, 0)]
        size = x.shape[0]
        length = size + max(begin, 0) + max(end, 0)
        x = np.moveaxis(np.stack([x[(i - max(begin, 0)) % size] for i in range(length)]), 0, a)
    return x


@pytest.mark.parametrize("pads, axes", [((0, 1, 1, 0, 1, 1), None), ((2, 3, 1, 4), (1, 2)), ((9, 0), (-1,)),
                                        ((0, 0, 0, 0), (0, 2)), ((1, 2, 3, 0, 7, 2), None)])
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float16, np.bool_])
def test_pad_wrap_matches_onnx_reference(pads, axes, dtype):
    """Pad-19 mode 'wrap' (the data as a torus); pads may exceed the axis, wrapping more than once."""
    x = (arange((2, 3, 4)) % 5).astype(dtype)
    inputs = [x, i64(*pads)] if axes is None else [x, i64(*pads), None, i64(*axes)]
    want = onnx_reference("Pad", inputs, {"mode": "wrap"}, opset=19)
    check_op("Pad", inputs, want, {"mode": "wrap"}, const_inputs=[1, 3], symbolic_batch=True)
    axes_list = [a % 3 for a in axes] if axes is not None else [0, 1, 2]
    np.testing.assert_array_equal(want, wrap_loops(x, pads, axes_list))


@pytest.mark.parametrize("pads", [(-1, 1), (1, -1), (-1, 5), (-2, -1), (-3, 6)])
def test_pad_wrap_crops_then_wraps(pads):
    """Negative pads crop, and what is left wraps around (onnxruntime's order: [1, 2, 3, 4] with pads (-1, 1) is
    [2, 3, 4, 2]); ONNX's reference (numpy's pad) takes no negative pads."""
    x = np.array([1, 2, 3, 4], np.float32)
    check_op("Pad", [x, i64(*pads)], wrap_loops(x, pads, [0]), {"mode": "wrap"}, const_inputs=[1])
    assert check_op("Pad", [x, i64(-1, 1)], None, {"mode": "wrap"}, const_inputs=[1])[0].tolist() == [2, 3, 4, 2]


def test_pad_wrap_hand_values_and_empty():
    x = np.array([[1, 2, 3]], np.int64)
    check_op("Pad", [x, i64(0, 2, 0, 4)], np.array([[2, 3, 1, 2, 3, 1, 2, 3, 1]]), {"mode": "wrap"}, const_inputs=[1])
    empty = np.zeros((0, 3), np.float32)
    check_op("Pad", [empty, i64(0, 1, 0, 1)], np.zeros((0, 5), np.float32), {"mode": "wrap"}, const_inputs=[1])
    with pytest.raises(KilnError, match="mode 'wrap' cannot pad axis 0 by \\(1, 0\\)"):
        check_op("Pad", [empty, i64(1, 0, 0, 0)], None, {"mode": "wrap"}, const_inputs=[1])


def test_pad_wrap_exports_at_opset_19_and_is_refused_below():
    """Pad-19 brought 'wrap': an export picks opset 19 for it, and asking for 18 is refused by name."""
    pytest.importorskip("onnx")
    from kiln.serializer import onnx as kx
    g, _ = build_single("Pad", [arange((2, 3)), i64(1, 0, 0, 2)], {"mode": "wrap"}, const_inputs=[1])
    assert kx.default_opset(g) == 19
    assert [n.op_type for n in kx.to_onnx_model(g).graph.node] == ["Pad"]
    with pytest.raises(KilnError, match="Pad with mode 'wrap' needs ai.onnx opset 19"):
        kx.to_onnx_model(g, opset=18)
    g, _ = build_single("Pad", [arange((2, 3)), i64(1, 0, 0, 2)], {"mode": "reflect"}, const_inputs=[1])
    assert kx.default_opset(g) == 18


# --------------------------------------------------------------------------- DepthToSpace / SpaceToDepth


def depth_to_space_loops(x, b, mode) -> np.ndarray:
    n, c, h, w = x.shape
    depth = c // (b * b)
    out = np.empty((n, depth, h * b, w * b), x.dtype)
    for d in range(depth):
        for i in range(b):
            for j in range(b):
                src = (i * b + j) * depth + d if mode == "DCR" else d * b * b + i * b + j
                out[:, d, i::b, j::b] = x[:, src]
    return out


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_depth_to_space(mode, b, dtype):
    x = arange((2, 2 * b * b, 3, 2), dtype)
    check_op("DepthToSpace", [x], depth_to_space_loops(x, b, mode), {"blocksize": b, "mode": mode},
             symbolic_batch=True)


def test_depth_to_space_crd_is_pixel_shuffle(torch):
    x = arange((1, 8, 3, 3))
    check_op("DepthToSpace", [x], torch.nn.functional.pixel_shuffle(torch.from_numpy(x), 2).numpy(),
             {"blocksize": 2, "mode": "CRD"})


@pytest.mark.parametrize("b", [1, 2, 3])
def test_space_to_depth_inverts_dcr(b):
    y = arange((2, 3, 2 * b, 3 * b), np.float16)
    x = check_op("SpaceToDepth", [y], None, {"blocksize": b}, symbolic_batch=True)[0]
    assert x.shape == (2, 3 * b * b, 2, 3)
    np.testing.assert_array_equal(depth_to_space_loops(x, b, "DCR"), y)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_])
def test_space_to_depth_modes_match_onnx_reference(mode, b, dtype):
    """SpaceToDepth-28: CRD orders the channels (depth, block row, block col), DCR (block row, block col, depth);
    each inverts DepthToSpace of its mode."""
    y = (arange((2, 3, 2 * b, 3 * b)) % 7).astype(dtype)
    want = onnx_reference("SpaceToDepth", [y], {"blocksize": b, "mode": mode}, opset=28)
    x = check_op("SpaceToDepth", [y], want, {"blocksize": b, "mode": mode}, symbolic_batch=True)[0]
    np.testing.assert_array_equal(depth_to_space_loops(x, b, mode), y)


def test_space_to_depth_crd_is_pixel_unshuffle(torch):
    y = arange((1, 2, 4, 6))
    check_op("SpaceToDepth", [y], torch.nn.functional.pixel_unshuffle(torch.from_numpy(y), 2).numpy(),
             {"blocksize": 2, "mode": "CRD"})
    check_op("SpaceToDepth", [np.zeros((0, 2, 4, 6), np.float32)], np.zeros((0, 8, 2, 3), np.float32),
             {"blocksize": 2, "mode": "CRD"})


def test_space_depth_inference():
    x = arange((1, 8, 4, 6))
    assert inferred("DepthToSpace", [x], {"blocksize": 2}) == [("batch", 2, 8, 12)]
    assert inferred("SpaceToDepth", [x], {"blocksize": 2}) == [("batch", 32, 2, 3)]
    with pytest.raises(ShapeInferenceError, match="not divisible by 9"):
        build_single("DepthToSpace", [x], {"blocksize": 3})
    with pytest.raises(ShapeInferenceError, match="height of size 4 is not divisible by 3"):
        build_single("SpaceToDepth", [x], {"blocksize": 3})
    with pytest.raises(ShapeInferenceError, match="must be 4-D"):
        build_single("SpaceToDepth", [arange((8, 4, 6))], {"blocksize": 2})
    assert inferred("SpaceToDepth", [x], {"blocksize": 2, "mode": "CRD"}) == [("batch", 32, 2, 3)]
    with pytest.raises(ShapeInferenceError, match=r"\(SpaceToDepth\).*mode 'RCD' is not DCR or CRD"):
        build_single("SpaceToDepth", [x], {"blocksize": 2, "mode": "RCD"})
