"""Half precision conversion (ir/passes/precision.py, issue 18): the graph it makes, the op policy, the
interface, weights in the file, and answers on the CPU runtime (which computes a half model in float32)
against the float32 model and torch."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph, verify
from kiln.ir.dtypes import DType
from kiln.ir.passes.precision import FP32_OPS, convert_precision, parse_policy, upcast_to_float32
from kiln.serializer.reader import load_graph

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def mlp_graph() -> Graph:
    return load_graph(MLP)


def floats(g: Graph) -> set:
    return {v.dtype for gg in g.all_graphs() for v in gg.values() if v.dtype is not None and v.dtype.is_float}


@pytest.mark.parametrize("precision, half", [("fp16", DType.FLOAT16), ("bf16", DType.BFLOAT16)])
def test_weights_and_activations_go_half_the_interface_stays_float32(precision, half, tmp_path):
    g = mlp_graph()
    before = sum(v.const.nbytes for v in g.initializers.values())
    report = convert_precision(g, precision)
    assert report.weights == 6 and report.weight_bytes_after * 2 == report.weight_bytes_before == before
    assert all(v.dtype is half for v in g.initializers.values())
    assert [x.dtype for x in g.inputs] == [DType.FLOAT32]
    assert [y.name for y in g.outputs] == ["logits", "probs"] and all(y.dtype is DType.FLOAT32 for y in g.outputs)
    inner = [n for n in g.nodes if n.op != "Cast"]
    assert inner and all(o.dtype is half for n in inner for o in n.outputs)  # Softmax too: no float32 island
    assert report.casts == 3 and report.float32_nodes == []
    # The file halves (weights are most of it), and loads back as it was written.
    full, small = tmp_path / "f32.kiln", tmp_path / "f16.kiln"
    kiln.save(mlp_graph(), full)
    kiln.save(g, small)
    assert small.stat().st_size < 0.75 * full.stat().st_size
    assert {v.dtype for v in load_graph(small).initializers.values()} == {half}


@pytest.mark.parametrize("precision, tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_cpu_runs_a_half_file_in_float32_close_to_float32(precision, tol, tmp_path):
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    want = kiln.load(MLP).run({"x": x})
    g = mlp_graph()
    convert_precision(g, precision)
    kiln.save(g, tmp_path / "h.kiln")
    prog = kiln.load(tmp_path / "h.kiln")
    got = prog.run({"x": x})
    for name in want:
        assert got[name].dtype == np.float32
        scale = np.abs(want[name]).max()
        assert np.abs(got[name] - want[name]).max() <= tol * scale, name
    # The same through load(precision=) from the float32 file.
    again = kiln.load(MLP, precision=precision).run({"x": x})
    for name in want:
        np.testing.assert_array_equal(again[name], got[name])


def test_io_half_makes_inputs_and_outputs_half():
    g = mlp_graph()
    convert_precision(g, "fp16", io="half")
    assert g.inputs[0].dtype is DType.FLOAT16 and all(y.dtype is DType.FLOAT16 for y in g.outputs)
    assert [y.name for y in g.outputs] == ["logits", "probs"]
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float16)
    out = kiln.load(g).run({"x": x})
    assert out["probs"].dtype == np.float16
    np.testing.assert_allclose(out["probs"].astype(np.float32).sum(-1), 1.0, atol=2e-3)


def _exp_graph() -> Graph:
    g = Graph("e")
    x = g.add_input("x", "float32", ("n", 4))
    e = g.op("Exp", x)
    y = g.op("Mul", e, g.add_initializer("k", np.full(4, 0.5, np.float32)))
    g.outputs = [g.op("Relu", y, name="y")]
    return g


def test_policy_keeps_float32_ops_in_float32_and_is_overridable():
    assert "Exp" in FP32_OPS
    g = _exp_graph()
    report = convert_precision(g, "fp16")
    exp = next(n for n in g.nodes if n.op == "Exp")
    # The graph input feeds Exp directly: no round trip through half, and Exp's result goes back to half.
    assert exp.inputs[0] is g.inputs[0] and exp.outputs[0].dtype is DType.FLOAT32
    assert [n.split(":")[0] for n in report.float32_nodes] == ["Exp"]
    mul = next(n for n in g.nodes if n.op == "Mul")
    assert mul.inputs[0].producer.op == "Cast" and mul.outputs[0].dtype is DType.FLOAT16
    x = np.array([[11.5, 1.0, -2.0, 0.0]], np.float32)  # exp(11.5) = 98,715: past fp16's 65,504
    got = kiln.load(g).run({"x": x})["y"]
    np.testing.assert_allclose(got, np.exp(x) * 0.5, rtol=2e-3)
    g2 = _exp_graph()
    report = convert_precision(g2, "fp16", policy={"Exp": "half"})
    assert report.float32_nodes == [] and next(n for n in g2.nodes if n.op == "Exp").outputs[0].dtype is DType.FLOAT16
    g3 = _exp_graph()
    convert_precision(g3, "fp16", policy=parse_policy(["Relu=float32"]))
    assert next(n for n in g3.nodes if n.op == "Relu").outputs[0].dtype is DType.FLOAT32


@pytest.mark.parametrize("items, message", [(["Exp"], "OP=half or OP=float32"), (["Exp=double"], "OP=half"),
                                            (["=half"], "OP=half")])
def test_policy_errors(items, message):
    with pytest.raises(KilnError, match=message):
        parse_policy(items)


def test_bad_arguments_are_refused():
    with pytest.raises(KilnError, match="fp16 or bf16"):
        convert_precision(mlp_graph(), "fp8")
    with pytest.raises(KilnError, match="io must be"):
        convert_precision(mlp_graph(), "fp16", io="int")
    with pytest.raises(KilnError, match="'half' or 'float32'"):
        convert_precision(mlp_graph(), "fp16", policy={"Exp": "fp64"})


def test_out_of_range_weights_are_clamped_and_counted():
    g = Graph("mask")
    x = g.add_input("x", "float32", (2, 3))
    m = g.add_initializer("mask", np.array([0.0, np.finfo(np.float32).min, 1e5], np.float32))
    g.outputs = [g.op("Softmax", g.op("Add", x, m), name="y")]
    report = convert_precision(g, "fp16")
    assert report.clamped == 2
    assert g.initializers["mask"].const.tolist() == [0.0, -65504.0, 65504.0]
    got = kiln.load(g).run({"x": np.zeros((2, 3), np.float32)})["y"]
    assert np.isfinite(got).all()
    assert convert_precision(_exp_graph(), "bf16").clamped == 0  # bfloat16 has float32's range


def test_an_op_whose_types_refuse_half_runs_in_float32():
    """NonMaxSuppression takes float32 only (as ONNX's schema): in an fp16 model it stays float32, its inputs cast."""
    g = Graph("nms")
    boxes = g.add_input("boxes", "float32", (1, 3, 4))
    scores = g.add_input("scores", "float32", (1, 1, 3))
    scaled = g.op("Mul", boxes, g.add_initializer("k", np.array(2, np.float32)))
    g.outputs = [g.op("NonMaxSuppression", scaled, scores, g.add_initializer("m", np.array([3], np.int64)),
                      g.add_initializer("iou", np.array([0.5], np.float32)), name="y")]
    report = convert_precision(g, "fp16")
    assert [e.split(":")[::2] for e in report.float32_nodes] == [["NonMaxSuppression", "types"]]
    b = np.array([[[0, 0, 1, 1], [0, 0, 1, 1.1], [2, 2, 3, 3]]], np.float32)
    got = kiln.load(g).run({"boxes": b, "scores": np.array([[[0.9, 0.8, 0.7]]], np.float32)})["y"]
    np.testing.assert_array_equal(got, [[0, 0, 0], [0, 0, 2]])


def test_casts_to_float_inside_the_model_land_in_half():
    g = Graph("c")
    ids = g.add_input("mask", "int64", ("b", 4))
    x = g.add_input("x", "float32", ("b", 4))
    m = g.op("Cast", ids, to=DType.FLOAT32.value)
    g.outputs = [g.op("Mul", x, m, name="y")]
    convert_precision(g, "fp16")
    cast = next(n for n in g.nodes if n.op == "Cast" and n.inputs[0] is g.inputs[0])
    assert cast.attrs["to"] == DType.FLOAT16.value and cast.outputs[0].dtype is DType.FLOAT16


def test_upcast_is_the_inverse_and_a_no_op_on_float32():
    g = mlp_graph()
    assert upcast_to_float32(g) is False
    convert_precision(g, "bf16")
    assert upcast_to_float32(g) is True
    assert floats(g) == {DType.FLOAT32}


# ------------------------------------------------------------------------- real models, traced from torch

@pytest.fixture(scope="module")
def zoo():
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo as z
    return z


@pytest.mark.parametrize("name", ["resnet18", "transformer_encoder", "gpt", "mobilenet_v3"])
@pytest.mark.parametrize("precision, tol", [("fp16", 1e-2), ("bf16", 5e-2)])
def test_zoo_models_convert_save_load_and_answer_close_to_torch(zoo, name, precision, tol, tmp_path):
    import torch
    model, inputs, spec = zoo.by_name(name).factory()
    g = kiln.trace(model, inputs, dynamic=spec)
    report = convert_precision(g, precision)
    assert report.weights > 0
    path = kiln.save(g, tmp_path / "m.kiln")  # the verifier checks every type on the way
    names, tensors = zoo.input_list(model, inputs)
    with torch.inference_mode():
        want = model(*tensors) if not isinstance(inputs, dict) else model(**inputs)
    want = (want if isinstance(want, (tuple, list)) else [want])
    got = list(kiln.load(path).run(dict(zip(names, [t.numpy() for t in tensors]))).values())
    for w, o in zip(want, got):
        w = w.float().numpy()
        assert o.shape == w.shape
        err = np.abs(o.astype(np.float32) - w).max() / max(np.abs(w).max(), 1e-6)
        assert err <= tol, (name, precision, err)


def test_a_converted_model_is_not_converted_again():
    g = mlp_graph()
    convert_precision(g, "fp16")
    with pytest.raises(KilnError, match="already converted to fp16"):
        convert_precision(g, "bf16")


# ------------------------------------------------------------------------- property: random graphs

def test_random_graphs_convert_to_valid_half_graphs_that_answer_close():
    """tests/passes/test_property.py's random graphs (elementwise ops, MatMul with constant weights, Reshape
    and Transpose pairs, Shape arithmetic, casts, dead nodes): converted, every graph verifies, keeps its
    signature and output names, has no float32 weight or activation left outside the interface, and (when
    it divides by nothing data-dependent) answers within half precision of the float32 graph."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kiln.ir import evaluate, verify
    from kiln.ir.passes import optimize
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers (--import-mode=importlib)
    from test_property import RandomGraph

    @settings(max_examples=60, deadline=None)
    @given(st.data(), st.booleans(), st.sampled_from(["fp16", "bf16"]))
    def check(data, symbolic, precision):
        g = RandomGraph(data, symbolic).build()
        original = g.copy()
        convert_precision(g, precision)
        optimize(g)
        verify(g)
        assert [(v.name, v.type) for v in g.inputs] == [(v.name, v.type) for v in original.inputs]
        assert [(v.name, v.dtype) for v in g.outputs] == [(v.name, v.dtype) for v in original.outputs]
        interface = set(g.inputs) | set(g.outputs)
        # (an output the optimizer folded to a constant is a float32 weight, read by the Identity that keeps
        # the output's name: the interface's dtype)
        for v in g.initializers.values():
            if v.dtype is DType.FLOAT32 and v not in interface:
                assert all(u.op == "Identity" and u.outputs[0] in interface for u in v.users), v.name
        for n in g.nodes:
            for o in n.outputs:
                if o.dtype is DType.FLOAT32 and o not in interface:
                    readers = {u.op for u in o.users}
                    assert n.op == "Cast" or readers <= {"Cast"}, (n.describe(), readers)
        if any(n.op == "Div" for n in original.nodes):
            return
        rng = np.random.default_rng(0)
        feeds = {"x": rng.normal(size=(2, 3, 4)).astype(np.float32), "y": rng.normal(size=(3, 4)).astype(np.float32)}
        h = g.copy()
        upcast_to_float32(h)
        with np.errstate(all="ignore"):
            for want, got in zip(evaluate(original, feeds), evaluate(h, feeds)):
                assert got.dtype == want.dtype and got.shape == want.shape
                scale = max(float(np.nanmax(np.abs(want))) if want.size else 0.0, 1.0)
                tol = 3e-2 if precision == "bf16" else 5e-3
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)

    check()


# ----------------------------------------------------------------------------------------- weight-only int8

def _linear_graph(transposed: bool, dtype="float32") -> Graph:
    """x @ W (+ b) twice, W [128, 96] big enough to quantize; the first as a traced nn.Linear reads it
    (MatMul(x, Transpose(W)) with W [out, in]) when ``transposed``."""
    rng = np.random.default_rng(7)
    g = Graph("lin")
    x = g.add_input("x", "float32", ("n", 128))
    w1 = rng.standard_normal((96, 128) if transposed else (128, 96)).astype(np.float32) / 10
    w1v = g.add_initializer("w1", w1)
    h = g.op("MatMul", x, g.op("Transpose", w1v, perm=[1, 0]) if transposed else w1v)
    h = g.op("Relu", g.op("Add", h, g.add_initializer("b1", rng.standard_normal(96).astype(np.float32))))
    g.outputs = [g.op("MatMul", h, g.add_initializer("w2", rng.standard_normal((96, 64)).astype(np.float32) / 10),
                      name="y")]
    return g


@pytest.mark.parametrize("precision", [None, "fp16", "bf16"])
@pytest.mark.parametrize("transposed", [False, True])
def test_int8_weights_keep_the_weight_dtype_and_answer_close(precision, transposed):
    from kiln.ir.passes.precision import quantize_gemm_weights
    g = _linear_graph(transposed)
    feeds = {"x": np.random.default_rng(8).standard_normal((5, 128)).astype(np.float32)}
    want = kiln.load(g.copy()).run(feeds)["y"]
    if precision:
        pytest.importorskip("ml_dtypes")
        convert_precision(g, precision)
    summary = quantize_gemm_weights(g)
    assert "int8 weights: 2 GEMM weights" in summary, summary
    dq = [n for n in g.nodes if n.op == "DequantizeLinear"]
    assert len(dq) == 2 and all(n.inputs[0].const.dtype == np.int8 for n in dq)
    half = {None: DType.FLOAT32, "fp16": DType.FLOAT16, "bf16": DType.BFLOAT16}[precision]
    assert all(n.inputs[1].dtype is half and n.outputs[0].dtype is half for n in dq)
    if transposed:  # the weight behind the Linear's Transpose: its output channels are axis 0
        t = next(n for n in g.nodes if n.op == "Transpose")
        assert t.inputs[0].producer.op == "DequantizeLinear" and t.inputs[0].producer.attrs["axis"] == 0
    verify(g)
    got = kiln.load(g).run(feeds)["y"]
    tol = {None: 2e-2, "fp16": 3e-2, "bf16": 6e-2}[precision]
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_int8_weights_leave_small_weights_alone(tmp_path):
    from kiln.ir.passes.precision import quantize_gemm_weights
    g = mlp_graph()  # 16 -> 32 -> ... : every weight under the size floor
    assert quantize_gemm_weights(g).startswith("int8 weights: 0 GEMM weights")
    assert not any(n.op == "DequantizeLinear" for n in g.nodes)


def test_kiln_load_and_convert_take_int8_weights(tmp_path):
    from kiln.cli import main
    g = _linear_graph(True)
    src = kiln.save(g, tmp_path / "m.kiln")
    feeds = {"x": np.random.default_rng(9).standard_normal((3, 128)).astype(np.float32)}
    want = kiln.load(src).run(feeds)["y"]
    got = kiln.load(src, weights="int8").run(feeds)["y"]
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    with pytest.raises(KilnError, match="weights= takes 'int8'"):
        kiln.load(src, weights="int4")
    out = tmp_path / "m8.kiln"
    assert main(["convert", str(src), str(out), "--precision", "fp16", "--weights", "int8"]) == 0
    assert out.stat().st_size < 0.65 * (src.stat().st_size / 2)  # well under the fp16 file
    np.testing.assert_allclose(kiln.load(out).run(feeds)["y"], want, rtol=0, atol=4e-2 * np.abs(want).max())
