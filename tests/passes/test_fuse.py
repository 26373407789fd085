"""fuse_elementwise / fusion_groups: which groups form (chains, diamonds, broadcasts, shapes that
differ, convexity), how a group is rewritten (inputs, small constants pulled in, outputs = values
read outside or graph outputs, names, meta), that the fused graph computes what the original did
(reference evaluator and the CPU runtime, symbolic batch included), idempotence, If/Loop bodies,
the zoo models, and random graphs."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.ir import DType, Graph, evaluate, verify
from kiln.ir.passes import fuse_elementwise, fusion_groups, infer_shapes
from kiln.ir.passes.fuse import SMALL_CONSTANT
from sample_graphs import if_block, loop_block

RNG = np.random.default_rng(0)


def fuse(g: Graph) -> bool:
    """The pass as check_pass wants it (a bool: whether it changed the graph)."""
    return fuse_elementwise(g) > 0


def fused_nodes(g: Graph) -> list:
    return [n for n in g.walk() if n.qualified_op == "kiln.FusedElementwise"]


def body_ops(node) -> list:
    return [n.op for n in node.attrs["body"].nodes]


def assert_runtime_matches(before: Graph, after: Graph, feeds: dict, tmp_path, rtol=1e-5, atol=1e-6) -> None:
    """The fused graph, saved and loaded with kiln.load, computes what the original evaluates to."""
    path = kiln.save(after, tmp_path / "fused.kiln")
    got = kiln.load(path).run(feeds, as_list=True)
    for w, o in zip(evaluate(before, feeds), got):
        assert (o.dtype, o.shape) == (w.dtype, w.shape)
        np.testing.assert_allclose(o, w, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- shapes of groups


def test_chain_becomes_one_node(check_pass):
    g = Graph("chain")
    x = g.add_input("x", "float32", ("batch", 4))
    g.outputs = [g.op("Exp", g.op("Neg", g.op("Relu", x)))]
    check_pass(fuse, g, feeds_for(g))
    assert [n.qualified_op for n in g.nodes] == ["kiln.FusedElementwise"]
    node = g.nodes[0]
    assert body_ops(node) == ["Relu", "Neg", "Exp"]
    assert node.inputs == (x,) and node.outputs == g.outputs
    assert node.attrs["body"].inputs[0].type == x.type


def test_diamond(check_pass):
    g = Graph("diamond")
    x = g.add_input("x", "float32", ("batch", 4))
    a, b = g.op("Tanh", x), g.op("Sigmoid", x)
    g.outputs = [g.op("Add", a, b)]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert sorted(body_ops(node)) == ["Add", "Sigmoid", "Tanh"]
    assert len(node.inputs) == 1 and len(node.outputs) == 1


def test_broadcast_inputs_join_as_node_inputs(check_pass):
    g = Graph("bias")
    x = g.add_input("x", "float32", ("batch", 3, 4))
    bias = g.add_input("bias", "float32", (4,))
    scale = g.add_input("scale", "float32", (3, 1))
    g.outputs = [g.op("Relu", g.op("Mul", g.op("Add", x, bias), scale))]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert list(node.inputs) == [x, bias, scale]
    assert [v.type.shape for v in node.attrs["body"].inputs] == [("batch", 3, 4), (4,), (3, 1)]


def test_smaller_shapes_are_not_members(check_pass):
    """A [3, 1] computation feeding a [batch, 3, 4] group is an input of the group, not a member:
    every member has the group's full shape."""
    g = Graph("small")
    x = g.add_input("x", "float32", ("batch", 3, 4))
    s = g.add_input("s", "float32", (3, 1))
    small = g.op("Exp", g.op("Neg", s))       # [3, 1]: a group of its own
    g.outputs = [g.op("Relu", g.op("Mul", x, small))]
    groups = fusion_groups(g)
    assert [[n.op for n in m] for m in groups] == [["Neg", "Exp"], ["Mul", "Relu"]]
    check_pass(fuse, g, feeds_for(g))
    assert [body_ops(n) for n in g.nodes] == [["Neg", "Exp"], ["Mul", "Relu"]]


def test_small_constants_move_into_the_body_large_ones_stay(check_pass):
    g = Graph("consts")
    x = g.add_input("x", "float32", ("batch", 8, 9))
    small = g.add_initializer("small", np.full((1, 9), 2.0, np.float32))
    assert small.const.size <= SMALL_CONSTANT
    big = g.add_initializer("big", RNG.standard_normal((8, 9)).astype(np.float32))
    assert big.const.size > SMALL_CONSTANT
    g.outputs = [g.op("Add", g.op("Mul", x, small), big)]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert list(node.inputs) == [x, big]
    body = node.attrs["body"]
    (inner,) = body.initializers.values()
    assert inner.const is small.const  # shared, not copied
    assert "small" not in g.initializers  # nothing outside reads it any more
    assert "big" in g.initializers


def test_value_used_outside_becomes_an_output(check_pass):
    g = Graph("outside")
    x = g.add_input("x", "float32", (2, 4))
    w = g.add_initializer("w", RNG.standard_normal((4, 4)).astype(np.float32))
    a = g.op("Relu", g.op("Add", x, x))
    mid = g.op("Neg", a)
    after = g.op("MatMul", mid, w)      # reads mid, outside the group
    g.outputs = [g.op("Sub", after, g.op("Abs", x))]
    check_pass(fuse, g, feeds_for(g))
    fused = fused_nodes(g)[0]
    assert fused.outputs == [mid] and mid.name == "neg"
    assert mid.producer is fused and mid.users == [g.find_node("matmul")]


def test_graph_outputs_inside_a_group_keep_their_names(check_pass):
    g = Graph("outs")
    x = g.add_input("x", "float32", ("batch", 4))
    a = g.op("Relu", x)
    b = g.op("Tanh", a)
    g.outputs = [a, g.op("Exp", b), a]
    names = [v.name for v in g.outputs]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert [v.name for v in g.outputs] == names
    assert node.outputs == [a, g.outputs[1]]  # b is read only inside: not an output
    assert len(node.attrs["body"].outputs) == 2


def test_non_convex_candidates_are_split(check_pass):
    """relu -> neg -> MatMul -> add: relu, neg and add are connected (relu -> add) but a path
    leaves the group through the MatMul and comes back; relu+neg and add+tanh fuse apart."""
    g = Graph("convex")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", RNG.standard_normal((4, 4)).astype(np.float32))
    a = g.op("Relu", x)
    b = g.op("Neg", a)
    m = g.op("MatMul", b, w)
    g.outputs = [g.op("Tanh", g.op("Add", a, m))]
    assert [[n.op for n in grp] for grp in fusion_groups(g)] == [["Relu", "Neg"], ["Add", "Tanh"]]
    check_pass(fuse, g, feeds_for(g))
    assert [n.qualified_op for n in g.nodes] == ["kiln.FusedElementwise", "MatMul", "kiln.FusedElementwise"]
    assert g.nodes[0].outputs == [a, b]


def test_merging_two_groups_needs_no_path_between_them(check_pass):
    """Two chains joined by a final Add fuse as one group when independent, but not when one
    chain's input comes from the other through a non-member (a ReduceMean)."""
    g = Graph("merge")
    x = g.add_input("x", "float32", ("batch", 4))
    left = g.op("Exp", g.op("Relu", x))
    right = g.op("Sigmoid", g.op("Neg", x))
    g.outputs = [g.op("Add", left, right)]
    assert len(fusion_groups(g)) == 1 and len(fusion_groups(g)[0]) == 5

    g = Graph("layernorm")
    x = g.add_input("x", "float32", ("batch", 4))
    centered = g.op("Sub", x, g.op("ReduceMean", x, g.add_constant(np.array([1]), "axes")))
    var = g.op("ReduceMean", g.op("Mul", centered, centered), g.add_constant(np.array([1]), "axes"))
    std = g.op("Sqrt", g.op("Add", var, g.add_constant(np.array(1e-5, np.float32), "eps")))
    g.outputs = [g.op("Mul", g.op("Div", centered, std), g.add_constant(np.array(2.0, np.float32), "gamma"))]
    groups = [[n.op for n in m] for m in fusion_groups(g)]
    assert groups == [["Sub", "Mul"], ["Add", "Sqrt"], ["Div", "Mul"]]
    check_pass(fuse, g, feeds_for(g))


def test_min_ops_and_custom_op_sets():
    g = Graph("pair")
    x = g.add_input("x", "float32", (2, 4))
    g.outputs = [g.op("Tanh", g.op("Relu", x))]
    infer_shapes(g)
    assert fuse_elementwise(g, min_ops=3) == 0
    assert fusion_groups(g, ops={"Relu"}) == []
    assert fuse_elementwise(g, min_ops=2) == 1


def test_shape_arithmetic_and_unknown_dims_stay_unfused():
    g = Graph("shapes")
    x = g.add_input("x", "float32", ("batch", 4))
    y = g.add_input("y", "float32", ("batch", None))
    n = g.op("Mul", g.op("Shape", x), g.add_constant(np.array([1, 2]), "two"))
    n = g.op("Add", n, g.add_constant(np.array([0, 1]), "one"))   # int64 [2]: shape arithmetic
    r = g.op("Exp", g.op("Relu", y))                                 # an unknown dim
    clip_in = g.add_input("lo", "float32", ())
    c = g.op("Tanh", g.op("Clip", x, clip_in, None))                  # Clip with a non-constant bound
    g.outputs = [n, r, c]
    infer_shapes(g)
    assert fusion_groups(g) == []


def test_clip_with_constant_bounds_joins(check_pass):
    g = Graph("clip")
    x = g.add_input("x", "float32", ("batch", 4))
    lo = g.add_constant(np.array(-0.5, np.float32), "lo")
    g.outputs = [g.op("Tanh", g.op("Clip", x, lo, None))]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert body_ops(node) == ["Clip", "Tanh"] and list(node.inputs) == [x]


def test_mixed_dtypes_and_where(check_pass):
    g = Graph("mixed")
    x = g.add_input("x", "float32", ("batch", 4))
    y = g.add_input("y", "float32", ("batch", 4))
    mask = g.op("Greater", x, y)
    rounded = g.op("Cast", g.op("Cast", y, to=DType.INT32.value), to=DType.FLOAT32.value)
    picked = g.op("Where", mask, g.op("Exp", x), rounded)
    g.outputs = [picked, g.op("Not", mask)]
    check_pass(fuse, g, feeds_for(g))
    (node,) = g.nodes
    assert sorted(body_ops(node)) == sorted(["Greater", "Exp", "Cast", "Cast", "Where", "Not"])
    assert [v.type.dtype for v in node.outputs] == [DType.FLOAT32, DType.BOOL]


# --------------------------------------------------------------------------- naming, meta, runtime


def build_two_groups() -> Graph:
    g = Graph("named")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", RNG.standard_normal((4, 4)).astype(np.float32))
    a = g.op("Relu", g.op("Add", x, x))
    a.producer.meta["scope"] = "block.act"
    g.inputs[0].uses[0][0].meta.update({"scope": "block.add", "source": "model.py:3"})
    g.outputs = [g.op("Tanh", g.op("Neg", g.op("MatMul", a, w)))]
    infer_shapes(g)
    return g


def test_naming_is_deterministic_and_meta_is_kept():
    g1, g2 = build_two_groups(), build_two_groups()
    assert fuse_elementwise(g1) == fuse_elementwise(g2) == 2
    assert str(g1) == str(g2)
    first, second = fused_nodes(g1)
    assert (first.name, second.name) == ("fused", "fused_1")
    assert first.meta == {"scope": "block.add", "source": "model.py:3"}  # the first member's
    assert [n.meta.get("scope") for n in first.attrs["body"].nodes] == ["block.add", "block.act"]


def test_fused_graph_runs_in_the_runtime_with_symbolic_batch(tmp_path):
    g = build_two_groups()
    before = g.copy()
    fuse_elementwise(g)
    verify(g)
    for batch in (1, 4, 7):
        assert_runtime_matches(before, g, feeds_for(g, batch=batch, seed=batch), tmp_path)


def test_if_and_loop_bodies_are_fused(tmp_path):
    g = Graph("control")
    x = g.add_input("x", "float32", ("batch", 4))
    outer = g.op("Sigmoid", x)
    y = if_block(g, x, outer)       # then: Mul(Relu(x), outer)
    z = loop_block(g, y, 3)         # body: Add(Mul(acc, 0.5), y), then an If inside
    g.outputs = [z]
    infer_shapes(g)
    verify(g)
    before = g.copy()
    made = fuse_elementwise(g)
    verify(g)
    where = sorted(n.graph.name for n in fused_nodes(g))
    assert made == len(where) >= 3, where  # the If's then branch, the Loop body, the If in the Loop
    assert all(n.graph is not g for n in fused_nodes(g))
    # In the top If's then-branch the fused node reads the outer values x and Sigmoid(x) as inputs.
    (top_then,) = [n for n in fused_nodes(g) if n.graph.parent is g and body_ops(n) == ["Relu", "Mul"]]
    assert list(top_then.inputs) == [x, outer]
    for batch in (1, 3):
        feeds = feeds_for(g, batch, seed=batch)
        for w, o in zip(evaluate(before, feeds), evaluate(g, feeds)):
            np.testing.assert_allclose(o, w, rtol=1e-6)
        assert_runtime_matches(before, g, feeds, tmp_path)
    assert fuse_elementwise(g) == 0


# --------------------------------------------------------------------------- zoo models

torch = pytest.importorskip("torch")
import zoo  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402
from graph_feeds import feeds_for


class DecomposedBlock(torch.nn.Module):
    """LayerNorm and tanh-Gelu written out in elementwise ops, the way older exporters leave them."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.gamma = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.beta = torch.nn.Parameter(torch.rand(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        h = (x - mu) / torch.sqrt(var + 1e-5) * self.gamma + self.beta
        h = self.lin(h)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h * h * h)))


def _decomposed():
    torch.manual_seed(0)
    return DecomposedBlock().eval(), (torch.randn(2, 5, 16),), {"x": {0: "batch", 1: "seq"}}


# name -> (factory, the group kinds (member ops joined by '+') that must appear)
ZOO_CASES = {
    "resnet18": (zoo.resnet18, {"Add+Relu": 8}),
    "mobilenet_v3": (zoo.mobilenet_v3, {}),
    "transformer_encoder": (zoo.transformer_encoder, {"Add+Gelu": 2}),
    "gpt": (zoo.gpt, {"Add+Gelu": 2}),
    "decomposed": (_decomposed, None),
}


@pytest.mark.parametrize("name", list(ZOO_CASES))
def test_zoo_models_fuse_and_compute_the_same(name, tmp_path):
    factory, expected = ZOO_CASES[name]
    model, inputs, spec = factory()
    g = kiln.trace(model, inputs, dynamic=spec)
    before = g.copy()
    kinds = collections.Counter("+".join(n.op for n in m) for m in fusion_groups(g))
    made = fuse_elementwise(g)
    verify(g)
    assert made == sum(kinds.values()) == len(fused_nodes(g))
    if expected is not None:
        for kind, count in expected.items():
            assert kinds[kind] == count, kinds
    else:  # the decomposed block: the LayerNorm's and the Gelu's elementwise tails fuse
        assert max(len(body_ops(n)) for n in fused_nodes(g)) >= 7, kinds
        assert any("Tanh" in body_ops(n) for n in fused_nodes(g))
    assert fuse_elementwise(g) == 0
    for k, sizes in enumerate([{"batch": 1, "seq": 5}, {"batch": 3, "seq": 7}]):
        names, tensors = zoo.fresh_inputs(model, inputs, spec, sizes, seed=k)
        feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
        for w, o in zip(evaluate(before, feeds), evaluate(g, feeds)):
            np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)
        assert_runtime_matches(before, g, feeds, tmp_path, rtol=1e-4, atol=1e-5)


def test_fused_zoo_model_exports_to_onnx():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model

    model, inputs, spec = zoo.resnet18()
    g = kiln.trace(model, inputs, dynamic=spec)
    fuse_elementwise(g)
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    names, tensors = zoo.fresh_inputs(model, inputs, spec, {"batch": 2}, seed=5)
    feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, o in zip(evaluate(g, feeds), got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- random graphs

UNARY = ("Relu", "Neg", "Tanh", "Sigmoid", "Abs", "Exp")
BINARY = ("Add", "Sub", "Mul", "Max")


@st.composite
def random_graphs(draw):
    """Random DAGs over float32 values whose shapes broadcast into (batch, 8, 9): elementwise ops
    (the fusable part), MatMul and ReduceMean (non-members that make paths leave and re-enter
    candidate groups, and make smaller shapes), small constants and a large one (8 x 9 > 64)."""
    g = Graph("random")
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    pool = [g.add_input("x", "float32", ("batch", 8, 9)), g.add_input("y", "float32", (8, 9))]
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "const", "matmul", "reduce"]))
        a = pool[draw(st.integers(0, len(pool) - 1))]
        if kind == "unary":
            op = draw(st.sampled_from(UNARY))
            v = g.op(op, g.op("Tanh", a) if op == "Exp" else a)
        elif kind == "binary":
            b = pool[draw(st.integers(0, len(pool) - 1))]
            v = g.op(draw(st.sampled_from(BINARY)), a, b)
        elif kind == "const":
            shape = draw(st.sampled_from([(), (9,), (8, 1), (8, 9)]))
            c = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            v = g.op(draw(st.sampled_from(BINARY)), a, g.add_constant(c, "c"))
        elif kind == "matmul":
            k = a.type.shape[-1]
            v = g.op("MatMul", a, g.add_constant(rng.uniform(-0.5, 0.5, (k, 9)).astype(np.float32), "w"))
        else:
            v = g.op("ReduceMean", a, g.add_constant(np.array([-1]), "axes"), keepdims=1)
        pool.append(v)
    n_out = draw(st.integers(1, 3))
    g.outputs = list(dict.fromkeys(pool[-k] for k in range(1, min(n_out, len(pool) - 2) + 1)))
    infer_shapes(g)
    return g


@settings(max_examples=60, deadline=None)
@given(random_graphs(), st.integers(1, 3))
def test_random_graphs_fuse_correctly(g, min_ops):
    verify(g)
    before = g.copy()
    groups = fusion_groups(g, min_ops=min_ops)
    for m in groups:
        assert len(m) >= min_ops
        assert len({n.outputs[0].type.shape for n in m}) == 1
    # Every live group (read outside itself) is fused; fuse_elementwise may fuse more, in a second
    # round, when it had to dissolve a group on a cycle.
    live = [m for m in groups if any(v in g.outputs or any(u not in m for u in v.users) for n in m for v in n.outputs)]
    made = fuse_elementwise(g, min_ops=min_ops)
    assert made >= len(live)
    verify(g)
    assert [v.name for v in g.outputs] == [v.name for v in before.outputs]
    text = str(g)
    assert fuse_elementwise(g, min_ops=min_ops) == 0 and str(g) == text
    for batch in (1, 3):
        feeds = feeds_for(g, batch, seed=batch)
        want = evaluate(before, feeds)
        for w, o in zip(want, evaluate(g, feeds)):
            np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)
        for w, o in zip(want, kiln.runtime.Program(g).run(feeds, as_list=True)):
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)


def test_groups_that_would_reach_each_other_are_not_both_fused():
    # The case hypothesis found: relu = Relu(x) starts a group; MatMul(relu) feeds a second group
    # {Relu(x), Add(matmul, .), Relu(.)} whose output then feeds Add(relu, .), which would join
    # the first group: each group would read the other's output (a cycle).
    g = Graph("cycle")
    x = g.add_input("x", "float32", ("batch", 8, 9))
    relu = g.op("Relu", x)
    mm = g.op("MatMul", relu, g.add_initializer("w", np.full((9, 9), 0.1, np.float32)))
    r1 = g.op("Relu", x)
    side = g.op("Add", mm, r1)
    r6 = g.op("Relu", r1)
    g.outputs = [g.op("Add", relu, r6), side]
    infer_shapes(g)
    before = g.copy()
    groups = fusion_groups(g, min_ops=1)
    fuse_elementwise(g, min_ops=1)
    verify(g)
    assert fuse_elementwise(g, min_ops=1) == 0
    feeds = feeds_for(g, 2, seed=0)
    for w, o in zip(evaluate(before, feeds), evaluate(g, feeds)):
        np.testing.assert_allclose(o, w, rtol=1e-6)
    # The groups handed out are acyclic: no two of them each reach the other.
    member = {n: k for k, m in enumerate(groups) for n in m}
    assert len(member) == sum(len(m) for m in groups)
