"""uint16, uint32 and uint64 (issue 22): the ops ONNX defines on them answer as ONNX's reference does, on values
where a detour through a signed or float type would go wrong (above 2^31, 2^53 and 2^63); the types survive a
.kiln file, the mobile stub, ONNX export and import; and ops ONNX defines only on signed types refuse them."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.dtypes import DType, dtype
from op_harness import check_op, onnx_reference

UINTS = [np.uint16, np.uint32, np.uint64]
RNG = np.random.default_rng(22)


def _big(dt, shape, *, lo=0):
    """Values over the whole range of ``dt`` (so uint64 has values above 2^63 and 2^53)."""
    hi = np.iinfo(dt).max
    a = RNG.integers(lo, hi, size=shape, dtype=dt, endpoint=True)
    a.flat[0] = hi
    return a


@pytest.mark.parametrize("dt", UINTS)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Mod", "Max", "Min", "BitwiseAnd", "BitwiseOr",
                                "BitwiseXor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_binary_ops_match_onnx(op, dt):
    a, b = _big(dt, (3, 4)), _big(dt, (4,), lo=1)
    b[1] = a[0, 1]  # an equal pair for the comparisons
    check_op(op, [a, b], onnx_reference(op, [a, b], {}))


@pytest.mark.parametrize("dt", UINTS)
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift(dt, direction):
    a = _big(dt, (5,))
    s = np.array([0, 1, 3, np.iinfo(dt).bits - 1, 2], dt)
    attrs = {"direction": direction}
    check_op("BitShift", [a, s], onnx_reference("BitShift", [a, s], attrs), attrs)


@pytest.mark.parametrize("dt", UINTS)
@pytest.mark.parametrize("op", ["Abs", "Sign", "BitwiseNot", "Identity"])
def test_unary_ops_match_onnx(op, dt):
    a = _big(dt, (2, 3))
    a[0, 1] = 0
    check_op(op, [a], onnx_reference(op, [a], {}))


@pytest.mark.parametrize("dt", [np.uint32, np.uint64])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"])
def test_reductions_match_onnx(op, dt):
    a = _big(dt, (3, 4))
    axes = np.array([1], np.int64)
    check_op(op, [a, axes], onnx_reference(op, [a, axes], {"keepdims": 0}), {"keepdims": 0}, const_inputs=(1,))


@pytest.mark.parametrize("dt", UINTS)
def test_argmax_topk_and_clip_order_unsigned_values(dt):
    a = _big(dt, (2, 5))  # values above the signed maximum must sort as large, not negative
    check_op("ArgMax", [a], onnx_reference("ArgMax", [a], {"axis": 1}), {"axis": 1})
    k = np.array([2], np.int64)
    values, _ = check_op("TopK", [a, k], None, {"axis": -1}, const_inputs=(1,), num_outputs=2)
    np.testing.assert_array_equal(values, onnx_reference("TopK", [a, k], {"axis": -1}))
    lo, hi = np.array(7, dt), np.array(np.iinfo(dt).max - 5, dt)
    check_op("Clip", [a, lo, hi], onnx_reference("Clip", [a, lo, hi], {}))


@pytest.mark.parametrize("dt", [np.uint32, np.uint64])
def test_matmul_and_cumsum_wrap_as_onnx(dt):
    a, b = _big(dt, (2, 3)), _big(dt, (3, 2))
    check_op("MatMul", [a, b], onnx_reference("MatMul", [a, b], {}))
    axis = np.array(1, np.int64)
    check_op("CumSum", [a, axis], onnx_reference("CumSum", [a, axis], {}), const_inputs=(1,))


@pytest.mark.parametrize("dt", UINTS)
@pytest.mark.parametrize("to", [np.float32, np.float64, np.int64, np.uint8, np.uint64])
def test_cast_from_and_to_unsigned(dt, to):
    a = _big(dt, (6,))
    attrs = {"to": int(dtype(to).value)}
    check_op("Cast", [a], onnx_reference("Cast", [a], attrs), attrs)
    back = {"to": int(dtype(dt).value)}
    top = min(np.iinfo(dt).max, np.iinfo(to).max if np.dtype(to).kind in "iu" else 65535)
    b = np.array([0, 1, top // 3, top], to)
    check_op("Cast", [b], onnx_reference("Cast", [b], back), back)


@pytest.mark.parametrize("op", ["Neg"])
def test_signed_only_ops_refuse_unsigned_types(op):
    g = Graph("neg")
    x = g.add_input("x", "uint32", [3])
    g.outputs = [g.op(op, x)]
    with pytest.raises(KilnError, match="uint32"):
        kiln.load(g)


def _uint_graph() -> Graph:
    g = Graph("u")
    x = g.add_input("x", "uint64", ["n", 3])
    c = g.add_constant(np.array([1, 2 ** 63 + 5, 2 ** 64 - 1], np.uint64), "c")
    s = g.op("Add", x, c)
    h = g.op("Cast", g.op("BitShift", s, g.add_constant(np.array([1, 1, 60], np.uint64), "k"), direction="RIGHT"),
             to=DType.UINT16.value)
    g.outputs = [s, h, g.op("Cast", h, to=DType.UINT32.value)]
    return g


def _want(x):
    c = np.array([1, 2 ** 63 + 5, 2 ** 64 - 1], np.uint64)
    s = x + c
    h = (s >> np.array([1, 1, 60], np.uint64)).astype(np.uint16)
    return [s, h, h.astype(np.uint32)]


def test_kiln_file_round_trip_keeps_unsigned_types(tmp_path):
    g = _uint_graph()
    kiln.save(g, tmp_path / "u.kiln")
    loaded = kiln.load_graph(tmp_path / "u.kiln")
    assert [v.type.dtype for v in loaded.outputs] == [DType.UINT64, DType.UINT16, DType.UINT32]
    assert sorted(str(v.const.dtype) for v in loaded.initializers.values()) == ["uint64", "uint64"]
    x = np.array([[3, 2 ** 62, 0], [0, 0, 1]], np.uint64)
    for got, want in zip(kiln.load(tmp_path / "u.kiln").run({"x": x}, as_list=True), _want(x)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_mobile_stub_reads_unsigned_types_and_refuses_their_ops_by_name(tmp_path):
    """The trimmed runtime knows the types (it reads the file) but ships no unsigned kernels: a clear refusal."""
    from kiln.mobile_stub import runtime as mobile
    from kiln.mobile_stub.pack import pack_file
    kiln.save(_uint_graph(), tmp_path / "full.kiln")
    pack_file(tmp_path / "full.kiln", tmp_path / "u.kiln")
    with pytest.raises(KilnError, match="Add:uint64"):
        mobile.load(str(tmp_path / "u.kiln"))


def test_onnx_export_and_import_round_trip(tmp_path):
    pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx_import import import_onnx
    g = _uint_graph()
    kiln.export_onnx(g, tmp_path / "u.onnx")
    back = import_onnx(str(tmp_path / "u.onnx"))
    assert [v.type.dtype for v in back.outputs] == [DType.UINT64, DType.UINT16, DType.UINT32]
    import onnxruntime as ort
    x = np.array([[9, 2 ** 63 + 1, 2]], np.uint64)
    sess = ort.InferenceSession(str(tmp_path / "u.onnx"), providers=["CPUExecutionProvider"])
    for a, w in zip(sess.run(None, {"x": x}), _want(x)):
        np.testing.assert_array_equal(a, w)
    for a, w in zip(kiln.load(back).run({"x": x}, as_list=True), _want(x)):
        np.testing.assert_array_equal(a, w)
