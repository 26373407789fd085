"""kiln.Assert (kiln/ir/ops/assertion.py): a run-time check with no outputs. Its reference and the
CPU runtime pass or fail on the condition's elements; the passes keep it (DCE, folding, CSE, the
whole pipeline, inside If bodies); .kiln files round-trip it; ONNX export drops it with a warning."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import kiln
from kiln.errors import ExecutionError, VerifyError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.ops.assertion import AssertionFailed
from kiln.ir.passes import infer_shapes, optimize
from kiln.ir.passes.cse import cse
from kiln.ir.passes.dce import dce
from kiln.ir.passes.fold_constants import fold_constants
from kiln.runtime import Program

ATTRS = {"message": "x must be positive", "location": "model.py:12: assert x.sum() > 0"}


def positive_check(shape=(2, 3)) -> Graph:
    """y = x * 2, with Assert(all(x > 0)) that nothing reads."""
    g = Graph("check")
    x = g.add_input("x", "float32", list(shape))
    zero = g.add_initializer("zero", np.zeros((), np.float32))
    two = g.add_initializer("two", np.full((), 2, np.float32))
    cond = g.add_node("Greater", [x, zero]).outputs[0]
    g.add_node("Assert", [cond], dict(ATTRS), domain="kiln", num_outputs=0)
    g.outputs = [g.add_node("Mul", [x, two]).outputs[0]]
    infer_shapes(g)
    verify(g)
    return g


def asserts(g: Graph) -> list:
    return [n for n in g.walk() if n.domain == "kiln" and n.op == "Assert"]


@pytest.mark.parametrize("cond", [np.array(True), np.ones((2, 3), bool), np.zeros((0, 4), bool)],
                         ids=["scalar", "matrix", "empty"])
def test_all_true_passes_in_reference_and_runtime(cond):
    g = Graph("one")
    c = g.add_input("c", "bool", list(cond.shape))
    node = g.add_node("Assert", [c], dict(ATTRS), domain="kiln", num_outputs=0)
    g.outputs = [c]
    infer_shapes(g)
    verify(g)
    assert node.outputs == []
    np.testing.assert_array_equal(evaluate(g, [cond])[0], cond)
    np.testing.assert_array_equal(Program(g).run([cond], as_list=True)[0], cond)


@pytest.mark.parametrize("cond", [np.array(False), np.array([[True, True], [True, False]])], ids=["scalar", "one"])
def test_any_false_element_fails_with_message_and_location(cond):
    g = Graph("one")
    c = g.add_input("c", "bool", list(cond.shape))
    g.add_node("Assert", [c], dict(ATTRS), domain="kiln", num_outputs=0)
    g.outputs = [c]
    infer_shapes(g)
    for run in (lambda: evaluate(g, [cond]), lambda: Program(g).run([cond])):
        with pytest.raises(AssertionFailed) as info:
            run()
        assert isinstance(info.value, ExecutionError) and isinstance(info.value, AssertionError)
        assert "x must be positive" in str(info.value) and "model.py:12: assert x.sum() > 0" in str(info.value)


def test_default_message():
    g = Graph("one")
    c = g.add_input("c", "bool", [])
    g.add_node("Assert", [c], {}, domain="kiln", num_outputs=0)
    g.outputs = [c]
    infer_shapes(g)
    with pytest.raises(AssertionFailed, match="assertion failed"):
        Program(g).run([np.array(False)])


def test_condition_must_be_bool():
    g = Graph("one")
    c = g.add_input("c", "float32", [])
    g.add_node("Assert", [c], {}, domain="kiln", num_outputs=0)
    g.outputs = [c]
    with pytest.raises(VerifyError):
        infer_shapes(g)
        verify(g)


def test_the_check_runs_before_later_nodes_and_stops_the_run():
    g = positive_check()
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(Program(g).run([x], as_list=True)[0], 2 * x)
    x[1, 2] = -1
    with pytest.raises(AssertionFailed, match="x must be positive"):
        Program(g).run([x])


def test_passes_keep_it():
    g = positive_check()
    assert not dce(g)
    assert not cse(g)
    assert len(asserts(g)) == 1
    # Two equal checks become one (the second can only fail where the first already has) ...
    cond = asserts(g)[0].inputs[0]
    g.add_node("Assert", [cond], dict(ATTRS), domain="kiln", num_outputs=0)
    assert cse(g)
    assert len(asserts(g)) == 1
    # ... but checks with different messages stay apart, through the whole pipeline.
    g.add_node("Assert", [cond], {**ATTRS, "message": "another"}, domain="kiln", num_outputs=0)
    optimize(g)
    assert len(asserts(g)) == 2
    with pytest.raises(AssertionFailed):
        Program(g).run([-np.ones((2, 3), np.float32)])


def test_a_constant_false_condition_is_not_folded_away():
    g = Graph("const")
    x = g.add_input("x", "float32", [2])
    no = g.add_initializer("no", np.array(False))
    g.add_node("Assert", [no], {"message": "never"}, domain="kiln", num_outputs=0)
    g.outputs = [g.add_node("Neg", [x]).outputs[0]]
    infer_shapes(g)
    fold_constants(g)
    dce(g)
    assert len(asserts(g)) == 1
    with pytest.raises(AssertionFailed, match="never"):
        kiln.load(g).run([np.ones(2, np.float32)])


def test_dce_keeps_an_if_whose_body_checks_even_when_its_outputs_are_unused():
    g = Graph("branchy")
    x = g.add_input("x", "float32", [3])
    flag = g.add_input("flag", "bool", [])
    then_b, else_b = g.subgraph("then"), g.subgraph("else")
    zero = then_b.add_initializer("zero", np.zeros((), np.float32))
    ok = then_b.add_node("Greater", [x, zero]).outputs[0]
    then_b.add_node("Assert", [ok], {"message": "then needs positive x"}, domain="kiln", num_outputs=0)
    then_b.outputs = [then_b.add_node("Neg", [x]).outputs[0]]
    else_b.outputs = [else_b.add_node("Identity", [x]).outputs[0]]
    g.add_node("If", [flag], {"then_branch": then_b, "else_branch": else_b})  # output unused
    g.outputs = [g.add_node("Abs", [x]).outputs[0]]
    infer_shapes(g)
    verify(g)
    optimize(g)
    assert len(asserts(g)) == 1
    p = kiln.load(g)
    neg = -np.ones(3, np.float32)
    np.testing.assert_array_equal(p.run([neg, np.array(False)], as_list=True)[0], -neg)
    with pytest.raises(AssertionFailed, match="then needs positive x"):
        p.run([neg, np.array(True)])


def test_kiln_file_round_trip(tmp_path):
    g = positive_check()
    path = tmp_path / "check.kiln"
    kiln.save(g, str(path))
    back = kiln.load_graph(str(path))
    (node,) = asserts(back)
    assert node.attrs["message"] == ATTRS["message"] and node.attrs["location"] == ATTRS["location"]
    assert node.outputs == []
    with pytest.raises(AssertionFailed, match="x must be positive"):
        kiln.load(str(path)).run([-np.ones((2, 3), np.float32)])


def test_onnx_export_drops_it_with_a_warning(tmp_path, caplog):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    g = positive_check()
    path = tmp_path / "check.onnx"
    with caplog.at_level(logging.WARNING, logger="kiln.serializer.onnx"):
        kiln.export_onnx(g, str(path))
    assert any("node 'assert'" in r.getMessage() and "x must be positive" in r.getMessage() for r in caplog.records)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert all(n.op_type != "Assert" for n in model.graph.node)
    x = -np.ones((2, 3), np.float32)  # the check is gone: no failure
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got, 2 * x)
