"""kiln.FusedElementwise: inference re-infers the closed body with the node's input types (symbols
included), the reference evaluates the body, the CPU runtime agrees, the node survives a .kiln
round trip (a graph attribute on a kiln-domain op) and exports to valid, runnable ONNX with the
body inlined."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.errors import ShapeInferenceError, VerifyError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import infer_shapes
from kiln.ir.types import TensorType
from op_harness import check_backends

RNG = np.random.default_rng(0)


def fused_graph(*, body_shape=(2, 3), outer_shape=("batch", 3), gelu: bool = False) -> Graph:
    """y, z = FusedElementwise(x, b) with body: t = Relu(x + b) * 0.5; y = t; z = Exp(t) (or Gelu)."""
    g = Graph("fused_test")
    x = g.add_input("x", "float32", outer_shape)
    b = g.add_input("b", "float32", (3,))
    body = g.subgraph("fused_body")
    bx = body.add_input("bx", "float32", body_shape)
    bb = body.add_input("bb", "float32", (3,))
    half = body.add_initializer("half", np.array(0.5, np.float32))
    t = body.op("Mul", body.op("Relu", body.op("Add", bx, bb)), half)
    z = body.op("Gelu", t) if gelu else body.op("Exp", t)
    body.outputs = [t, z]
    node = g.add_node("FusedElementwise", [x, b], {"body": body}, domain="kiln", num_outputs=2)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    verify(g)
    return g


def reference(x: np.ndarray, b: np.ndarray) -> list:
    t = np.maximum(x + b, 0) * np.float32(0.5)
    return [t, np.exp(t)]


def test_inference_substitutes_the_node_input_types():
    g = fused_graph()
    # The body was typed for [2, 3]; the node's input is [batch, 3] and so are its outputs.
    assert [v.type for v in g.outputs] == [TensorType("float32", ("batch", 3))] * 2
    assert g.outputs[0].type != g.nodes[0].attrs["body"].outputs[0].type  # the body kept its own types


def test_reference_and_cpu_runtime_match_the_body():
    g = fused_graph()
    for batch in (1, 2, 5):
        feeds = [RNG.standard_normal((batch, 3)).astype(np.float32), RNG.standard_normal(3).astype(np.float32)]
        outs = evaluate(g, feeds)
        for got, want in zip(outs, reference(*feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        check_backends(g, feeds, outs)


def test_dtype_mismatch_and_open_bodies_are_rejected():
    g = Graph("bad")
    x = g.add_input("x", "float32", (2,))
    body = g.subgraph("body")
    bx = body.add_input("bx", "float32", (2,))
    body.outputs = [body.op("Add", bx, x)]  # reads the outer x: not closed
    node = g.add_node("FusedElementwise", [x], {"body": body}, domain="kiln", num_outputs=1)
    g.outputs = list(node.outputs)
    with pytest.raises(ShapeInferenceError, match="does not define"):
        infer_shapes(g)

    g2 = Graph("bad2")
    i = g2.add_input("i", "int64", (2,))
    body2 = g2.subgraph("body")
    body2.outputs = [body2.op("Neg", body2.add_input("bx", "float32", (2,)))]
    node2 = g2.add_node("FusedElementwise", [i], {"body": body2}, domain="kiln", num_outputs=1)
    g2.outputs = list(node2.outputs)
    with pytest.raises(ShapeInferenceError, match="body takes float32"):
        infer_shapes(g2)


def test_output_count_must_match_the_body():
    g = fused_graph()
    node = g.nodes[0]
    node.outputs.pop()
    g.outputs = g.outputs[:1]
    with pytest.raises(VerifyError, match="returns 2 values"):
        verify(g)


def test_kiln_file_round_trip(tmp_path):
    g = fused_graph()
    path = kiln.save(g, tmp_path / "fused.kiln")
    back = kiln.load_graph(path)
    verify(back)
    assert str(back) == str(g)
    assert back.nodes[0].attrs["body"].parent is back
    feeds = [RNG.standard_normal((4, 3)).astype(np.float32), RNG.standard_normal(3).astype(np.float32)]
    for want, got in zip(evaluate(g, feeds), kiln.load(path).run(feeds, as_list=True)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("opset", [18, 20])
def test_onnx_export_inlines_the_body(opset):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model

    g = fused_graph(gelu=True)
    proto = to_onnx_model(g, opset=opset)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "FusedElementwise" not in ops and "Relu" in ops
    assert ("Gelu" in ops) == (opset >= 20)  # the body's nodes go through the exporter's expansions too
    assert [o.name for o in proto.graph.output] == [v.name for v in g.outputs]
    feeds = [RNG.standard_normal((3, 3)).astype(np.float32), RNG.standard_normal(3).astype(np.float32)]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": feeds[0], "b": feeds[1]})
    for w, o in zip(evaluate(g, feeds), got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)


def test_onnx_export_of_a_body_returning_its_input_twice():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model

    g = Graph("passthrough")
    x = g.add_input("x", "float32", (2,))
    body = g.subgraph("body")
    bx = body.add_input("bx", "float32", (2,))
    r = body.op("Relu", bx)
    body.outputs = [bx, r, r]
    node = g.add_node("FusedElementwise", [x], {"body": body}, domain="kiln", num_outputs=3)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    verify(g)
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    a = np.array([-1.0, 2.0], np.float32)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": a})
    for w, o in zip(evaluate(g, [a]), got):
        np.testing.assert_array_equal(o, w)
    check_backends(g, [a], evaluate(g, [a]))
