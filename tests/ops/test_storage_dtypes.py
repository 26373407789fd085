"""Storage types (issue 22): float8 (4 formats), float4e2m1, float8e8m0 and the 4- and 2-bit integers. Cast and
CastLike convert to and from them bit for bit as ONNX's reference does (saturate, round_mode); the importer
unpacks ONNX's packed sub-byte tensors (raw, typed and external data); a .kiln file keeps them; export writes
them at the opset that has them and refuses, by name, those newer than the opsets kiln writes; ops that compute
refuse them."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.dtypes import FLOAT8_TYPES, STORAGE_TYPES, DType
from op_harness import check_op, onnx_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 0.3, 3.7, 448.0, 460.0, 57344.0, 1e6, -1e6, np.inf, -np.inf, np.nan,
                    1e-7, 2.0 ** -9, 2.0 ** -17], np.float32)


def onnx_cast(x: np.ndarray, to: int, **attrs) -> np.ndarray:
    """ONNX's reference evaluator running one Cast-25."""
    return onnx_reference("Cast", [x], {"to": to, **attrs}, opset=25)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("src", [np.float32, np.float16])
@pytest.mark.parametrize("dt", sorted(FLOAT8_TYPES, key=lambda d: d.value), ids=str)
@pytest.mark.parametrize("saturate", [1, 0])
def test_cast_to_float8_matches_onnx_bit_for_bit(dt, src, saturate):
    with np.errstate(over="ignore"):
        x = SPECIAL.astype(src)  # 1e6 is inf in float16
    (got,) = check_op("Cast", [x], None, {"to": dt.value, "saturate": saturate})
    same_bits(got, onnx_cast(x, dt.value, saturate=saturate))


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
def test_cast_to_float8e8m0_matches_onnx(round_mode, saturate):
    x = np.array([1.0, 1.5, 2.0, 3.0, 0.75, 2.0 ** 127 * 1.9, 2.0 ** -126, 0.0, np.inf, np.nan, 5e-39, 1234.5],
                 np.float32)
    attrs = {"to": DType.FLOAT8E8M0.value, "saturate": saturate, "round_mode": round_mode}
    (got,) = check_op("Cast", [x], None, attrs)
    same_bits(got, onnx_cast(x, DType.FLOAT8E8M0.value, saturate=saturate, round_mode=round_mode))


@pytest.mark.parametrize("dt", [DType.INT4, DType.UINT4, DType.INT2, DType.UINT2, DType.FLOAT4E2M1], ids=str)
def test_cast_to_and_from_the_sub_byte_types(dt):
    lo, hi = (-6, 6) if dt is DType.FLOAT4E2M1 else (int(ml_dtypes.iinfo(dt.numpy).min),
                                                      int(ml_dtypes.iinfo(dt.numpy).max))
    x = np.linspace(lo, hi, 9).astype(np.float32)  # in range: out of range is undefined in ONNX
    (got,) = check_op("Cast", [x], None, {"to": dt.value})
    same_bits(got, onnx_cast(x, dt.value))
    (back,) = check_op("Cast", [got], None, {"to": TensorProto.FLOAT})
    np.testing.assert_array_equal(back, got.astype(np.float32))


def test_cast_like_takes_the_storage_type_of_its_second_input():
    like = np.zeros(1, ml_dtypes.float8_e5m2)
    (got,) = check_op("CastLike", [SPECIAL, like], None, {"saturate": 0})
    same_bits(got, onnx_cast(SPECIAL, DType.FLOAT8E5M2.value, saturate=0))


def test_shape_ops_move_storage_values_and_arithmetic_refuses_them():
    w = np.arange(-8, 8).astype(ml_dtypes.int4).reshape(4, 4)
    (t,) = check_op("Transpose", [w], None, {"perm": [1, 0]})
    same_bits(t, w.T.copy())
    (r,) = check_op("Reshape", [w, np.array([2, 8], np.int64)], None, const_inputs=(1,))
    same_bits(r, w.reshape(2, 8))
    g = Graph("add")
    x = g.add_input("x", "float8e4m3fn", [3])
    g.outputs = [g.op("Add", x, x)]
    with pytest.raises(KilnError, match="float8e4m3fn"):
        kiln.load(g)


def test_a_quantized_weight_chain_runs_on_the_cpu_and_survives_a_kiln_file(tmp_path):
    g = Graph("w4")
    x = g.add_input("x", "float32", ["n", 4])
    w4v = np.array([[-8, 7, 1, 0], [3, -2, 5, -1], [0, 0, 1, 1], [2, 2, -3, 4]], ml_dtypes.int4)
    w4 = g.add_constant(w4v, "w4")
    w = g.op("Cast", w4, to=TensorProto.FLOAT)
    y = g.op("MatMul", x, w)
    q = g.op("Cast", y, to=DType.FLOAT8E4M3FN.value)  # an activation stored as float8, then read back
    g.outputs = [g.op("Cast", q, to=TensorProto.FLOAT)]
    xv = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    want = (xv @ w4v.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(kiln.load(g).run({"x": xv}, as_list=True)[0], want)
    kiln.save(g, tmp_path / "w4.kiln")
    loaded = kiln.load_graph(tmp_path / "w4.kiln")
    assert {str(v.const.dtype) for v in loaded.initializers.values()} == {"int4"}
    np.testing.assert_array_equal(kiln.load(tmp_path / "w4.kiln").run({"x": xv}, as_list=True)[0], want)


def _cast_model(init: "onnx.TensorProto") -> "onnx.ModelProto":
    node = helper.make_node("Cast", [init.name], ["y"], to=TensorProto.FLOAT)
    g = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[init])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])


@pytest.mark.parametrize("dt", [DType.INT4, DType.UINT4, DType.INT2, DType.UINT2, DType.FLOAT4E2M1], ids=str)
@pytest.mark.parametrize("how", ["raw", "typed", "external"])
def test_import_unpacks_sub_byte_initializers(tmp_path, dt, how):
    from kiln.serializer.onnx_import import import_onnx
    vals = np.array([[1, -2, 0], [1, 0, -1], [0, 1, 1]], np.float32) if dt.is_signed or dt is DType.FLOAT4E2M1 \
        else np.array([[1, 3, 0], [2, 0, 1], [3, 1, 1]], np.float32)
    w = vals.astype(dt.numpy)  # 9 values: an odd count leaves half a byte of padding
    init = numpy_helper.from_array(w, "w")
    if how == "typed":
        init = helper.make_tensor("w", dt.value, w.shape, vals.reshape(-1).tolist())  # packed into int32_data
    model = _cast_model(init)
    if how == "external":
        onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                        location="m.data", size_threshold=0)
        g = import_onnx(str(tmp_path / "m.onnx"))
    else:
        g = import_onnx(model)
    np.testing.assert_array_equal(kiln.load(g).run({}, as_list=True)[0], vals)


def test_import_refuses_a_packed_tensor_of_the_wrong_size():
    from kiln.errors import FormatError
    from kiln.serializer.onnx_import import import_onnx
    init = TensorProto(name="w", data_type=TensorProto.INT4, dims=[5], raw_data=b"\x11\x22")  # 5 need 3 bytes
    with pytest.raises(FormatError, match="raw_data holds 2 bytes, a int4 tensor of dims \\[5\\] needs 3"):
        import_onnx(_cast_model(init))


@pytest.mark.parametrize("dt,opset", [(DType.FLOAT8E4M3FN, 19), (DType.FLOAT8E5M2FNUZ, 19), (DType.INT4, 21),
                                      (DType.UINT4, 21)], ids=str)
@pytest.mark.parametrize("external", [False, True])
def test_export_writes_storage_types_at_their_opset(tmp_path, dt, opset, external):
    ort = pytest.importorskip("onnxruntime")
    g = Graph("e")
    x = g.add_input("x", "float32", [5])
    w = g.add_constant(np.array([1, 2, -3, 0.5, 4], np.float32).astype(dt.numpy), "w")
    g.outputs = [g.op("Cast", g.op("Cast", x, to=dt.value), to=1), g.op("Cast", w, to=1)]
    path = tmp_path / "e.onnx"
    kiln.export_onnx(g, path, size_threshold=0 if external else 1 << 30)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == opset
    # Whole numbers in range of every type here: float -> int4 of a fraction differs between ONNX's reference
    # (truncation, as for every integer type, which kiln follows) and onnxruntime (-0.5 -> -1).
    xv = np.array([1, 3, 0, 2, 4], np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xv})
    for a, b in zip(got, kiln.load(g).run({"x": xv}, as_list=True)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KilnError, match=f"from opset {opset} on; export at opset {opset} or later, not 18"):
        kiln.export_onnx(g, path, opset=18)


@pytest.mark.parametrize("dt,opset", [(DType.FLOAT4E2M1, 23), (DType.FLOAT8E8M0, 24), (DType.INT2, 25)], ids=str)
def test_export_refuses_types_newer_than_the_opsets_kiln_writes(tmp_path, dt, opset):
    g = Graph("e")
    x = g.add_input("x", "float32", [3])
    g.outputs = [g.op("Cast", g.op("Cast", x, to=dt.value), to=1)]
    with pytest.raises(KilnError, match=f"is {dt}, which ai.onnx has from opset {opset} on; .* save the model "
                                        "as .kiln"):
        kiln.export_onnx(g, tmp_path / "e.onnx")


def test_every_storage_type_round_trips_through_a_kiln_file(tmp_path):
    g = Graph("all")
    outs, want = [], []
    for dt in sorted(STORAGE_TYPES, key=lambda d: d.value):
        vals = [1.0, 2.0, 4.0] if dt is DType.FLOAT8E8M0 else [0.0, 1.0, -1.0 if dt.is_signed else 1.0]
        c = g.add_constant(np.array(vals, np.float32).astype(dt.numpy), dt.short)
        outs.append(g.op("Cast", c, to=1))
        want.append(vals)
    g.outputs = outs
    kiln.save(g, tmp_path / "all.kiln")
    back = kiln.load_graph(tmp_path / "all.kiln")
    assert sorted(str(v.const.dtype) for v in back.initializers.values()) == \
        sorted(str(d.numpy) for d in STORAGE_TYPES)
    for got, w in zip(kiln.load(tmp_path / "all.kiln", optimize=False).run({}, as_list=True), want):
        np.testing.assert_array_equal(got, w)


def test_the_server_refuses_a_model_with_float8_io_at_load():
    from kiln.server.repository import ModelConfig
    from kiln.server.workers import ThreadExecutor
    g = Graph("f8io")
    x = g.add_input("x", "float32", [3])
    g.outputs = [g.op("Cast", x, to=DType.FLOAT8E4M3FN.value)]
    with pytest.raises(KilnError, match="is float8e4m3fn, which the V2 inference protocol has no datatype for"):
        ThreadExecutor(g, ModelConfig()).start()
