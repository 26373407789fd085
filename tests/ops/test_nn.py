"""Conv and ConvTranspose: references against torch (computed in float64), shape inference
with symbolic dims, and inference failures."""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph
from kiln.ir.passes.shape_inference import infer_shapes

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL = {np.float16: dict(rtol=2e-2, atol=3e-2), np.float32: dict(rtol=1e-4, atol=1e-4),
       np.float64: dict(rtol=1e-10, atol=1e-10)}
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def t64(a):
    return None if a is None else torch.from_numpy(np.asarray(a, np.float64))


def torch_pads(begin, end):
    """ONNX per-dim (begin, end) pads in F.pad's order: last dim first."""
    out = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [b, e]
    return out


def infer_type(op, x_shape, w, attrs=None, dtype="float32"):
    """Output type of ``op`` for an X of (possibly symbolic) shape and a constant W."""
    g = Graph("t")
    x = g.add_input("x", dtype, x_shape)
    node = g.add_node(op, [x, g.add_initializer("w", w)], attrs or {})
    g.outputs = list(node.outputs)
    infer_shapes(g)
    return g.outputs[0].type


# --------------------------------------------------------------------------- Conv

CONV_CASES = [
    # (spatial, C, M, kernel, strides, pads, dilations, group, bias)
    ((9, 8), 4, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    ((9, 8), 4, 6, (3, 2), (2, 1), (1, 0), (1, 1), 2, False),
    ((11, 10), 4, 4, (3, 3), (1, 1), (2, 2), (2, 2), 4, True),  # depthwise, dilated
    ((7, 7), 3, 6, (3, 3), (2, 2), (1, 1), (1, 1), 3, True),  # depthwise with multiplier 2
    ((10, 9), 2, 3, (1, 1), (2, 3), (0, 0), (1, 1), 1, True),
    ((12,), 3, 5, (4,), (2,), (1,), (3,), 1, True),  # 1-D
    ((5, 6, 7), 2, 4, (3, 2, 3), (1, 2, 2), (1, 0, 1), (1, 1, 2), 2, True),  # 3-D
]


@pytest.mark.parametrize("spatial,c,m,k,s,p,d,group,bias", CONV_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_conv_matches_torch(rng, spatial, c, m, k, s, p, d, group, bias, dtype):
    x = rand(rng, (2, c) + spatial, dtype)
    w = rand(rng, (m, c // group) + k, dtype)
    b = rand(rng, (m,), dtype) if bias else None
    expected = CONV[len(k)](t64(x), t64(w), t64(b), stride=s, padding=p, dilation=d, groups=group).numpy()
    attrs = dict(strides=s, pads=p + p, dilations=d, group=group)
    check_op("Conv", [x, w, b], expected, attrs, const_inputs=[1, 2], symbolic_batch=True, **TOL[dtype])


def test_conv_asymmetric_pads(rng):
    x, w = rand(rng, (1, 3, 8, 7)), rand(rng, (4, 3, 3, 3))
    begin, end = (0, 2), (3, 1)
    padded = F.pad(t64(x), torch_pads(begin, end))
    expected = F.conv2d(padded, t64(w), stride=2).numpy()
    check_op("Conv", [x, w], expected, dict(pads=begin + end, strides=(2, 2)), **TOL[np.float32])


def test_conv_kernel_shape_attr_and_no_bias(rng):
    x, w = rand(rng, (2, 3, 6, 6)), rand(rng, (5, 3, 2, 3))
    expected = F.conv2d(t64(x), t64(w)).numpy()
    check_op("Conv", [x, w], expected, dict(kernel_shape=(2, 3)), **TOL[np.float32])


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("size", [7, 8])
def test_conv_same_upper_stride1_is_torch_same(rng, size):
    # torch's padding="same" puts the odd pad at the end, like SAME_UPPER.
    x, w = rand(rng, (1, 2, size, size)), rand(rng, (3, 2, 4, 3))
    expected = F.conv2d(t64(x), t64(w), padding="same", dilation=(1, 2)).numpy()
    check_op("Conv", [x, w], expected, dict(auto_pad="SAME_UPPER", dilations=(1, 2)), **TOL[np.float32])


@pytest.mark.parametrize("auto_pad,begin,end", [("SAME_UPPER", (1, 0), (2, 1)),
                                                ("SAME_LOWER", (2, 1), (1, 0)),
                                                ("VALID", (0, 0), (0, 0))])
def test_conv_auto_pad_stride2(rng, auto_pad, begin, end):
    # X 9x8, kernel 4x3, stride 2: SAME gives 5x4 outputs, total pads 3 and 1 (worked out by hand).
    x, w = rand(rng, (1, 2, 9, 8)), rand(rng, (3, 2, 4, 3))
    padded = F.pad(t64(x), torch_pads(begin, end))
    expected = F.conv2d(padded, t64(w), stride=2).numpy()
    check_op("Conv", [x, w], expected, dict(auto_pad=auto_pad, strides=(2, 2)), **TOL[np.float32])


def test_conv_hand_computed():
    x = np.arange(1, 6, dtype=np.float32).reshape(1, 1, 5)
    w = np.array([[[1, 0, -1]]], np.float32)
    check_op("Conv", [x, w, np.array([10], np.float32)], np.array([[[8, 8, 8]]], np.float32))


def test_conv_symbolic_dims():
    w = np.zeros((8, 3, 3, 3), np.float32)
    t = infer_type("Conv", ("batch", 3, 32, 30), w, dict(strides=(2, 2), pads=(1, 1, 1, 1)))
    assert t.shape == ("batch", 8, 16, 15)
    assert infer_type("Conv", ("batch", 3, "h", "w"), w).shape == ("batch", 8, None, None)
    # A 1x1 stride-1 conv and a stride-1 SAME conv keep symbolic spatial dims.
    w1 = np.zeros((8, 3, 1, 1), np.float32)
    assert infer_type("Conv", ("batch", 3, "h", "w"), w1).shape == ("batch", 8, "h", "w")
    assert infer_type("Conv", (1, 3, "h", 9), w, dict(auto_pad="SAME_LOWER")).shape == (1, 8, "h", 9)


@pytest.mark.parametrize("x_shape,w_shape,b_shape,attrs,match", [
    ((1, 4, 8, 8), (6, 3, 3, 3), None, {}, "X has 4 channels"),
    ((1, 4, 8, 8), (6, 2, 3, 3), None, {}, "expects 2"),
    ((1, 4, 8, 8), (5, 2, 3, 3), None, dict(group=2), r"output channels M \(5\) is not divisible"),
    ((1, 4, 8, 8), (6, 4, 3, 3), None, dict(kernel_shape=(3, 2)), "kernel_shape"),
    ((1, 4, 2, 8), (6, 4, 3, 3), None, {}, "smaller than the window extent 3"),
    ((1, 4, 8, 8), (6, 4, 3, 3), None, dict(auto_pad="SAME"), "auto_pad must be one of"),
    ((1, 4, 8, 8), (6, 4, 3, 3), None, dict(auto_pad="VALID", pads=(1, 1, 1, 1)), "cannot be combined"),
    ((1, 4, 8, 8), (6, 4, 3, 3), None, dict(pads=(1, 1)), "pads has 2 values, expected 4"),
    ((1, 4, 8, 8), (6, 4, 3, 3), None, dict(strides=(0, 1)), "strides must be >= 1"),
    ((1, 4, 8, 8), (6, 4, 3, 3), (5,), {}, "bias B must have shape"),
    ((1, 4, 8, 8), (6, 4, 3), None, {}, "same rank"),
    ((4, 8), (6, 4), None, {}, "rank >= 3"),
])
def test_conv_bad_inputs_fail(x_shape, w_shape, b_shape, attrs, match):
    inputs = [np.zeros(x_shape, np.float32), np.zeros(w_shape, np.float32),
              None if b_shape is None else np.zeros(b_shape, np.float32)]
    with pytest.raises(ShapeInferenceError, match=rf"'conv' \(Conv\).*{match}"):
        build_single("Conv", inputs, attrs)


@given(st.data())
def test_conv_property_matches_torch(data):
    draw = data.draw
    group = draw(st.sampled_from([1, 2]))
    c, m = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    k = tuple(draw(st.integers(1, 3)) for _ in range(2))
    s = tuple(draw(st.integers(1, 3)) for _ in range(2))
    d = tuple(draw(st.integers(1, 2)) for _ in range(2))
    p = tuple(draw(st.integers(0, 2)) for _ in range(2))
    size = tuple((kk - 1) * dd + 1 + draw(st.integers(0, 4)) for kk, dd in zip(k, d))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x, w = rand(rng, (1, c) + size), rand(rng, (m, c // group) + k)
    expected = F.conv2d(t64(x), t64(w), stride=s, padding=p, dilation=d, groups=group).numpy()
    check_op("Conv", [x, w], expected, dict(strides=s, pads=p + p, dilations=d, group=group), **TOL[np.float32])


# --------------------------------------------------------------------------- ConvTranspose

CONV_T_CASES = [
    # (spatial, C, M, kernel, strides, pads, output_padding, dilations, group, bias)
    ((4, 5), 3, 2, (3, 3), (1, 1), (0, 0), (0, 0), (1, 1), 1, True),
    ((4, 5), 4, 6, (3, 2), (2, 2), (1, 0), (1, 1), (1, 2), 2, True),
    ((5, 4), 4, 4, (3, 3), (2, 3), (1, 1), (0, 2), (1, 1), 4, False),  # depthwise
    ((3, 3), 2, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True),  # the usual 2x upsampler
    ((6,), 2, 3, (3,), (3,), (1,), (2,), (2,), 1, True),  # 1-D
    ((3, 4, 3), 2, 2, (2, 3, 2), (2, 1, 2), (0, 1, 1), (1, 0, 0), (1, 1, 1), 1, True),  # 3-D
]


@pytest.mark.parametrize("spatial,c,m,k,s,p,op,d,group,bias", CONV_T_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_conv_transpose_matches_torch(rng, spatial, c, m, k, s, p, op, d, group, bias, dtype):
    x = rand(rng, (2, c) + spatial, dtype)
    w = rand(rng, (c, m // group) + k, dtype)
    b = rand(rng, (m,), dtype) if bias else None
    expected = CONV_T[len(k)](t64(x), t64(w), t64(b), stride=s, padding=p, output_padding=op,
                              dilation=d, groups=group).numpy()
    attrs = dict(strides=s, pads=p + p, output_padding=op, dilations=d, group=group)
    check_op("ConvTranspose", [x, w, b], expected, attrs, const_inputs=[1, 2], symbolic_batch=True, **TOL[dtype])


def test_conv_transpose_asymmetric_pads_crop_the_full_result(rng):
    x, w = rand(rng, (1, 2, 4, 3)), rand(rng, (2, 3, 3, 3))
    full = F.conv_transpose2d(t64(x), t64(w), stride=2).numpy()  # 9x7
    expected = full[:, :, 0:9 - 2, 1:7 - 0]
    check_op("ConvTranspose", [x, w], expected, dict(strides=(2, 2), pads=(0, 1, 2, 0)), **TOL[np.float32])


@pytest.mark.parametrize("p,op", [(1, 0), (1, 1), (2, 1)])
def test_conv_transpose_output_shape_attr(rng, p, op):
    # Asking for torch's output size (padding p, output_padding op) crops the same positions.
    x, w = rand(rng, (1, 2, 5, 4)), rand(rng, (2, 2, 4, 4))
    expected = F.conv_transpose2d(t64(x), t64(w), stride=2, padding=p, output_padding=op).numpy()
    check_op("ConvTranspose", [x, w], expected, dict(strides=(2, 2), output_shape=expected.shape[2:]),
             **TOL[np.float32])


@pytest.mark.parametrize("auto_pad,expected", [("SAME_UPPER", [1, 1, 3, 2]), ("SAME_LOWER", [1, 3, 2, 2])])
def test_conv_transpose_auto_pad_hand_computed(auto_pad, expected):
    # Full result of x=[1,2] * w=[1,1,1] at stride 2 is [1,1,3,2,2]; SAME keeps 2*2 = 4 positions.
    x = np.array([[[1, 2]]], np.float32)
    w = np.ones((1, 1, 3), np.float32)
    check_op("ConvTranspose", [x, w], np.array([[expected]], np.float32), dict(auto_pad=auto_pad, strides=(2,)))


def test_conv_transpose_output_shape_beyond_the_full_result_pads_with_zeros():
    # Full result [1,1,3,2,2] (see above); asking for 7 positions adds one zero on each side.
    x = np.array([[[1, 2]]], np.float32)
    w = np.ones((1, 1, 3), np.float32)
    expected = np.array([[[0, 1, 1, 3, 2, 2, 0]]], np.float32)
    check_op("ConvTranspose", [x, w], expected, dict(strides=(2,), output_shape=(7,)))


def test_conv_transpose_symbolic_dims():
    w = np.zeros((8, 4, 4, 4), np.float32)
    t = infer_type("ConvTranspose", ("batch", 8, 7, 5), w, dict(strides=(2, 2), pads=(1, 1, 1, 1), group=2))
    assert t.shape == ("batch", 8, 14, 10)
    assert infer_type("ConvTranspose", ("batch", 8, "h", 5), w).shape == ("batch", 4, None, 8)
    t = infer_type("ConvTranspose", ("batch", 8, "h", 5), w, dict(auto_pad="SAME_UPPER"))
    assert t.shape == ("batch", 4, "h", 5)


@pytest.mark.parametrize("x_shape,w_shape,b_shape,attrs,match", [
    ((1, 4, 5, 5), (3, 2, 3, 3), None, {}, "X has 4 channels"),
    ((1, 3, 5, 5), (3, 2, 3, 3), None, dict(group=2), r"input channels C \(3\) is not divisible"),
    ((1, 4, 5, 5), (4, 2, 3, 3), (3,), dict(group=2), r"bias B must have shape \[4\]"),
    ((1, 4, 1, 1), (4, 2, 3, 3), None, dict(pads=(2, 2, 1, 1)), "leave no output"),
    ((1, 4, 5, 5), (4, 2, 3, 3), None, dict(output_shape=(9,)), "2 spatial dims"),
])
def test_conv_transpose_bad_inputs_fail(x_shape, w_shape, b_shape, attrs, match):
    inputs = [np.zeros(x_shape, np.float32), np.zeros(w_shape, np.float32),
              None if b_shape is None else np.zeros(b_shape, np.float32)]
    with pytest.raises(ShapeInferenceError, match=rf"\(ConvTranspose\).*{match}"):
        build_single("ConvTranspose", inputs, attrs)
