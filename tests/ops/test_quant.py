"""Quantization ops against ONNX's reference evaluator: DequantizeLinear and QuantizeLinear (versions 10..28:
per-tensor, per-axis and blocked scales, 8- and 16-bit types, output_dtype, precision), DynamicQuantizeLinear,
MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv; inference of every form and its failures; the import of
each ONNX version as it is and the refusal of the types kiln lacks; the ONNX export of the forms newer than the
opsets kiln writes."""
import numpy as np
import pytest
from op_harness import build_single, check_op, onnx_reference

import kiln
from kiln.errors import KilnError, ShapeInferenceError, UnsupportedOpError
from kiln.ir import evaluate
from kiln.ir.passes import fold_constants

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

RNG = np.random.default_rng(22)
Q_TYPES = [np.int8, np.uint8, np.int16, np.uint16]


def onnx_dequantize(x, scale, zero_point=None, axis=None, opset=19, **attrs):
    """DequantizeLinear as ONNX's reference evaluator computes it (its oldest implementation is opset 19's, which
    for 8-bit and int32 inputs and a float32 scale is opset 10/13's meaning)."""
    if axis is not None:
        attrs["axis"] = axis
    return onnx_reference("DequantizeLinear", [x, scale, zero_point], attrs, opset=opset)


def quantized(rng, shape, dtype):
    info = np.iinfo(dtype)
    lo, hi = (max(info.min, -1000), min(info.max, 1000))
    return rng.integers(lo, hi + 1, shape).astype(dtype)


def scales(rng, n):
    return (rng.random(n) * 0.1 + 1e-3).astype(np.float32)


# --------------------------------------------------------------------------- DequantizeLinear


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32])
@pytest.mark.parametrize("with_zero_point", [False, True])
def test_per_tensor_matches_onnx_reference(rng, dtype, with_zero_point):
    x = quantized(rng, (2, 3, 4), dtype)
    scale = np.float32(0.037)
    zp = np.array(dtype(7)) if with_zero_point else None
    inputs = [x, np.array(scale)] + ([zp] if with_zero_point else [])
    check_op("DequantizeLinear", inputs, onnx_dequantize(*inputs), const_inputs=(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("axis", [0, 1, -1, 2])
def test_per_axis_matches_onnx_reference(rng, dtype, axis):
    x = quantized(rng, (3, 4, 5), dtype)
    n = x.shape[axis]
    scale, zp = scales(rng, n), quantized(rng, (n,), dtype)
    expected = onnx_dequantize(x, scale, zp, axis=axis)
    check_op("DequantizeLinear", [x, scale, zp], expected, {"axis": axis}, const_inputs=(1, 2), rtol=0, atol=0)
    check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale, axis=axis), {"axis": axis},
             const_inputs=(1,), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.int16, np.uint16])
def test_16_bit_data_matches_onnx_reference(dtype):
    """DequantizeLinear-21's int16/uint16, over their whole range (exact in float32)."""
    info = np.iinfo(dtype)
    x = np.array([info.min, info.min + 1, -1 if info.min else 1, 0, 1234, info.max - 1, info.max], dtype)
    for zp in (np.array(dtype(-300 if info.min else 300)), None):
        inputs = [x, np.array(0.013, np.float32), zp]
        check_op("DequantizeLinear", inputs, onnx_dequantize(*inputs, opset=21), const_inputs=(1, 2), rtol=0, atol=0)
    per_axis = quantized(RNG, (4, 3), dtype)
    scale, zp = scales(RNG, 3), quantized(RNG, (3,), dtype)
    check_op("DequantizeLinear", [per_axis, scale, zp], onnx_dequantize(per_axis, scale, zp, opset=21),
             const_inputs=(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("shape,axis,block", [((2, 6), 1, 2), ((2, 5), 1, 2), ((5, 3), 0, 3), ((5, 3), -2, 4),
                                              ((2, 3, 7), 2, 3), ((2, 3, 7), -1, 7), ((6,), 0, 4), ((4, 2), 0, 1)])
@pytest.mark.parametrize("dtype", [np.int8, np.uint16])
def test_blocked_matches_onnx_reference(shape, axis, block, dtype):
    """Blocked quantization (21): the scale as x except ceil(D / block) along axis, the last block short where the
    block does not divide D."""
    x = quantized(RNG, shape, dtype)
    s_shape = list(shape)
    s_shape[axis] = -(-shape[axis] // block)
    scale, zp = scales(RNG, s_shape), quantized(RNG, s_shape, dtype)
    attrs = {"axis": axis, "block_size": block}
    check_op("DequantizeLinear", [x, scale, zp], onnx_dequantize(x, scale, zp, opset=21, **attrs), attrs,
             const_inputs=(1, 2), rtol=0, atol=0)
    check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale, opset=21, **attrs), attrs, const_inputs=(1,),
             rtol=0, atol=0)


@pytest.mark.parametrize("scale_dtype,out", [(np.float32, TensorProto.FLOAT16), (np.float16, TensorProto.FLOAT),
                                             (np.float32, TensorProto.FLOAT), (np.float32, TensorProto.BFLOAT16),
                                             ("bfloat16", TensorProto.FLOAT)])
def test_output_dtype_matches_onnx_reference(scale_dtype, out):
    """DequantizeLinear-23's output_dtype: the float32 product rounded once to it, whatever the scale's type."""
    import ml_dtypes
    sd = ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else scale_dtype
    x = quantized(RNG, (3, 4), np.uint8)
    scale, zp = scales(RNG, 3).astype(sd), quantized(RNG, (3,), np.uint8)
    attrs = {"axis": 0, "output_dtype": out}
    want = onnx_dequantize(x, scale, zp, opset=23, **attrs)
    [y] = check_op("DequantizeLinear", [x, scale, zp], want, attrs, const_inputs=(1, 2), rtol=0, atol=0)
    assert y.dtype == helper.tensor_dtype_to_np_dtype(out)


def test_half_scale_gives_a_half_output():
    x = quantized(RNG, (2, 8), np.int8)
    scale = scales(RNG, 8).astype(np.float16)
    [y] = check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale), const_inputs=(1,), rtol=0, atol=0)
    assert y.dtype == np.float16


def test_default_axis_is_one_and_one_element_scale_is_per_tensor(rng):
    x = quantized(rng, (2, 3, 4), np.int8)
    scale = scales(rng, 3)
    check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale), const_inputs=(1,), rtol=0, atol=0)
    one = scales(rng, 1)
    # A [1] scale on an axis of 4 elements: per-tensor, not an error.
    check_op("DequantizeLinear", [x, one], onnx_dequantize(x, one, axis=2), {"axis": 2}, const_inputs=(1,),
             rtol=0, atol=0)


def test_empty_tensors():
    x = np.zeros((0, 4), np.int8)
    check_op("DequantizeLinear", [x, scales(RNG, 4)], np.zeros((0, 4), np.float32), const_inputs=(1,))
    check_op("DequantizeLinear", [x, scales(RNG, (0, 2)), np.zeros((0, 2), np.int8)], np.zeros((0, 4), np.float32),
             {"block_size": 2}, const_inputs=(1, 2))
    check_op("QuantizeLinear", [np.zeros((3, 0), np.float32), scales(RNG, 3)], np.zeros((3, 0), np.uint8),
             {"axis": 0}, const_inputs=(1,))


def test_conv_weight_per_output_channel(rng):
    """The packing layout: int8 [M, C, kh, kw] weight, one scale per output channel (axis 0)."""
    q = quantized(rng, (8, 3, 3, 3), np.int8)
    scale = scales(rng, 8)
    [y] = check_op("DequantizeLinear", [q, scale], onnx_dequantize(q, scale, axis=0), {"axis": 0},
                   const_inputs=(0, 1), rtol=0, atol=0)
    np.testing.assert_array_equal(y[5], q[5].astype(np.float32) * scale[5])


def test_symbolic_batch_is_kept(rng):
    x = quantized(rng, (2, 6), np.uint8)
    scale = scales(rng, 6)
    g, _ = build_single("DequantizeLinear", [x, scale], const_inputs=(1,), symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 6)
    assert str(g.outputs[0].type.dtype) == "float32"


def test_not_folded_on_constant_inputs(rng):
    """Folding would store the float32 weight the int8 one encodes: the packed file's point is lost."""
    q, scale = quantized(rng, (4, 4), np.int8), scales(rng, 4)
    g, _ = build_single("DequantizeLinear", [q, scale], {"axis": 0}, const_inputs=(0, 1))
    assert not fold_constants(g)
    assert [n.op for n in g.nodes] == ["DequantizeLinear"]
    np.testing.assert_array_equal(evaluate(g, [])[0], q.astype(np.float32) * scale[:, None])


@pytest.mark.parametrize("inputs,attrs,match", [
    ([np.zeros((2, 3), np.int8), np.ones((2, 3), np.float32)], {}, "scalar or 1-D"),
    ([np.zeros((2, 3), np.int8), np.ones(4, np.float32)], {}, "4 elements but x has 3 along axis 1"),
    ([np.zeros((2, 3), np.int8), np.ones(2, np.float32)], {"axis": 2}, "axis"),
    ([np.zeros((2, 3), np.int8), np.ones(3, np.float32), np.zeros(3, np.uint8)], {}, "must match"),
    ([np.zeros((2, 3), np.int8), np.ones(3, np.float32), np.zeros(1, np.int8)], {}, "x_zero_point has shape"),
    ([np.zeros((2, 6), np.int8), np.ones((2, 2), np.float32)], {"block_size": 2},
     "has 2 blocks along axis 1, but x's 6"),
    ([np.zeros((2, 6), np.int8), np.ones((3, 3), np.float32)], {"block_size": 2}, "must match x \\[2, 6\\] except"),
    ([np.zeros((2, 6), np.int8), np.ones(3, np.float32)], {"block_size": 2}, "must have x's rank 2"),
    ([np.zeros((2, 6), np.int8), np.ones((2, 3), np.float32)], {"block_size": -1}, "block_size must be >= 0"),
    ([np.zeros((2, 6), np.int8), np.ones((2, 3), np.float32), np.zeros((2, 2), np.int8)], {"block_size": 2},
     "x_zero_point has shape \\[2, 2\\]"),
    ([np.zeros(3, np.int8), np.ones((), np.float32)], {"output_dtype": TensorProto.INT8}, "output_dtype=3 is not one"),
    ([np.zeros(3, np.int8), np.ones((), np.float32)], {"output_dtype": TensorProto.FLOAT8E4M3FN}, "output_dtype=17"),
])
def test_inference_failures(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("DequantizeLinear", inputs, attrs, const_inputs=tuple(range(1, len(inputs))))


# --------------------------------------------------------------------------- QuantizeLinear


def onnx_quantize(x, scale, zero_point=None, opset=21, **attrs):
    return onnx_reference("QuantizeLinear", [x, scale, zero_point], attrs, opset=opset)


def test_quantize_linear_rounds_half_to_even_and_saturates():
    x = np.array([-300.0, -2.5, -0.5, 0.5, 1.5, 2.5, 300.0], np.float32)
    check_op("QuantizeLinear", [x, np.array(1.0, np.float32), np.array(0, np.int8)],
             np.array([-128, -2, 0, 0, 2, 2, 127], np.int8))
    check_op("QuantizeLinear", [x, np.array(2.0, np.float32), np.array(128, np.uint8)],
             np.array([0, 127, 128, 128, 129, 129, 255], np.uint8))
    per_axis = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    check_op("QuantizeLinear", [per_axis, np.array([1.0, 2.0], np.float32), np.array([0, 10], np.uint8)],
             np.array([[1, 2], [12, 12]], np.uint8), {"axis": 0})


@pytest.mark.parametrize("dtype", Q_TYPES)
def test_quantize_per_tensor_and_per_axis_match_onnx_reference(dtype):
    info = np.iinfo(dtype)
    x = (RNG.standard_normal((3, 4, 5)) * 4 * min(info.max, 2000)).astype(np.float32)  # some past the range
    zp = np.array(dtype(info.min // 3 + info.max // 3 + 1))
    for scale in (np.array(0.5, np.float32), np.array([3.0], np.float32)):
        check_op("QuantizeLinear", [x, scale, zp], onnx_quantize(x, scale, zp), const_inputs=(1, 2))
    for axis in (0, -1):
        n = x.shape[axis]
        scale, zps = scales(RNG, n) * 100, quantized(RNG, (n,), dtype)
        check_op("QuantizeLinear", [x, scale, zps], onnx_quantize(x, scale, zps, axis=axis), {"axis": axis},
                 const_inputs=(1, 2))


@pytest.mark.parametrize("shape,axis,block", [((3, 4), 1, 2), ((3, 5), 1, 2), ((7, 2), 0, 3), ((2, 3, 4), -1, 4)])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_quantize_blocked_matches_onnx_reference(shape, axis, block, dtype):
    x = (RNG.standard_normal(shape) * 50).astype(np.float32)
    s_shape = list(shape)
    s_shape[axis] = -(-shape[axis] // block)
    scale, zp = scales(RNG, s_shape) * 10, quantized(RNG, s_shape, dtype) // 4
    attrs = {"axis": axis, "block_size": block}
    check_op("QuantizeLinear", [x, scale, zp], onnx_quantize(x, scale, zp, **attrs), attrs, const_inputs=(1, 2))


@pytest.mark.parametrize("out", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16])
def test_output_dtype_without_zero_point(out):
    """QuantizeLinear-21's output_dtype gives the type when there is no zero point (uint8 without either)."""
    x = (RNG.standard_normal((2, 6)) * 300).astype(np.float32)
    scale = np.array(0.75, np.float32)
    [y] = check_op("QuantizeLinear", [x, scale], onnx_quantize(x, scale, output_dtype=out), {"output_dtype": out},
                   const_inputs=(1,))
    assert y.dtype == helper.tensor_dtype_to_np_dtype(out)
    check_op("QuantizeLinear", [x, scale], onnx_quantize(x, scale), const_inputs=(1,))  # uint8


@pytest.mark.parametrize("x_dtype,scale_dtype,precision", [
    (np.float16, np.float16, 0), (np.float32, np.float16, 0), (np.float16, np.float32, 0),
    (np.float16, np.float16, TensorProto.FLOAT), (np.float32, np.float32, TensorProto.FLOAT16),
    (np.int32, np.float32, 0), (np.int32, np.int32, 0), (np.float32, np.int32, 0),
    (np.int32, np.int32, TensorProto.FLOAT)])
def test_division_type_matches_onnx_reference(x_dtype, scale_dtype, precision):
    """The division runs in `precision`'s type (23), else numpy's (ONNX's reference): one float type as is, two the
    wider, an int32 operand float64. Values near the half-way points make the type show."""
    base = np.arange(-40, 40, dtype=np.float64) * 7.3 + 0.5
    x = (base * 3 if np.dtype(x_dtype).kind == "i" else base / 7).astype(x_dtype)
    scale = np.array(3 if np.dtype(scale_dtype).kind == "i" else 0.1428, scale_dtype)
    zp = np.array(-5, np.int16)
    attrs = {"precision": precision} if precision else {}
    check_op("QuantizeLinear", [x, scale, zp], onnx_quantize(x, scale, zp, opset=23, **attrs), attrs,
             const_inputs=(1, 2))


def test_quantize_int32_input_of_opset_10():
    """QuantizeLinear-10 takes int32 x with a float32 scale: divided in float64 (ONNX's reference), so a large
    value rounds as its exact quotient does."""
    x = np.array([2**30 + 1, -(2**31), 2**31 - 1, 5, -5, 7], np.int32)
    scale = np.array(2.0**23, np.float32)
    zp = np.array(3, np.int8)
    check_op("QuantizeLinear", [x, scale, zp], onnx_quantize(x, scale, zp, opset=13), const_inputs=(1, 2))


def test_quantize_inf_saturates_and_nan_gives_the_zero_point():
    x = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    check_op("QuantizeLinear", [x, np.array(1.0, np.float32), np.array(-7, np.int16)],
             np.array([32767, -32768, -7, -6], np.int16))


@pytest.mark.parametrize("inputs,attrs,match", [
    ([np.zeros(3, np.float32), np.ones((), np.float32), np.zeros((), np.int8)], {"output_dtype": TensorProto.UINT8},
     "output_dtype is uint8 but y_zero_point is int8"),
    ([np.zeros(3, np.float32), np.ones((), np.float32)], {"output_dtype": TensorProto.INT32}, "output_dtype=6 is not"),
    ([np.zeros(3, np.float32), np.ones((), np.float32)], {"output_dtype": TensorProto.FLOAT}, "output_dtype=1 is not"),
    ([np.zeros(3, np.float32), np.ones((), np.float32)], {"precision": TensorProto.INT32}, "precision=6 is not"),
    ([np.zeros((2, 4), np.float32), np.ones((2, 3), np.float32)], {"block_size": 2}, "has 3 blocks along axis 1"),
    ([np.zeros((2, 4), np.float32), np.ones((2, 2), np.float32)], {}, "scalar or 1-D .* without block_size"),
    ([np.zeros((2, 4), np.float32), np.ones(4, np.float32), np.zeros(2, np.uint8)], {}, "y_zero_point has shape"),
])
def test_quantize_inference_failures(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("QuantizeLinear", inputs, attrs, const_inputs=tuple(range(1, len(inputs))))


def test_dynamic_quantize_linear_matches_onnx_reference():
    ref = pytest.importorskip("onnx.reference.ops.op_dynamic_quantize_linear")
    for x in (np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32), np.array([-1.0, -2.1, -1.3], np.float32),
              np.array([1.0, 2.1, 1.3], np.float32), np.zeros(3, np.float32)):
        want = ref.DynamicQuantizeLinear._run(None, x)
        check_op("DynamicQuantizeLinear", [x], list(want), num_outputs=3)


# --------------------------------------------------------------------------- the storage types


ml_dtypes = pytest.importorskip("ml_dtypes")
FLOAT8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz]
SUB_BYTE = [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2]


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def sub_byte(rng, shape, dt):
    info = ml_dtypes.iinfo(dt)
    return rng.integers(int(info.min), int(info.max) + 1, shape).astype(np.int8).astype(dt)


@pytest.mark.parametrize("dt", FLOAT8 + [ml_dtypes.float4_e2m1fn], ids=lambda d: np.dtype(d).name)
def test_dequantize_floats_of_8_and_4_bits_match_onnx_reference(dt):
    x = (RNG.standard_normal((3, 4)) * 4).astype(np.float32).astype(dt)
    for scale in (np.array(0.5, np.float32), np.array(1.5, np.float16), scales(RNG, 3)):
        attrs = {"axis": 0}
        for zp in (None, np.zeros(scale.shape, dt)):
            inputs = [x, scale, zp]
            check_op("DequantizeLinear", inputs, onnx_dequantize(*inputs, opset=23, **attrs), attrs,
                     const_inputs=(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("dt", SUB_BYTE, ids=lambda d: np.dtype(d).name)
def test_dequantize_sub_byte_integers_match_onnx_reference(dt):
    x = sub_byte(RNG, (4, 6), dt)
    inputs = [x, scales(RNG, 4), sub_byte(RNG, (4,), dt)]
    check_op("DequantizeLinear", inputs, onnx_dequantize(*inputs, axis=0, opset=25), {"axis": 0},
             const_inputs=(1, 2), rtol=0, atol=0)
    attrs = {"axis": 1, "block_size": 4}
    inputs = [x, scales(RNG, (4, 2)), sub_byte(RNG, (4, 2), dt)]
    check_op("DequantizeLinear", inputs, onnx_dequantize(*inputs, opset=25, **attrs), attrs,
             const_inputs=(1, 2), rtol=0, atol=0)


def test_dequantize_with_a_float8e8m0_scale_needs_output_dtype():
    """DequantizeLinear-24: a power-of-two float8e8m0 scale (the MX formats'); the output type is output_dtype's,
    since float8e8m0 is not an output type."""
    x = sub_byte(RNG, (2, 8), ml_dtypes.int4)
    scale = np.array([[0.25, 4.0], [1.0, 2.0 ** -20]], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    for out in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        attrs = {"axis": 1, "block_size": 4, "output_dtype": out}
        check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale, opset=25, **attrs), attrs,
                 const_inputs=(1,), rtol=0, atol=0)
    with pytest.raises(ShapeInferenceError, match="x_scale is float8e8m0, so output_dtype must say"):
        build_single("DequantizeLinear", [x, scale], {"axis": 1, "block_size": 4}, const_inputs=(1,))


SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 0.3, 3.7, 7.0, 448.0, 460.0, 57344.0, 1e6, -1e6, np.inf, -np.inf, np.nan,
                    1e-7, 2.0 ** -9], np.float32)


@pytest.mark.parametrize("dt", FLOAT8 + [ml_dtypes.float4_e2m1fn], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("saturate", [1, 0])
def test_quantize_to_floats_of_8_and_4_bits_matches_onnx_reference(dt, saturate):
    """To float8 the quotient is cast (no rounding first), saturating to the largest finite value or not; float4
    has no inf or NaN, so its cast always saturates."""
    scale, zp = np.array(0.5, np.float32), np.zeros((), dt)
    for inputs in ([SPECIAL, scale, zp], [SPECIAL.reshape(-1, 1) * scales(RNG, 4), scales(RNG, 4), np.zeros(4, dt)]):
        attrs = {"saturate": saturate, "axis": 1}
        [y] = check_op("QuantizeLinear", inputs, None, attrs, const_inputs=(1, 2))
        same_bits(y, onnx_quantize(*inputs, opset=23, **attrs))


@pytest.mark.parametrize("dt", SUB_BYTE, ids=lambda d: np.dtype(d).name)
def test_quantize_to_sub_byte_integers_matches_onnx_reference(dt):
    x = (RNG.standard_normal((3, 8)) * 6).astype(np.float32)
    for inputs, attrs in (([x, scales(RNG, 3) * 10, sub_byte(RNG, (3,), dt)], {"axis": 0}),
                          ([x, scales(RNG, (3, 2)) * 10, sub_byte(RNG, (3, 2), dt)], {"axis": 1, "block_size": 4}),
                          ([x, np.array(0.7, np.float32)], {"output_dtype": helper.np_dtype_to_tensor_dtype(
                              np.dtype(dt))})):
        [y] = check_op("QuantizeLinear", inputs, None, attrs, const_inputs=(1, 2))
        same_bits(y, onnx_quantize(*inputs, opset=25, **attrs))


def test_quantize_with_a_float8e8m0_scale_matches_onnx_reference():
    x = (RNG.standard_normal((2, 8)) * 40).astype(np.float16)
    scale = np.array([[0.25, 4.0], [1.0, 0.5]], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    zp = np.zeros((2, 2), np.int8)
    attrs = {"axis": 1, "block_size": 4}
    check_op("QuantizeLinear", [x, scale, zp], onnx_quantize(x, scale, zp, opset=24, **attrs), attrs,
             const_inputs=(1, 2))


# --------------------------------------------------------------------------- import: every version as it is


def _model(op, inputs, attrs, opset, out_type=TensorProto.UNDEFINED):
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                                          a.shape) for n, a in zip(names, inputs)],
                              [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [10, 13, 18, 19, 21, 23, 24, 25, 28])
def test_every_version_imports_as_is(opset):
    x = (RNG.standard_normal((2, 3)) * 20).astype(np.float32)
    s, zp = np.array(0.25, np.float32), np.array(3, np.int8)
    q_model = _model("QuantizeLinear", [x, s, zp], {}, opset)
    q = onnx_quantize(x, s, zp, opset=max(opset, 19) if opset < 21 else opset)
    for model, feeds, want in ((q_model, [x, s, zp], q), (_model("DequantizeLinear", [q, s, zp], {}, opset),
                                                          [q, s, zp], onnx_dequantize(q, s, zp))):
        g = kiln.import_onnx(model)
        node = g.nodes[0]
        assert node.op == model.graph.node[0].op_type
        np.testing.assert_array_equal(evaluate(g, feeds)[0], want)
    if opset >= 13:  # per-axis from 13
        sa, zpa = scales(RNG, 3), np.array([1, -2, 3], np.int8)
        g = kiln.import_onnx(_model("QuantizeLinear", [x, sa, zpa], {}, opset))
        np.testing.assert_array_equal(evaluate(g, [x, sa, zpa])[0], onnx_quantize(x, sa, zpa))


def test_import_refuses_types_kiln_lacks_by_name():
    """float6 (QuantizeLinear-28) is not a kiln dtype: refused by name, not failed in inference."""
    x = np.zeros(4, np.float32)
    s = np.array(1.0, np.float32)
    with pytest.raises(UnsupportedOpError, match="output_dtype=FLOAT6E2M3 is an element type kiln does not support"):
        kiln.import_onnx(_model("QuantizeLinear", [x, s], {"output_dtype": TensorProto.FLOAT6E2M3}, 28))
    with pytest.raises(UnsupportedOpError, match="precision=COMPLEX64"):
        kiln.import_onnx(_model("QuantizeLinear", [x, s], {"precision": TensorProto.COMPLEX64}, 23))


# --------------------------------------------------------------------------- MatMulInteger


@pytest.mark.parametrize("a_dtype,b_dtype", [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.int8),
                                             (np.int8, np.uint8)])
def test_matmul_integer_matches_onnx_reference(a_dtype, b_dtype):
    a, b = quantized(RNG, (2, 3, 5), a_dtype), quantized(RNG, (5, 4), b_dtype)
    for zps in ([], [np.array(a_dtype(7)), np.array(b_dtype(100))], [None, np.array([b_dtype(3)])]):
        inputs = [a, b, *zps]
        check_op("MatMulInteger", inputs, onnx_reference("MatMulInteger", inputs, {}, opset=10), const_inputs=(1, 3))


def test_matmul_integer_per_row_and_per_column_zero_points():
    """A vector a_zero_point is per row of A, a vector b_zero_point per column of B; N-D ones broadcast."""
    a, b = quantized(RNG, (2, 3, 4), np.uint8), quantized(RNG, (4, 5), np.int8)
    za, zb = quantized(RNG, (3,), np.uint8), quantized(RNG, (5,), np.int8)
    exact = (a.astype(np.int64) - za[:, None]) @ (b.astype(np.int64) - zb)
    check_op("MatMulInteger", [a, b, za, zb], exact.astype(np.int32), const_inputs=(2, 3))
    za_nd = quantized(RNG, (2, 3, 1), np.uint8)
    zb_nd = quantized(RNG, (1, 5), np.int8)
    exact = (a.astype(np.int64) - za_nd) @ (b.astype(np.int64) - zb_nd)
    check_op("MatMulInteger", [a, b, za_nd, zb_nd], exact.astype(np.int32), const_inputs=(2, 3))


def test_matmul_integer_shapes_and_wrapping():
    """numpy.matmul's shapes (1-D operands, broadcast batches, K = 0); past int32 the sum wraps, as ONNX's int32
    accumulator (and its reference) does."""
    for sa, sb in (((5,), (5, 3)), ((2, 5), (5,)), ((5,), (5,)), ((3, 1, 2, 4), (2, 4, 6)), ((2, 0), (0, 3))):
        a, b = quantized(RNG, sa, np.uint8), quantized(RNG, sb, np.uint8)
        check_op("MatMulInteger", [a, b], onnx_reference("MatMulInteger", [a, b], {}, opset=10))
    a, b = np.full((1, 40000), 255, np.uint8), np.full((40000, 1), 255, np.uint8)
    [y] = check_op("MatMulInteger", [a, b], onnx_reference("MatMulInteger", [a, b], {}, opset=10))
    assert y[0, 0] == np.int64(40000 * 255 * 255).astype(np.int32) < 0


@pytest.mark.parametrize("inputs,match", [
    ([np.zeros((2, 3), np.uint8), np.zeros((4, 2), np.uint8)], "inner dims differ"),
    ([np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8), np.zeros((), np.int8)], "a_zero_point is int8"),
    ([np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8), np.zeros(3, np.uint8)], "has 3 elements but its operand"),
    ([np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8), None, np.zeros(3, np.uint8)], "has 2 columns"),
    ([np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8), np.zeros((2, 3), np.uint8)], "1 along the contracted"),
    ([np.zeros((), np.uint8), np.zeros((3, 2), np.uint8)], "rank >= 1"),
])
def test_matmul_integer_inference_failures(inputs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("MatMulInteger", inputs)


# --------------------------------------------------------------------------- ConvInteger


@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 1, 1, 1]}, {"strides": [2, 1], "dilations": [1, 2]},
                                   {"auto_pad": "SAME_UPPER"}, {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
                                   {"auto_pad": "VALID"}, {"group": 2}, {"kernel_shape": [2, 3], "pads": [0, 1, 2, 0]}])
@pytest.mark.parametrize("x_dtype,w_dtype", [(np.uint8, np.uint8), (np.int8, np.uint8), (np.uint8, np.int8)])
def test_conv_integer_matches_onnx_reference(attrs, x_dtype, w_dtype):
    x = quantized(RNG, (2, 4, 6, 5), x_dtype)
    w = quantized(RNG, (6, 4 // attrs.get("group", 1), 2, 3), w_dtype)
    for zps in ([], [np.array(x_dtype(9)), np.array(w_dtype(20))], [None, quantized(RNG, (6,), w_dtype)]):
        inputs = [x, w, *zps]
        check_op("ConvInteger", inputs, onnx_reference("ConvInteger", inputs, attrs, opset=10), attrs,
                 const_inputs=(1, 2, 3))


@pytest.mark.parametrize("spatial", [(7,), (4, 3, 5)])
def test_conv_integer_1d_and_3d(spatial):
    x = quantized(RNG, (1, 2, *spatial), np.uint8)
    w = quantized(RNG, (3, 2, *(2 for _ in spatial)), np.int8)
    zx, zw = np.array(np.uint8(128)), quantized(RNG, (3,), np.int8)
    xf = x.astype(np.int64) - 128
    wf = w.astype(np.int64) - zw.reshape((3,) + (1,) * (len(spatial) + 1))
    # The exact integer result, through float64 Conv of integers (exact) and the 2-D per-channel rule.
    from kiln.ir.ops.nn import conv
    want = conv(xf.astype(np.float64), wf.astype(np.float64), None, auto_pad="NOTSET", dilations=None, group=1,
                kernel_shape=None, pads=None, strides=None).astype(np.int32)
    check_op("ConvInteger", [x, w, zx, zw], want, const_inputs=(1, 2, 3))


def test_conv_integer_of_an_empty_batch():
    x, w = np.zeros((0, 1, 4, 4), np.uint8), quantized(RNG, (2, 1, 3, 3), np.uint8)
    check_op("ConvInteger", [x, w], np.zeros((0, 2, 2, 2), np.int32), const_inputs=(1,))


@pytest.mark.parametrize("inputs,attrs,match", [
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 2, 2, 2), np.uint8), np.zeros((), np.int8)], {},
     "x_zero_point is int8 but x is uint8"),
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 2, 2, 2), np.uint8), np.zeros(2, np.uint8)], {},
     "x_zero_point must be a scalar"),
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 2, 2, 2), np.uint8), None, np.zeros(2, np.uint8)], {},
     "one element per output channel \\(3\\)"),
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 1, 2, 2), np.uint8)], {}, "x has 2 channels but w"),
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 1, 2, 2), np.uint8)], {"group": 2}, "output channels M \\(3\\)"),
    ([np.zeros((1, 2, 4), np.uint8), np.zeros((3, 2, 2, 2), np.uint8)], {}, "same rank"),
    ([np.zeros((1, 2), np.uint8), np.zeros((3, 2), np.uint8)], {}, "rank >= 3"),
    ([np.zeros((1, 2, 4, 4), np.uint8), np.zeros((3, 2, 2, 2), np.uint8)], {"kernel_shape": [3, 3]},
     "kernel_shape \\[3, 3\\] does not match"),
])
def test_conv_integer_inference_failures(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("ConvInteger", inputs, attrs)


# --------------------------------------------------------------------------- QLinearMatMul, QLinearConv


def test_qlinear_matmul_is_the_requantized_integer_product():
    rng = np.random.default_rng(10)
    a = rng.integers(0, 255, (2, 4), dtype=np.uint8)
    b = rng.integers(0, 255, (4, 3), dtype=np.uint8)
    consts = [np.array(0.05, np.float32), np.array(113, np.uint8), b, np.array(0.02, np.float32),
              np.array(114, np.uint8), np.array(0.1, np.float32), np.array(118, np.uint8)]
    exact = (a.astype(np.int64) - 113) @ (b.astype(np.int64) - 114) * (0.05 * 0.02 / 0.1) + 118
    want = np.clip(np.rint(exact), 0, 255).astype(np.uint8)
    check_op("QLinearMatMul", [a, *consts], want)
    s8 = [np.array(0.05, np.float32), np.array(-3, np.int8), rng.integers(-128, 127, (4, 3), dtype=np.int8),
          np.array(0.02, np.float32), np.array(2, np.int8), np.array(0.01, np.float32), np.array(1, np.int8)]
    a8 = rng.integers(-128, 127, (3, 2, 4), dtype=np.int8)
    exact = (a8.astype(np.int64) + 3) @ (s8[2].astype(np.int64) - 2) * (0.05 * 0.02 / 0.01) + 1
    check_op("QLinearMatMul", [a8, *s8], np.clip(np.rint(exact), -128, 127).astype(np.int8))


def _qlinear_conv_inputs(x_dtype, w_dtype, y_dtype, m=4, c=2, per_channel=False, bias=False, group=1):
    x = quantized(RNG, (2, c, 5, 6), x_dtype)
    w = quantized(RNG, (m, c // group, 3, 2), w_dtype) // 8
    w_scale = scales(RNG, m) if per_channel else np.array(0.02, np.float32)
    w_zp = quantized(RNG, (m,), w_dtype) // 16 if per_channel else np.array(w_dtype(3))
    inputs = [x, np.array(0.05, np.float32), np.array(x_dtype(11)), w, w_scale, w_zp, np.array(0.3, np.float32),
              np.array(y_dtype(-4 if np.dtype(y_dtype).kind == "i" else 120))]
    if bias:
        inputs.append(RNG.integers(-2000, 2000, m).astype(np.int32))
    return inputs


@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 0, 1, 1], "strides": [2, 2]}, {"group": 2},
                                   {"auto_pad": "SAME_UPPER", "dilations": [2, 1]}])
@pytest.mark.parametrize("types", [(np.uint8, np.uint8, np.uint8), (np.int8, np.int8, np.int8),
                                   (np.uint8, np.int8, np.int8), (np.int8, np.uint8, np.uint8)])
@pytest.mark.parametrize("per_channel,bias", [(False, False), (True, True)])
def test_qlinear_conv_matches_onnx_reference(attrs, types, per_channel, bias):
    inputs = _qlinear_conv_inputs(*types, per_channel=per_channel, bias=bias, group=attrs.get("group", 1))
    want = onnx_reference("QLinearConv", inputs, attrs, opset=10)
    check_op("QLinearConv", inputs, want, attrs, const_inputs=(1, 2, 3, 4, 5, 6, 7, 8))


@pytest.mark.parametrize("inputs,match", [
    (_qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[:2] + [np.array(1, np.int8)]
     + _qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[3:], "x_zero_point is int8 but its tensor is uint8"),
    (_qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[:4] + [scales(RNG, 3)]
     + _qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[5:], "w_scale must be a scalar or have one element"),
    (_qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[:6] + [scales(RNG, 2)]
     + _qlinear_conv_inputs(np.uint8, np.uint8, np.uint8)[7:], "y_scale must be a scalar"),
    (_qlinear_conv_inputs(np.uint8, np.uint8, np.uint8) + [np.zeros(3, np.int32)], "bias B must have shape \\[4\\]"),
])
def test_qlinear_conv_inference_failures(inputs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("QLinearConv", inputs, const_inputs=tuple(range(1, len(inputs))))


# --------------------------------------------------------------------------- ONNX export of the newer forms


ort = pytest.importorskip("onnxruntime")


def _export_run(op, inputs, attrs, opset=None, const_inputs=()):
    from kiln.serializer import onnx as kx
    g, feeds = build_single(op, inputs, attrs, const_inputs=const_inputs)
    model = kx.to_onnx_model(g, opset=opset)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), feeds)})[0]
    want = evaluate(g, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    return model


def test_export_writes_16_bit_and_blocked_forms_at_opset_21():
    from kiln.serializer import onnx as kx
    x = quantized(RNG, (4, 6), np.int16)
    g, _ = build_single("DequantizeLinear", [x, np.array(0.1, np.float32)], const_inputs=(1,))
    assert kx.default_opset(g) == 21
    model = _export_run("DequantizeLinear", [x, np.array(0.1, np.float32)], {}, const_inputs=(1,))
    assert model.opset_import[0].version == 21
    with pytest.raises(KilnError, match="needs ai.onnx opset 21; this export writes opset 18"):
        kx.to_onnx_model(g, opset=18)
    xb = quantized(RNG, (4, 6), np.uint8)
    _export_run("DequantizeLinear", [xb, scales(RNG, (4, 3)), quantized(RNG, (4, 3), np.uint8)],
                {"axis": 1, "block_size": 2}, const_inputs=(1, 2))
    xf = (RNG.standard_normal((4, 6)) * 100).astype(np.float32)
    _export_run("QuantizeLinear", [xf, np.array(0.5, np.float32)], {"output_dtype": TensorProto.INT16},
                const_inputs=(1,))


def test_export_writes_output_dtype_as_a_float32_product_and_a_cast():
    """DequantizeLinear-23's output_dtype: the scale widened to float32, the float32 product, a Cast."""
    x = quantized(RNG, (3, 8), np.int8)
    model = _export_run("DequantizeLinear", [x, scales(RNG, 3)], {"axis": 0, "output_dtype": TensorProto.FLOAT16},
                        const_inputs=(1,))
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Cast"]
    model = _export_run("DequantizeLinear", [x, scales(RNG, 3).astype(np.float16)],
                        {"axis": 0, "output_dtype": TensorProto.FLOAT}, const_inputs=(1,))
    assert [n.op_type for n in model.graph.node] == ["Cast", "DequantizeLinear"]
    assert model.opset_import[0].version == 18


def test_export_casts_to_the_division_type_or_refuses_by_name():
    from kiln.serializer import onnx as kx
    x = (RNG.standard_normal(16) * 50).astype(np.float16)
    model = _export_run("QuantizeLinear", [x, np.array(0.37, np.float16), np.array(2, np.int8)],
                        {"precision": TensorProto.FLOAT}, const_inputs=(1, 2))
    assert [n.op_type for n in model.graph.node] == ["Cast", "Cast", "QuantizeLinear"]
    g, _ = build_single("QuantizeLinear", [x.astype(np.float32), np.array(3, np.int32)], const_inputs=(1,))
    with pytest.raises(KilnError, match="divides in a type ai.onnx QuantizeLinear takes from opset 23 on only"):
        kx.to_onnx_model(g)


# --------------------------------------------------------------------------- passes that read the new attributes


def _dq_graph(x_shape, scale, attrs, x_dtype="int8"):
    from kiln.ir import Graph
    from kiln.ir.passes import infer_shapes
    g = Graph("g")
    x = g.add_input("x", x_dtype, x_shape)
    g.outputs = [g.op("DequantizeLinear", x, g.add_initializer("s", scale), **attrs)]
    infer_shapes(g)
    return g


def test_batch_analysis_sees_a_blocked_scale_along_the_batch():
    """A blocked scale has x's shape, the batch dim included: rows of a stacked batch would meet the wrong scales."""
    from kiln.ir.batch_independence import analyze_batching
    assert analyze_batching(_dq_graph(["batch", 6], scales(RNG, 6), {"axis": 1})).batchable
    r = analyze_batching(_dq_graph(["batch", 6], scales(RNG, (2, 3)), {"axis": 1, "block_size": 2}))
    assert not r.batchable and "blocked scale" in r.reason, r.reason


def test_half_precision_conversion_moves_a_float32_output_dtype():
    """convert_precision turns float32 into half everywhere, Cast's `to` and DequantizeLinear's output_dtype too."""
    from kiln.ir import Graph
    from kiln.ir.passes import infer_shapes
    from kiln.ir.passes.precision import convert_precision
    g = Graph("g")
    x = g.add_input("x", "float32", ["batch", 4])
    w = g.op("DequantizeLinear", g.add_initializer("q", quantized(RNG, (4, 3), np.int8)),
             g.add_initializer("s", scales(RNG, 3).astype(np.float16)), axis=1, output_dtype=TensorProto.FLOAT)
    g.outputs = [g.op("MatMul", x, w)]
    infer_shapes(g)
    convert_precision(g, "fp16")
    dq = next(n for n in g.nodes if n.op == "DequantizeLinear")
    assert dq.attrs["output_dtype"] == TensorProto.FLOAT16 and str(dq.outputs[0].type.dtype) == "float16"


def test_export_keeps_saturate_for_a_float8_output():
    from onnx.reference import ReferenceEvaluator

    from kiln.serializer import onnx as kx
    zp = np.zeros((), ml_dtypes.float8_e4m3fn)
    g, feeds = build_single("QuantizeLinear", [SPECIAL, np.array(0.5, np.float32), zp], {"saturate": 0},
                            const_inputs=(1, 2))
    model = kx.to_onnx_model(g)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 19
    [node] = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["saturate"] == 0
    got = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: SPECIAL})[0]
    same_bits(got, evaluate(g, feeds)[0])
