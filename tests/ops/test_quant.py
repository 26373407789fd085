"""DequantizeLinear: the reference against ONNX's own reference evaluator (opset 18), inference of
per-tensor and per-axis scales, and the inference failures."""
import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError
from kiln.ir import evaluate
from kiln.ir.passes import fold_constants

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

ONNX_TYPE = {np.int8: onnx.TensorProto.INT8, np.uint8: onnx.TensorProto.UINT8, np.int32: onnx.TensorProto.INT32}


def onnx_dequantize(x, scale, zero_point=None, axis=None):
    """DequantizeLinear as ONNX's reference evaluator computes it. Its oldest implementation is
    opset 19's, which for int8/uint8/int32 inputs and a float32 scale is opset 18's meaning
    (19 only added float8 inputs and float16 scales)."""
    names = ["x", "s"] + (["z"] if zero_point is not None else [])
    attrs = {} if axis is None else {"axis": axis}
    node = helper.make_node("DequantizeLinear", names, ["y"], **attrs)
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in zip(names, (x, scale, zero_point))]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    feeds = dict(zip(names, (x, scale, zero_point)))
    return ReferenceEvaluator(model).run(None, feeds)[0]


def quantized(rng, shape, dtype):
    info = np.iinfo(dtype)
    lo, hi = (max(info.min, -1000), min(info.max, 1000))
    return rng.integers(lo, hi + 1, shape).astype(dtype)


def scales(rng, n):
    return (rng.random(n) * 0.1 + 1e-3).astype(np.float32)


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


def test_default_axis_is_one_and_one_element_scale_is_per_tensor(rng):
    x = quantized(rng, (2, 3, 4), np.int8)
    scale = scales(rng, 3)
    check_op("DequantizeLinear", [x, scale], onnx_dequantize(x, scale), const_inputs=(1,), rtol=0, atol=0)
    one = scales(rng, 1)
    # A [1] scale on an axis of 4 elements: per-tensor, not an error.
    check_op("DequantizeLinear", [x, one], onnx_dequantize(x, one, axis=2), {"axis": 2}, const_inputs=(1,),
             rtol=0, atol=0)


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
])
def test_inference_failures(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("DequantizeLinear", inputs, attrs, const_inputs=tuple(range(1, len(inputs))))


# --------------------------------------------------------------------------- QuantizeLinear, DynamicQuantizeLinear, QLinearMatMul

def test_quantize_linear_rounds_half_to_even_and_saturates():
    x = np.array([-300.0, -2.5, -0.5, 0.5, 1.5, 2.5, 300.0], np.float32)
    check_op("QuantizeLinear", [x, np.array(1.0, np.float32), np.array(0, np.int8)],
             np.array([-128, -2, 0, 0, 2, 2, 127], np.int8))
    check_op("QuantizeLinear", [x, np.array(2.0, np.float32), np.array(128, np.uint8)],
             np.array([0, 127, 128, 128, 129, 129, 255], np.uint8))
    per_axis = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    check_op("QuantizeLinear", [per_axis, np.array([1.0, 2.0], np.float32), np.array([0, 10], np.uint8)],
             np.array([[1, 2], [12, 12]], np.uint8), {"axis": 0})


def test_dynamic_quantize_linear_matches_onnx_reference():
    ref = pytest.importorskip("onnx.reference.ops.op_dynamic_quantize_linear")
    for x in (np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32), np.array([-1.0, -2.1, -1.3], np.float32),
              np.array([1.0, 2.1, 1.3], np.float32), np.zeros(3, np.float32)):
        want = ref.DynamicQuantizeLinear._run(None, x)
        check_op("DynamicQuantizeLinear", [x], list(want), num_outputs=3)


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
