"""If and Loop on real graphs with subgraph bodies: inference, verify and evaluation against
plain Python loops and closed forms."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.evaluator import EvaluationError
from kiln.ir.passes import infer_shapes


def checked(g: Graph) -> Graph:
    """Infer and verify (the checkpoint every test graph must pass)."""
    infer_shapes(g)
    verify(g)
    return g


def scalar(g: Graph, name: str, value, dtype) -> object:
    return g.add_initializer(name, np.array(value, dtype))


def loop_body(g: Graph, name: str, carried: dict) -> tuple:
    """A Loop body with inputs (iteration_num, cond, carried...); returns (body, i, cond, values)."""
    body = g.subgraph(name)
    i = body.add_input(f"{name}_i", "int64", [])
    cond = body.add_input(f"{name}_cond", "bool", [])
    values = [body.add_input(f"{name}_{k}", dt, shape) for k, (dt, shape) in carried.items()]
    return body, i, cond, values


# --------------------------------------------------------------------------- If


def build_if(then_else_shapes: bool = True) -> Graph:
    """out = x * 2 if c else x - 1 (both branches read the outer x)."""
    g = Graph("if_graph")
    c = g.add_input("c", "bool", [])
    x = g.add_input("x", "float32", ["batch", 4])
    then_g = g.subgraph("then")
    then_g.outputs = [then_g.op("Mul", x, scalar(then_g, "two", 2, np.float32))]
    else_g = g.subgraph("else")
    else_g.outputs = [else_g.op("Sub", x, scalar(else_g, "one", 1, np.float32))]
    g.outputs = [g.op("If", c, then_branch=then_g, else_branch=else_g)]
    return checked(g)


@pytest.mark.parametrize("cond", [True, False, np.array([True]), np.array([False])])
def test_if_runs_the_chosen_branch(cond):
    g = build_if()
    assert g.outputs[0].type.shape == ("batch", 4)
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    c = np.asarray(cond)
    if c.ndim:
        g.inputs[0].type = g.inputs[0].type.with_shape([1])
    want = x * 2 if c.item() else x - 1
    np.testing.assert_allclose(evaluate(g, [c, x])[0], want)


def test_if_merges_branch_types():
    g = Graph("merge")
    c = g.add_input("c", "bool", [])
    x = g.add_input("x", "float32", ["batch", 4])
    then_g = g.subgraph("then")
    then_g.outputs = [x, x]
    else_g = g.subgraph("else")
    wide = else_g.op("Concat", x, x, axis=1)
    lifted = else_g.op("Unsqueeze", x, else_g.add_initializer("ax", np.array([0], np.int64)))
    else_g.outputs = [wide, lifted]
    outs = g.op("If", c, then_branch=then_g, else_branch=else_g, outputs=2)
    g.outputs = list(outs)
    checked(g)
    assert [v.type.shape for v in g.outputs] == [("batch", None), None]
    x_val = np.ones((2, 4), np.float32)
    assert [o.shape for o in evaluate(g, [np.array(False), x_val])] == [(2, 8), (1, 2, 4)]
    assert [o.shape for o in evaluate(g, [np.array(True), x_val])] == [(2, 4), (2, 4)]


def test_if_inference_errors():
    g = Graph("bad")
    c = g.add_input("c", "bool", [])
    x = g.add_input("x", "float32", [2])
    then_g = g.subgraph("then")
    then_g.outputs = [x]
    else_g = g.subgraph("else")
    else_g.outputs = [else_g.add_initializer("k", np.zeros(2, np.int64))]
    with pytest.raises(ShapeInferenceError, match=r"node 'if' \(If\).*float32 on one path and int64"):
        g.op("If", c, then_branch=then_g, else_branch=else_g)
    then2 = g.subgraph("then2")
    then2.outputs = [x, x]
    with pytest.raises(ShapeInferenceError, match="returns 2 values, the node has 1"):
        g.op("If", c, then_branch=then2, else_branch=else_g)
    cond_vec = g.add_input("cv", "bool", [3])
    with pytest.raises(ShapeInferenceError, match="cond must be a scalar"):
        g.op("If", cond_vec, then_branch=then_g, else_branch=then_g)


# --------------------------------------------------------------------------- Loop


def build_for_loop(m: int) -> Graph:
    """acc += w (w read from the outer graph) and total += i, M times; scans every acc."""
    g = Graph("for_loop")
    acc0 = g.add_input("acc0", "float32", [3])
    w = g.add_input("w", "float32", [3])
    body, i, cond, (acc, total) = loop_body(g, "body", {"acc": ("float32", [3]), "total": ("int64", [])})
    acc_new = body.op("Add", acc, w)
    body.outputs = [cond, acc_new, body.op("Add", total, i), acc_new]
    outs = g.op("Loop", scalar(g, "m", m, np.int64), scalar(g, "true", True, np.bool_), acc0,
                scalar(g, "total0", 0, np.int64), body=body, outputs=3)
    g.outputs = list(outs)
    return checked(g)


@pytest.mark.parametrize("m", [0, 1, 5])
def test_for_loop_reads_outer_value(m):
    g = build_for_loop(m)
    assert [v.type.shape for v in g.outputs] == [(3,), (), (m, 3)]
    acc0 = np.array([1, -1, 0.5], np.float32)
    w = np.array([0.25, 2, -1], np.float32)
    final, total, scans = evaluate(g, [acc0, w])
    steps = np.arange(1, m + 1, dtype=np.float32)[:, None]
    np.testing.assert_allclose(final, acc0 + m * w)
    assert total == m * (m - 1) // 2
    assert scans.shape == (m, 3) and scans.dtype == np.float32
    np.testing.assert_allclose(scans, acc0 + steps * w)


def test_while_loop_with_computed_cond():
    """x doubles while it stays below an outer limit (M omitted; cond from the body)."""
    g = Graph("while_loop")
    x0 = g.add_input("x0", "float32", [])
    limit = g.add_input("limit", "float32", [])
    body, _, _, (x,) = loop_body(g, "body", {"x": ("float32", [])})
    x_new = body.op("Mul", x, scalar(body, "two", 2, np.float32))
    body.outputs = [body.op("Less", x_new, limit), x_new, x_new]
    final, seen = g.op("Loop", None, g.op("Less", x0, limit), x0, body=body, outputs=2)
    g.outputs = [final, seen]
    checked(g)
    assert [v.type.shape for v in g.outputs] == [(), (None,)]
    for start, lim in [(1.0, 100.0), (3.0, 4.0), (5.0, 2.0)]:
        want = []
        v = start
        while v < lim:
            v *= 2
            want.append(v)
        out, scans = evaluate(g, [np.float32(start), np.float32(lim)])
        assert out == (want[-1] if want else start)
        np.testing.assert_array_equal(scans, np.array(want, np.float32))


def test_if_nested_in_loop():
    """acc = acc + 1 while i < 2, then acc * 2: an If inside the body reads body and outer values."""
    g = Graph("nested")
    acc0 = g.add_input("acc0", "float32", ["batch"])
    switch = g.add_input("switch", "int64", [])
    body, i, cond, (acc,) = loop_body(g, "body", {"acc": ("float32", ["batch"])})
    then_g = body.subgraph("then")
    then_g.outputs = [then_g.op("Add", acc, scalar(then_g, "one", 1, np.float32))]
    else_g = body.subgraph("else")
    else_g.outputs = [else_g.op("Mul", acc, scalar(else_g, "two", 2, np.float32))]
    picked = body.op("If", body.op("Less", i, switch), then_branch=then_g, else_branch=else_g)
    body.outputs = [cond, picked, body.op("Cast", i, to=1)]
    final, iters = g.op("Loop", scalar(g, "m", 4, np.int64), None, acc0, body=body, outputs=2)
    g.outputs = [final, iters]
    checked(g)
    assert [v.type.shape for v in g.outputs] == [("batch",), (4,)]
    acc_val = np.array([1.0, 0.0], np.float32)
    for sw in (0, 2, 9):
        want = acc_val.copy()
        for k in range(4):
            want = want + 1 if k < sw else want * 2
        out, it = evaluate(g, [acc_val, np.int64(sw)])
        np.testing.assert_allclose(out, want)
        np.testing.assert_array_equal(it, np.arange(4, dtype=np.float32))


def test_loop_growing_carried_value_and_symbolic_trip_count():
    """The carried value grows by concat (its dim becomes unknown); M = batch from Shape."""
    g = Graph("grow")
    x = g.add_input("x", "int64", ["batch", 2])
    m = g.op("Gather", g.op("Shape", x), scalar(g, "zero", 0, np.int64))
    body, i, cond, (seq,) = loop_body(g, "body", {"seq": ("int64", [None])})
    grown = body.op("Concat", seq, body.op("Unsqueeze", i, body.add_initializer("ax", np.array([0], np.int64))),
                    axis=0)
    body.outputs = [cond, grown, body.op("Gather", x, i)]
    final, rows = g.op("Loop", m, None, g.add_initializer("start", np.array([7], np.int64)), body=body, outputs=2)
    g.outputs = [final, rows]
    checked(g)
    assert [v.type.shape for v in g.outputs] == [(None,), ("batch", 2)]
    x_val = np.arange(6, dtype=np.int64).reshape(3, 2)
    out, r = evaluate(g, [x_val])
    np.testing.assert_array_equal(out, [7, 0, 1, 2])
    np.testing.assert_array_equal(r, x_val)


def test_loop_with_only_scan_outputs():
    g = Graph("scan_only")
    body, i, cond, _ = loop_body(g, "body", {})
    body.outputs = [cond, body.op("Identity", i)]
    g.outputs = [g.op("Loop", scalar(g, "m", 3, np.int64), None, body=body)]
    checked(g)
    assert g.outputs[0].type.shape == (3,)
    np.testing.assert_array_equal(evaluate(g, [])[0], [0, 1, 2])


def test_loop_inference_errors():
    g = Graph("bad_loop")
    x = g.add_input("x", "float32", [3])
    m = scalar(g, "m", 2, np.int64)
    body, _, cond, (v,) = loop_body(g, "body", {"v": ("float32", [3])})
    body.outputs = [cond, v]
    with pytest.raises(ShapeInferenceError, match=r"node 'loop' \(Loop\).*must take 2 \+ 2 inputs"):
        g.op("Loop", m, None, x, x, body=body, outputs=2)
    with pytest.raises(ShapeInferenceError, match="the node has 2 outputs"):
        g.op("Loop", m, None, x, body=body, outputs=2)
    body2, _, cond2, (k,) = loop_body(g, "body2", {"k": ("int64", [3])})
    body2.outputs = [cond2, k]
    with pytest.raises(ShapeInferenceError, match="starts as float32 but the body takes int64"):
        g.op("Loop", m, None, x, body=body2)


def test_loop_without_trip_count_or_cond_is_an_error():
    g = Graph("endless")
    body, _, cond, (v,) = loop_body(g, "body", {"v": ("float32", [])})
    body.outputs = [cond, v]
    x = g.add_input("x", "float32", [])
    g.outputs = [g.op("Loop", None, None, x, body=body)]
    checked(g)
    with pytest.raises(EvaluationError, match="never ends"):
        evaluate(g, [np.float32(1)])


def test_loop_ignores_body_cond_without_cond_input():
    """ONNX: with M given and no cond input, the body's cond output is ignored (a for loop)."""
    g = Graph("for_only")
    body, i, _, (v,) = loop_body(g, "body", {"v": ("int64", [])})
    body.outputs = [scalar(body, "stop", False, np.bool_), body.op("Add", v, i)]
    g.outputs = [g.op("Loop", scalar(g, "m", 4, np.int64), None, scalar(g, "v0", 0, np.int64), body=body)]
    checked(g)
    assert evaluate(g, [])[0] == 0 + 1 + 2 + 3
