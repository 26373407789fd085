"""Passes inside and across If/Loop bodies: inlining an If whose condition folds to a constant,
DCE of unused If outputs and Loop-carried/scan values, constant folding inside bodies.

Every graph is checked with ``check_pass`` (same signature, same outputs under the reference
evaluator before and after, idempotent), plus the structural effect the pass is for."""
from __future__ import annotations

import numpy as np
import torch

import kiln
from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import dce, fold_constants, infer_shapes, inline_constant_branches, optimize
from kiln.ir.types import TensorType
from sample_graphs import if_block, loop_block


def ops(g: Graph) -> list:
    return [n.op for n in g.walk()]


def shape_cond_if(width: int) -> Graph:
    """If(x.shape[1] > 4) then Relu(x) * 2 else Neg(x) + outer, on x of static shape (2, width):
    the condition is a constant only once Shape/Gather/Greater are folded."""
    g = Graph("shape_if")
    x = g.add_input("x", "float32", (2, width))
    outer = g.op("Exp", x)
    dim = g.op("Gather", g.op("Shape", x), g.add_constant(np.array(1, np.int64), "one"), axis=0)
    cond = g.op("Greater", dim, g.add_constant(np.array(4, np.int64), "four"))
    then_b = g.subgraph("then")
    then_b.outputs = [then_b.op("Mul", then_b.op("Relu", x), then_b.add_constant(np.float32(2), "two"))]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Add", else_b.op("Neg", x), outer)]
    node = g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}, num_outputs=1)
    infer_shapes(g)
    g.outputs = [g.op("Sigmoid", node.output)]
    return g


def test_if_on_folded_shape_condition_is_inlined(check_pass):
    for width, taken in ((6, "Relu"), (3, "Neg")):
        g = shape_cond_if(width)
        feeds = {"x": np.random.default_rng(width).standard_normal((2, width)).astype(np.float32)}
        check_pass(fold_constants, g, feeds)
        check_pass(inline_constant_branches, g, feeds)
        assert "If" not in ops(g) and taken in ops(g)
        assert all(n.graph is g for n in g.nodes) and all(v.graph is g for v in g.initializers.values())


def test_pipeline_inlines_and_drops_the_untaken_branch(same_outputs):
    g = shape_cond_if(6)
    before = g.copy()
    optimize(g)
    verify(g)
    assert sorted(ops(g)) == ["Mul", "Relu", "Sigmoid"]  # Exp fed only the else branch
    same_outputs(before, g, {"x": np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)})


def test_inlined_branch_output_that_is_a_graph_output_keeps_its_name(check_pass):
    # The branch returns an outer value (the graph input) as the graph's output.
    g = Graph("passthrough")
    x = g.add_input("x", "float32", (3,))
    then_b = g.subgraph("then")
    then_b.outputs = [x]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Neg", x)]
    node = g.add_node("If", [g.add_constant(np.array(True), "yes")], {"then_branch": then_b, "else_branch": else_b},
                      num_outputs=1, output_names=["y"])
    g.outputs = [node.output]
    check_pass(inline_constant_branches, g, {"x": np.arange(3, dtype=np.float32)})
    assert ops(g) == ["Identity"] and g.outputs[0].name == "y"


def test_nested_constant_ifs_inside_a_loop_body_are_inlined(check_pass):
    g = Graph("nested")
    x = g.add_input("x", "float32", (2, 3))
    out = loop_block(g, x, 3)
    body = out.producer.attrs["body"]
    inner_if = next(n for n in body.nodes if n.op == "If")
    # Make the body's If condition a constant (an outer initializer): it reads outer values too.
    inner_if.set_input(0, g.add_constant(np.array(False), "no"))
    g.outputs = [out]
    infer_shapes(g)
    check_pass(inline_constant_branches, g, {"x": np.ones((2, 3), np.float32)})
    assert ops(g).count("If") == 0 and "Neg" in [n.op for n in body.nodes]


def test_unused_if_outputs_are_removed_from_node_and_branches(check_pass):
    g = Graph("two_outputs")
    x = g.add_input("x", "float32", ("n",))
    cond = g.op("Greater", g.op("ReduceSum", x, keepdims=0), g.add_constant(np.float32(0), "zero"))
    then_b = g.subgraph("then")
    then_b.outputs = [then_b.op("Relu", x), then_b.op("Exp", x)]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Neg", x), else_b.op("Tanh", x)]
    node = g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}, num_outputs=2)
    g.outputs = [node.outputs[1]]
    infer_shapes(g)
    for sign in (1, -1):
        feeds = {"x": sign * np.arange(1, 4, dtype=np.float32)}
        np.testing.assert_allclose(evaluate(g, feeds)[0], np.exp(feeds["x"]) if sign > 0 else np.tanh(feeds["x"]),
                                   rtol=1e-6)
    check_pass(dce, g, {"x": np.arange(-2, 2, dtype=np.float32)})
    assert len(node.outputs) == 1 and node.outputs[0].index == 0
    assert [n.op for n in then_b.nodes] == ["Exp"] and [n.op for n in else_b.nodes] == ["Tanh"]


def counting_loop() -> tuple[Graph, Graph]:
    """Loop(M) carrying acc (its final value used), cnt (unused after the loop, but read by its
    own update) and junk (unused after, its body input unread), with two scans, one unused."""
    g = Graph("loop")
    x = g.add_input("x", "float32", (3,))
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    c = body.add_input("c", "bool", ())
    acc = body.add_input("acc", "float32", (3,))
    cnt = body.add_input("cnt", "int64", ())
    body.add_input("junk", "float32", (3,))
    new_acc = body.op("Add", acc, x)
    new_cnt = body.op("Add", cnt, body.add_constant(np.array(1, np.int64), "one"))
    new_junk = body.op("Mul", x, x)
    body.outputs = [body.op("Identity", c), new_acc, new_cnt, new_junk, body.op("Sin", new_acc), body.op("Cos", x)]
    m = g.add_constant(np.array(4, np.int64), "m")
    init_cnt = g.add_constant(np.array(0, np.int64), "cnt0")
    node = g.add_node("Loop", [m, None, x, init_cnt, g.op("Neg", x)], {"body": body}, num_outputs=5)
    g.outputs = [node.outputs[0], node.outputs[3]]  # acc and the Sin scan
    infer_shapes(g)
    return g, body


def test_unread_loop_carried_values_and_unused_scans_are_removed(check_pass):
    g, body = counting_loop()
    check_pass(dce, g, {"x": np.array([1, -2, 3], np.float32)})
    loop = next(n for n in g.nodes if n.op == "Loop")
    # junk (unread in the body) and the Cos scan go; cnt is read by its own update and stays.
    assert [v.name for v in body.inputs] == ["i", "c", "acc", "cnt"]
    assert len(loop.inputs) == 4 and len(loop.outputs) == 3 and len(body.outputs) == 4
    assert "Mul" not in ops(g) and "Cos" not in ops(g) and "Neg" not in [n.op for n in g.nodes]


def test_carried_value_read_by_the_body_stays_even_when_unused_after(check_pass):
    g = Graph("feeds_acc")
    x = g.add_input("x", "float32", (3,))
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    c = body.add_input("c", "bool", ())
    acc = body.add_input("acc", "float32", (3,))
    scale = body.add_input("scale", "float32", (3,))
    body.outputs = [body.op("Identity", c), body.op("Add", acc, scale), body.op("Mul", scale, x)]
    node = g.add_node("Loop", [g.add_constant(np.array(3, np.int64), "m"), None, x, x], {"body": body}, num_outputs=2)
    g.outputs = [node.outputs[0]]  # scale's final value is unused, but acc reads scale every step
    infer_shapes(g)
    check_pass(dce, g, {"x": np.array([1, 2, 3], np.float32)}, changes=False)
    assert len(node.outputs) == 2


def test_constant_subexpressions_inside_bodies_fold(check_pass):
    g = Graph("fold_in_body")
    x = g.add_input("x", "float32", (2,))
    k = g.add_constant(np.array([1.0, 2.0], np.float32), "k")
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    c = body.add_input("c", "bool", ())
    acc = body.add_input("acc", "float32", (2,))
    folded = body.op("Exp", body.op("Mul", k, body.add_constant(np.float32(0.5), "half")))  # outer + body constants
    body.outputs = [body.op("Identity", c), body.op("Add", acc, folded)]
    node = g.add_node("Loop", [g.add_constant(np.array(2, np.int64), "m"), None, x], {"body": body}, num_outputs=1)
    g.outputs = [node.output]
    infer_shapes(g)
    check_pass(fold_constants, g, {"x": np.zeros(2, np.float32)})
    dce(g)
    assert [n.op for n in body.nodes] == ["Identity", "Add"]


def test_if_block_from_sample_graphs_is_inlined_after_its_condition_is_made_constant(check_pass):
    g = Graph("sample")
    x = g.add_input("x", "float32", (4,))
    out = if_block(g, x, g.add_constant(np.float32(3), "three"))
    out.producer.set_input(0, g.add_constant(np.array(True), "t"))
    g.outputs = [out]
    infer_shapes(g)
    check_pass(inline_constant_branches, g, {"x": np.array([-1, 0, 1, 2], np.float32)})
    assert "If" not in ops(g)


def test_scripted_size_branch_is_inlined_once_the_graph_is_specialized_to_a_static_shape():
    """kiln.script on a dynamic dim records ``if x.size(1) > 4`` as an If on Shape(x); giving
    the input a static shape (specializing the graph) lets folding resolve the condition, and
    the optimizer then inlines the taken branch."""
    class M(torch.nn.Module):
        def forward(self, x):
            if x.size(1) > 4:
                y = x * 2
            else:
                y = x - 1
            return y

    g = kiln.script(M(), (torch.randn(2, 6),), dynamic={"x": {1: "seq"}})
    assert "If" in ops(g)
    for width, taken in ((3, "Sub"), (6, "Mul")):
        spec = g.copy()
        spec.inputs[0].type = TensorType(spec.inputs[0].type.dtype, (2, width))
        optimize(spec)
        verify(spec)
        assert "If" not in ops(spec) and taken in ops(spec)
        x = torch.randn(2, width)
        np.testing.assert_allclose(evaluate(spec, [x.numpy()])[0], M()(x).numpy(), rtol=1e-6)
