"""fuse_epilogues / kiln.FusedEpilogue: which anchor joins which consumer (ResNet's Conv -> Relu
and Conv -> Add(residual) -> Relu, the downsample block's two convolutions, BERT's MatMul ->
Add(bias) [-> Gelu], Gemm -> Relu), what is left alone (an anchor output read twice, a graph
output, a broadcasting consumer, an integer or partly unknown anchor output), the body's layout
(anchor first, its inputs first and outer, weights never pulled in), If bodies, idempotence and
names, the layout validator (each rule breaks ``verify``), and that fused graphs compute what the
unfused ones do: in the reference evaluator, in the CPU runtime for every zoo model (whose
kernels inside a body still see the outer constant weights), after a .kiln round trip and in
onnxruntime after ONNX export."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError, VerifyError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.ops.fused import ANCHOR_OPS, epilogue_parts
from kiln.ir.passes import fuse_elementwise, fuse_epilogues, infer_shapes
from kiln.ir.passes.fuse import SMALL_CONSTANT
from kiln.ir.types import TensorType

RNG = np.random.default_rng(0)


def epilogues(g: Graph) -> bool:
    """The pass as check_pass wants it (a bool: whether it changed the graph)."""
    return fuse_epilogues(g) > 0


def both(g: Graph) -> bool:
    """fuse_elementwise, then fuse_epilogues: how a GPU loader runs them."""
    return (fuse_elementwise(g) + fuse_epilogues(g)) > 0


def epilogue_nodes(g: Graph) -> list:
    return [n for n in g.walk() if n.qualified_op == "kiln.FusedEpilogue"]


def body_ops(node) -> list:
    return [n.op for n in node.attrs["body"].nodes]


def weight(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32) * 0.3


def assert_layout(node, anchor_op: str, outer_anchor_inputs: list) -> None:
    """The contract the CUDA kernel relies on, checked by hand (not through epilogue_parts)."""
    body = node.attrs["body"]
    anchor = body.nodes[0]
    k = len(outer_anchor_inputs)
    assert anchor.op == anchor_op and len(anchor.inputs) == k
    assert list(anchor.inputs) == body.inputs[:k] and list(node.inputs[:k]) == outer_anchor_inputs
    y = anchor.outputs[0]
    assert y not in body.outputs and all(u.graph is body for u in y.users)
    for inner in body.nodes[1:]:
        assert inner.outputs[0].type.shape == y.type.shape
        assert not set(inner.inputs) & set(body.inputs[:k])
    assert epilogue_parts(body) == (anchor, k)


# --------------------------------------------------------------------------- what fuses


def conv(g: Graph, x, cin: int, cout: int, k: int = 3, stride: int = 1, bias: bool = True):
    w = g.add_constant(weight(cout, cin, k, k), "w")
    b = g.add_constant(weight(cout), "b") if bias else None
    return g.op("Conv", x, w, b, pads=(k // 2,) * 4, strides=(stride, stride))


def test_conv_relu(check_pass):
    g = Graph("conv_relu")
    x = g.add_input("x", "float32", ("batch", 3, 8, 8))
    c = conv(g, x, 3, 4)
    g.outputs = [g.op("Relu", c)]
    w, b = c.producer.inputs[1:]
    out = g.outputs[0]
    check_pass(epilogues, g, feeds_for(g))
    (node,) = g.nodes
    assert body_ops(node) == ["Conv", "Relu"]
    assert_layout(node, "Conv", [x, w, b])
    assert b.const.size <= SMALL_CONSTANT and not node.attrs["body"].initializers  # weights stay outer
    assert node.outputs == [out] and out.name == "relu" and g.outputs == [out]
    assert node.name == "epilogue"


def test_residual_block_after_fuse_elementwise(check_pass, tmp_path):
    """Conv -> Add(residual) -> Relu: the Add+Relu group and the Conv become one node."""
    g = Graph("residual")
    x = g.add_input("x", "float32", ("batch", 4, 8, 8))
    h = g.op("Relu", conv(g, x, 4, 4))
    c2 = conv(g, h, 4, 4)
    g.outputs = [g.op("Relu", g.op("Add", c2, x))]
    c2.producer.meta["scope"] = "layer1.0.conv2"
    anchor_inputs = list(c2.producer.inputs)
    check_pass(both, g, feeds_for(g))
    first, second = g.nodes
    assert [n.qualified_op for n in g.nodes] == ["kiln.FusedEpilogue"] * 2
    assert body_ops(first) == ["Conv", "Relu"] and body_ops(second) == ["Conv", "Add", "Relu"]
    assert anchor_inputs[0] is h and first.outputs == [h]
    assert_layout(second, "Conv", anchor_inputs)
    assert second.inputs[3] is x and len(second.inputs) == 4  # the residual follows the anchor's inputs
    assert second.meta["scope"] == "layer1.0.conv2"  # the anchor's meta
    before = g.copy()
    for batch in (1, 2):
        feeds = feeds_for(g, batch, seed=batch)
        got = kiln.load(kiln.save(g, tmp_path / "residual.kiln")).run(feeds, as_list=True)
        np.testing.assert_allclose(got[0], evaluate(before, feeds)[0], rtol=1e-5, atol=1e-6)


def test_cpu_kernels_inside_the_body_see_the_outer_constant_weights(monkeypatch, tmp_path):
    """The CPU Conv kernel prepares a constant weight at load and runs the (slow) reference for a
    computed one; in an epilogue body the weight is a body input, but the kernel is chosen seeing
    the outer constant: no reference fallback, and the very numbers of the unfused graph."""
    from kiln.runtime.kernels.cpu import nn as cpu_nn

    g = Graph("convs")
    x = g.add_input("x", "float32", ("batch", 3, 8, 8))
    h = g.op("Relu", conv(g, x, 3, 4))
    g.outputs = [g.op("Relu", g.op("Add", conv(g, h, 4, 4, k=1, bias=False), h))]
    infer_shapes(g)
    before = g.copy()
    assert both(g) and len(epilogue_nodes(g)) == 2
    feeds = feeds_for(g, batch=2)
    want = kiln.load(before).run(feeds, as_list=True)[0]

    def no_reference(node, attrs):
        raise AssertionError(f"{node.describe()} fell back to the reference kernel")

    monkeypatch.setattr(cpu_nn, "reference_kernel", no_reference)
    got = kiln.load(kiln.load_graph(kiln.save(g, tmp_path / "convs.kiln"))).run(feeds, as_list=True)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shortcut_last", [True, False])
def test_downsample_block_absorbs_the_later_conv(check_pass, shortcut_last):
    """Add(conv2(relu(conv1(x))), downsample(x)): the convolution computed later joins the Add,
    the other one stays a plain Conv whose output is an input of the fused node."""
    g = Graph("downsample")
    x = g.add_input("x", "float32", ("batch", 4, 8, 8))
    if shortcut_last:
        main = conv(g, g.op("Relu", conv(g, x, 4, 8, stride=2)), 8, 8)
        short = conv(g, x, 4, 8, k=1, stride=2, bias=False)
    else:
        short = conv(g, x, 4, 8, k=1, stride=2, bias=False)
        main = conv(g, g.op("Relu", conv(g, x, 4, 8, stride=2)), 8, 8)
    g.outputs = [g.op("Relu", g.op("Add", main, short))]
    later, earlier = (short, main) if shortcut_last else (main, short)
    later_inputs = [v for v in later.producer.inputs if v is not None]
    check_pass(both, g, feeds_for(g))
    fused = epilogue_nodes(g)
    assert sorted(body_ops(n) for n in fused) == [["Conv", "Add", "Relu"], ["Conv", "Relu"]]
    (block,) = [n for n in fused if body_ops(n) == ["Conv", "Add", "Relu"]]
    assert_layout(block, "Conv", later_inputs)
    assert earlier.producer.op == "Conv" and earlier.producer.graph is g and earlier.users == [block]
    assert list(block.inputs[len(later_inputs):]) == [earlier]


def test_trailing_omitted_input_is_dropped(check_pass):
    g = Graph("nobias")
    x = g.add_input("x", "float32", ("batch", 8))
    w = g.add_constant(weight(4, 8), "w")
    g.outputs = [g.op("Relu", g.op("Gemm", x, w, None, transB=1))]
    assert len(g.nodes[0].inputs) == 3
    check_pass(epilogues, g, feeds_for(g))
    assert_layout(g.nodes[0], "Gemm", [x, w])


def test_gemm_relu(check_pass):
    g = Graph("gemm")
    x = g.add_input("x", "float32", ("batch", 8))
    w, b = g.add_constant(weight(16, 8), "w"), g.add_constant(weight(16), "b")
    g.outputs = [g.op("Relu", g.op("Gemm", x, w, b, transB=1))]
    check_pass(epilogues, g, feeds_for(g))
    (node,) = g.nodes
    assert body_ops(node) == ["Gemm", "Relu"]
    assert node.attrs["body"].nodes[0].attrs == {"transB": 1}
    assert_layout(node, "Gemm", [x, w, b])


@pytest.mark.parametrize("n", [32, 96])
def test_matmul_bias_with_symbolic_batch(check_pass, tmp_path, n):
    """BERT's projection: MatMul -> Add(bias [N]). A small bias is pulled into the body like any
    small constant of an epilogue; a larger one is a node input after the anchor's."""
    g = Graph("proj")
    x = g.add_input("x", "float32", ("batch", "seq", 16))
    w, b = g.add_constant(weight(16, n), "w"), g.add_constant(weight(n), "bias")
    g.outputs = [g.op("Add", g.op("MatMul", x, w), b)]
    check_pass(epilogues, g, feeds_for(g))
    (node,) = g.nodes
    assert body_ops(node) == ["MatMul", "Add"]
    assert_layout(node, "MatMul", [x, w])
    body = node.attrs["body"]
    if n <= SMALL_CONSTANT:
        assert list(node.inputs) == [x, w] and [v.const for v in body.initializers.values()] == [b.const]
        assert "bias" not in g.initializers
    else:
        assert list(node.inputs) == [x, w, b] and not body.initializers
    assert g.outputs[0].type == TensorType("float32", ("batch", "seq", n))
    before = g.copy()
    for batch, seq in ((1, 5), (3, 2)):
        feeds = {"x": RNG.standard_normal((batch, seq, 16)).astype(np.float32)}
        got = kiln.load(kiln.save(g, tmp_path / "proj.kiln")).run(feeds, as_list=True)[0]
        np.testing.assert_allclose(got, evaluate(before, feeds)[0], rtol=1e-5, atol=1e-6)


def test_matmul_bias_gelu_group(check_pass):
    """MatMul -> FusedElementwise(Add bias, Gelu): the group's body is flattened into the epilogue
    (its nodes keep their names), and an intermediate read outside stays a node output."""
    g = Graph("ffn")
    x = g.add_input("x", "float32", ("batch", 8))
    y = g.op("MatMul", x, g.add_constant(weight(8, 8), "w"))
    biased = g.op("Add", y, g.add_constant(weight(8), "b"))
    act = g.op("Gelu", biased)
    g.outputs = [act, g.op("ReduceSum", biased, keepdims=0)]
    assert fuse_elementwise(g) == 1
    group = g.find_node("fused")
    inner_names = [n.name for n in group.attrs["body"].nodes]
    check_pass(epilogues, g, feeds_for(g))
    (node,) = epilogue_nodes(g)
    assert body_ops(node) == ["MatMul", "Add", "Gelu"]
    assert [n.name for n in node.attrs["body"].nodes[1:]] == inner_names
    assert node.outputs == [biased, act] and biased.users == [g.find_node("reducesum")]
    assert [v.name for v in node.outputs] == ["add", "gelu"]
    assert "fused" not in {n.name for n in g.walk()}


def test_epilogue_reading_an_anchor_input_gets_its_own_body_input(check_pass):
    """MatMul(x, x) + x: only the anchor reads body inputs 0..k-1, so x comes in three times."""
    g = Graph("square")
    x = g.add_input("x", "float32", (4, 4))
    g.outputs = [g.op("Add", g.op("MatMul", x, x), x)]
    check_pass(epilogues, g, feeds_for(g))
    (node,) = g.nodes
    assert list(node.inputs) == [x, x, x] and len(set(node.attrs["body"].inputs)) == 3
    assert_layout(node, "MatMul", [x, x])


def test_anchors_argument():
    g = Graph("mixed")
    x = g.add_input("x", "float32", (2, 8))
    h = g.op("Relu", g.op("Gemm", x, g.add_constant(weight(8, 8), "w")))
    g.outputs = [g.op("Tanh", g.op("MatMul", h, g.add_constant(weight(8, 8), "v")))]
    infer_shapes(g)
    assert fuse_epilogues(g, anchors={"MatMul"}) == 1
    assert [body_ops(n) for n in epilogue_nodes(g)] == [["MatMul", "Tanh"]]
    assert fuse_epilogues(g) == 1 and fuse_epilogues(g) == 0
    with pytest.raises(ValueError, match="Softmax"):
        fuse_epilogues(g, anchors={"MatMul", "Softmax"})
    assert ANCHOR_OPS == {"Conv", "Gemm", "MatMul"}


# --------------------------------------------------------------------------- what does not fuse


def _used_twice(g, x, w):
    y = g.op("MatMul", x, w)
    return [g.op("Relu", y), g.op("ReduceSum", y, keepdims=0)]


def _graph_output(g, x, w):
    y = g.op("MatMul", x, w)
    return [y, g.op("Relu", y)]


def _broadcasting(g, x, w):
    y = g.op("MatMul", x, g.add_constant(weight(8, 1), "w1"))     # [batch, 1]
    return [g.op("Relu", g.op("Add", y, x))]                      # grows to [batch, 8]


def _integer(g, x, w):
    xi = g.op("Cast", x, to=6)
    y = g.op("MatMul", xi, g.add_constant(np.ones((8, 8), np.int32), "wi"))
    return [g.op("Abs", y)]


def _read_twice_by_one_op(g, x, w):
    y = g.op("MatMul", x, w)
    return [g.op("Mul", y, y)]


def _non_elementwise_consumer(g, x, w):
    return [g.op("Softmax", g.op("MatMul", x, w))]


def _dead_consumer(g, x, w):
    g.op("Relu", g.op("MatMul", x, w))
    return [g.op("Neg", x)]


@pytest.mark.parametrize("build", [_used_twice, _graph_output, _broadcasting, _integer, _read_twice_by_one_op,
                                   _non_elementwise_consumer, _dead_consumer])
def test_left_alone(check_pass, build):
    g = Graph("alone")
    x = g.add_input("x", "float32", ("batch", 8))
    g.outputs = build(g, x, g.add_constant(weight(8, 8), "w"))
    check_pass(epilogues, g, feeds_for(g), changes=False)


def test_unknown_dims_are_left_alone():
    g = Graph("unknown")
    x = g.add_input("x", "float32", (None, 8))
    g.outputs = [g.op("Relu", g.op("MatMul", x, g.add_constant(weight(8, 8), "w")))]
    infer_shapes(g)
    assert None in g.outputs[0].type.shape and fuse_epilogues(g) == 0


# --------------------------------------------------------------------------- control flow, names


def test_inside_an_if_branch(tmp_path):
    g = Graph("control")
    x = g.add_input("x", "float32", ("batch", 8))
    w = g.add_constant(weight(8, 8), "w")
    cond = g.op("Greater", g.op("ReduceSum", x, keepdims=0), g.add_constant(np.array(0, np.float32), "zero"))
    then_b = g.subgraph("then")
    then_b.outputs = [then_b.op("Relu", then_b.op("Add", then_b.op("MatMul", x, w), x))]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Neg", x)]
    g.outputs = [g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}).outputs[0]]
    infer_shapes(g)
    before = g.copy()
    assert both(g)
    verify(g)
    (node,) = epilogue_nodes(g)
    assert node.graph is then_b and list(node.inputs) == [x, w, x]  # outer values as node inputs
    assert body_ops(node) == ["MatMul", "Add", "Relu"]
    assert not both(g)
    program = kiln.load(kiln.save(g, tmp_path / "control.kiln"))
    for seed in range(4):  # both branches
        feeds = feeds_for(g, 2, seed=seed)
        np.testing.assert_allclose(program.run(feeds, as_list=True)[0], evaluate(before, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


def build_mlp() -> Graph:
    g = Graph("mlp")
    x = g.add_input("x", "float32", ("batch", 8))
    h = g.op("Gemm", x, g.add_initializer("w0", np.ones((8, 8), np.float32)), transB=1)
    h.producer.meta.update({"scope": "net.0", "source": "model.py:7"})
    h = g.op("Relu", h)
    y = g.op("MatMul", h, g.add_initializer("w1", np.eye(8, dtype=np.float32)))
    g.outputs = [g.op("Sigmoid", g.op("Add", y, h))]
    infer_shapes(g)
    return g


def test_names_are_deterministic_and_the_anchor_meta_is_kept():
    g1, g2 = build_mlp(), build_mlp()
    assert both(g1) and both(g2)
    assert str(g1) == str(g2)
    first, second = epilogue_nodes(g1)
    assert (first.name, second.name) == ("epilogue", "epilogue_1")
    assert first.meta == {"scope": "net.0", "source": "model.py:7"}


# --------------------------------------------------------------------------- the layout validator


def hand_built(make_body, inputs=("x", "w", "r"), out_type=TensorType("float32", (2, 4))) -> tuple:
    """A FusedEpilogue node reading the outer values named ``inputs`` (x [2, 8], w [8, 4],
    r [2, 4], s [4, 4]) whose body outputs ``make_body(body, *body inputs)`` gives; its outputs
    typed ``out_type`` (so ``verify`` re-runs inference on it)."""
    g = Graph("hand")
    outer = {"x": g.add_input("x", "float32", (2, 8)), "w": g.add_initializer("w", weight(8, 4)),
             "r": g.add_input("r", "float32", (2, 4)), "s": g.add_initializer("s", weight(4, 4))}
    body = g.subgraph("epilogue_body")
    bvals = [body.add_input(f"b{n}", outer[n].type.dtype, outer[n].type.shape) for n in inputs]
    body.outputs = make_body(body, *bvals)
    node = g.add_node("FusedEpilogue", [outer[n] for n in inputs], {"body": body}, domain="kiln",
                      num_outputs=len(body.outputs), output_types=[out_type] * len(body.outputs))
    g.outputs = list(node.outputs)
    return g, body


def valid_body(body, bx, bw, br):
    return [body.op("Relu", body.op("Add", body.op("MatMul", bx, bw), br))]


def test_a_hand_built_epilogue_verifies_and_runs():
    g, body = hand_built(valid_body)
    verify(g)
    anchor, k = epilogue_parts(body)
    assert (anchor.op, k) == ("MatMul", 2)
    feeds = feeds_for(g)
    x, r, w = feeds["x"], feeds["r"], g.initializers["w"].const
    want = np.maximum(x @ w + r, 0)
    np.testing.assert_allclose(evaluate(g, feeds)[0], want, rtol=1e-6)
    np.testing.assert_allclose(kiln.load(g, optimize=False).run(feeds, as_list=True)[0], want, rtol=1e-5)


def _unread_anchor(b, x, w, r):
    b.op("MatMul", x, w)
    return [b.op("Relu", r)]


# case -> (body builder, outer inputs, the rule the error must name)
BROKEN = {
    "no nodes": (lambda b, x, w, r: [r], "xwr", "anchor rule"),
    "first node is no anchor": (lambda b, x, w, r: [b.op("Relu", b.op("MatMul", b.op("Neg", x), w))], "xwr",
                                "anchor rule"),
    "anchor inputs out of order": (lambda b, w, x, r: [b.op("Relu", b.op("MatMul", x, w))], "wxr",
                                   "anchor input rule"),
    "omitted anchor input": (lambda b, x, w, r: [b.op("Relu", b.op("Gemm", x, w, None))], "xwr",
                             "anchor input rule"),
    "epilogue reads an anchor input": (lambda b, r, s, x: [b.op("Add", b.op("MatMul", r, s), r)], "rsx",
                                       "anchor input rule"),
    "non-elementwise epilogue op": (lambda b, x, w, r: [b.op("Softmax", b.op("MatMul", x, w))], "xwr",
                                    "epilogue rule"),
    "anchor output is a body output": (lambda b, x, w, r: [b.op("MatMul", x, w)], "xwr", "anchor output rule"),
    "anchor output unread": (_unread_anchor, "xwr", "anchor output rule"),
    "epilogue grows the shape": (
        lambda b, x, w, r: [b.op("Add", b.op("MatMul", x, w), b.add_constant(np.zeros((3, 1, 4), np.float32)))],
        "xwr", "shape rule"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_bodies_fail_verify_naming_the_rule(case):
    make_body, inputs, rule = BROKEN[case]
    g, body = hand_built(make_body, tuple(inputs))
    with pytest.raises(KilnError, match=rule):
        epilogue_parts(body)
    with pytest.raises(VerifyError, match=rule):
        verify(g)


# --------------------------------------------------------------------------- zoo, files, ONNX

torch = pytest.importorskip("torch")
import zoo  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402
from graph_feeds import feeds_for

# Epilogue kinds (body ops joined by '+') that must appear, where the model's shape is known.
EXPECTED = {
    "resnet18": {"Conv+Relu": 9, "Conv+Add+Relu": 8},  # stem + first convs; second convs + residual
    "transformer_encoder": {"MatMul+Add+Gelu": 2, "MatMul+Add+Add": 2},  # FFN up; FFN down + residual
}


def fused_zoo_graph(name: str):
    model, inputs, spec = zoo.by_name(name).factory()
    g = kiln.trace(model, inputs, dynamic=spec)
    before = g.copy()
    fuse_elementwise(g)
    made = fuse_epilogues(g)
    return model, inputs, spec, before, g, made


@pytest.mark.parametrize("entry", zoo.params())
def test_zoo_models_compute_the_same_in_the_cpu_runtime(entry):
    model, inputs, spec, before, g, made = fused_zoo_graph(entry.name)
    verify(g)
    assert made == len(epilogue_nodes(g)) > 0
    kinds = collections.Counter("+".join(body_ops(n)) for n in epilogue_nodes(g))
    for kind, count in EXPECTED.get(entry.name, {}).items():
        assert kinds[kind] == count, kinds
    for n in epilogue_nodes(g):
        epilogue_parts(n.attrs["body"])
    assert fuse_epilogues(g) == 0
    unfused, fused = kiln.load(before), kiln.load(g)
    for k, sizes in enumerate(entry.other_sizes):
        names, tensors = zoo.fresh_inputs(model, inputs, spec, sizes, seed=k)
        feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
        for w, o in zip(unfused.run(feeds, as_list=True), fused.run(feeds, as_list=True)):
            assert (o.dtype, o.shape) == (w.dtype, w.shape)
            # atol: the fused body's product may run on another kernel than the unfused one (a weight behind a
            # Transpose node is a body input there), so the last bits of a near-zero output may differ
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)


def test_save_load_round_trip(tmp_path):
    _, _, _, _, g, _ = fused_zoo_graph("resnet18")
    loaded = kiln.load_graph(kiln.save(g, tmp_path / "fused.kiln"))
    verify(loaded)
    assert str(loaded) == str(g)
    assert len(epilogue_nodes(loaded)) == 17
    feeds = feeds_for(g, batch=2)
    for w, o in zip(evaluate(g, feeds), kiln.load(loaded).run(feeds, as_list=True)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "gpt"])
def test_fused_graph_exports_to_onnx(name):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model

    model, inputs, spec, _, g, _ = fused_zoo_graph(name)
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    assert not {n.domain for n in proto.graph.node} - {"", "ai.onnx"}
    names, tensors = zoo.fresh_inputs(model, inputs, spec, {"batch": 2, "seq": 6}, seed=5)
    feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, o in zip(kiln.load(g).run(feeds, as_list=True), got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5)
