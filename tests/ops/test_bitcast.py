"""BitCast (ai.onnx 26): every pair of kiln dtypes of one bit width against ONNX's reference evaluator (the same
bits), scalars, empty and non-contiguous tensors, bool's 0/1 rule, the sub-byte types' low bits, inference errors,
the import of a model that names a type kiln lacks, and the export: Identity/Cast where they mean the same, a
refusal by name otherwise."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from op_harness import build_single, check_op, onnx_reference

import kiln
from kiln.errors import KilnError, ShapeInferenceError, UnsupportedOpError
from kiln.ir.dtypes import DType

onnx = pytest.importorskip("onnx")
ml_dtypes = pytest.importorskip("ml_dtypes")
from onnx import TensorProto, helper  # noqa: E402

RNG = np.random.default_rng(26)
BY_WIDTH: dict = {}
for _d in DType:
    BY_WIDTH.setdefault(_d.bits, []).append(_d)
PAIRS = [(a, b) for group in BY_WIDTH.values() for a, b in itertools.product(group, group)]


def values(dt: DType, shape, bits01: bool = False) -> np.ndarray:
    """Random bit patterns of ``dt``: canonical ones (bool 0/1, sub-byte types in their low bits); with
    ``bits01`` each byte 0 or 1 (what a bool reads, which ONNX defines only for those)."""
    if dt is DType.BOOL:
        return RNG.integers(0, 2, shape).astype(bool)
    if bits01:
        return RNG.integers(0, 2, shape).astype(np.uint8).view(dt.numpy)
    width = dt.bits
    raw = RNG.integers(0, 1 << min(width, 16), shape, dtype=np.uint64)
    if width >= 32:
        raw = raw | (RNG.integers(0, 1 << 16, shape, dtype=np.uint64) << np.uint64(width - 16))
    holder = {2: np.uint8, 4: np.uint8, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
    return raw.astype(holder).view(dt.numpy)


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bits are NaN here and there
def test_matches_onnx_reference(src, dst):
    x = values(src, (2, 3), bits01=dst is DType.BOOL)
    [y] = check_op("BitCast", [x], None, {"to": dst.value})
    same_bits(y, onnx_reference("BitCast", [x], {"to": dst.value}, opset=26))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)])
def test_scalar_and_empty(shape):
    x = values(DType.FLOAT32, shape)
    [y] = check_op("BitCast", [x], x.view(np.int32), {"to": TensorProto.INT32})
    assert y.shape == shape


def test_known_bit_patterns_and_a_strided_input():
    x = np.array([1.0, -2.0, 0.0, np.inf], np.float32)
    check_op("BitCast", [x], np.array([0x3F800000, -0x40000000, 0, 0x7F800000], np.int32), {"to": TensorProto.INT32})
    check_op("BitCast", [np.array([-1, 127, -128], np.int8)], np.array([255, 127, 128], np.uint8),
             {"to": TensorProto.UINT8})
    check_op("BitCast", [np.array([1.0, -0.0], np.float16)], np.array([0x3C00, 0x8000], np.uint16),
             {"to": TensorProto.UINT16})
    m = np.arange(12, dtype=np.int64).reshape(3, 4)
    from kiln.ir.ops.bitcast import bitcast
    np.testing.assert_array_equal(bitcast(m[:, ::2], TensorProto.DOUBLE).view(np.int64), m[:, ::2])


def test_any_nonzero_byte_is_true():
    """ONNX leaves a byte other than 0/1 read as bool undefined: kiln reads it as True, so bools stay 0/1."""
    [y] = check_op("BitCast", [np.array([0, 1, 2, 255], np.uint8)], np.array([False, True, True, True]),
                   {"to": TensorProto.BOOL})
    assert y.view(np.uint8).tolist() == [0, 1, 1, 1]


def test_sub_byte_types_read_their_low_bits():
    x = np.array([-1, 7, -8, 0], np.int8).astype(ml_dtypes.int4)
    [u] = check_op("BitCast", [x], np.array([15, 7, 8, 0], np.uint8).astype(ml_dtypes.uint4), {"to": TensorProto.UINT4})
    [f] = check_op("BitCast", [x], None, {"to": TensorProto.FLOAT4E2M1})
    np.testing.assert_array_equal(f.astype(np.float32), [-6.0, 6.0, -0.0, 0.0])
    check_op("BitCast", [np.array([-2, 1], np.int8).astype(ml_dtypes.int2)],
             np.array([2, 1], np.uint8).astype(ml_dtypes.uint2), {"to": TensorProto.UINT2})


def test_symbolic_shape_is_kept():
    g, _ = build_single("BitCast", [np.zeros((2, 5), np.float64)], {"to": TensorProto.UINT64}, symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 5)
    assert g.outputs[0].type.dtype is DType.UINT64


@pytest.mark.parametrize("x,to,match", [
    (np.zeros(3, np.float32), TensorProto.INT64, "float32 is 32 bits, int64 is 64"),
    (np.zeros(3, np.int8), TensorProto.FLOAT16, "int8 is 8 bits, float16 is 16"),
    (np.zeros(3, np.uint8), TensorProto.INT4, "uint8 is 8 bits, int4 is 4"),
    (np.zeros(3, np.float64), TensorProto.COMPLEX64, "to=14 is not a dtype kiln supports"),
])
def test_inference_failures(x, to, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("BitCast", [x], {"to": to})


def _model(x_type, to, opset=26):
    node = helper.make_node("BitCast", ["x"], ["y"], to=to)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_import():
    g = kiln.import_onnx(_model(TensorProto.FLOAT, TensorProto.UINT32))
    x = np.array([1.5, -3.0, 0.0], np.float32)
    np.testing.assert_array_equal(kiln.load(g).run([x], as_list=True)[0], x.view(np.uint32))
    with pytest.raises(UnsupportedOpError, match="to=COMPLEX128 is an element type kiln does not support"):
        kiln.import_onnx(_model(TensorProto.DOUBLE, TensorProto.COMPLEX128))


# --------------------------------------------------------------------------- export


ort = pytest.importorskip("onnxruntime")


def _graph(x_dtype, to):
    g, feeds = build_single("BitCast", [values(x_dtype, (4,))], {"to": to.value})
    return g, feeds


@pytest.mark.parametrize("src,dst,ops", [(DType.BOOL, DType.UINT8, ["Cast"]), (DType.INT8, DType.BOOL, ["Cast"]),
                                         (DType.FLOAT32, DType.FLOAT32, ["Identity"])])
def test_export_writes_what_an_older_op_means_exactly(src, dst, ops):
    from kiln.ir import evaluate
    from kiln.serializer import onnx as kx
    g, feeds = _graph(src, dst)
    for opset in (18, 22):
        model = kx.to_onnx_model(g, opset=opset)
        onnx.checker.check_model(model, full_check=True)
        assert [n.op_type for n in model.graph.node] == ops
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, {sess.get_inputs()[0].name: feeds[0]})[0]
        np.testing.assert_array_equal(got, evaluate(g, feeds)[0])


def test_export_refuses_a_reinterpretation_by_name(tmp_path):
    g, _ = _graph(DType.FLOAT32, DType.INT32)
    with pytest.raises(KilnError, match="BitCast exists from opset 26 on, .* no op reads float32 bits as int32"):
        kiln.export_onnx(g, tmp_path / "b.onnx")
