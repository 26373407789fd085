"""If and Loop on the CUDA backend (issue 8): bodies run on the device, conditions and trip
counts are read on the host, and a plan whose control flow depends on data is not captured into
a CUDA graph (the signature runs eagerly and ``graph_failures`` says why).

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from sample_graphs import if_block, loop_block  # noqa: E402

RNG = np.random.default_rng(11)


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _if_loop_graph():
    """x -> If(sum(x) > 0: relu(x) * w else -x) -> Loop 3 times (acc * 0.5 + x, an If inside)."""
    g = Graph("control")
    x = g.add_input("x", "float32", ["batch", 8])
    w = g.add_initializer("w", _r(8))
    y = if_block(g, x, w)
    g.outputs = [loop_block(g, y, 3)]
    infer_shapes(g)
    return g


def _while_graph():
    """A data-dependent while: double x until its max exceeds 100 (cond computed in the body),
    with the running max as a scan output."""
    g = Graph("while")
    x = g.add_input("x", "float32", [4, 6])
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    body.add_input("c", "bool", ())
    acc = body.add_input("acc", "float32", [4, 6])
    doubled = body.op("Mul", acc, body.add_constant(np.array(2.0, np.float32)))
    top = body.op("ReduceMax", doubled, keepdims=0)
    go = body.op("Less", top, body.add_constant(np.array(100.0, np.float32)))
    body.outputs = [go, doubled, top]
    start = g.op("Less", g.op("ReduceMax", x, keepdims=0), g.add_constant(np.array(100.0, np.float32)))
    node = g.add_node("Loop", [None, start, x], {"body": body}, num_outputs=2)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    return g


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["then", "else"])
def test_if_and_loop_match_the_reference(graphs, sign):
    g = _if_loop_graph()
    p = CudaProgram(g.copy(), output="numpy", cuda_graphs=graphs)
    for batch in (3, 5):
        x = np.abs(_r(batch, 8)) * sign  # the sum's sign picks the branch
        got = p.run([x], as_list=True)[0]
        want = evaluate(g, [x])[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert p.fallback_ops == {}
    if graphs:  # the If's condition is read on the host: no capture, and the reason is kept
        assert p.captured_graphs() == 0 and len(p.graph_failures) == 2


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_data_dependent_while_with_scan_output(graphs):
    g = _while_graph()
    p = CudaProgram(g.copy(), output="numpy", cuda_graphs=graphs)
    for scale in (1.0, 0.01, 1000.0):  # several trips, many trips, none
        x = (np.abs(_r(4, 6)) + 0.1) * scale
        got = p.run([x], as_list=True)
        want = evaluate(g, [x])
        assert got[1].shape == want[1].shape  # the scan's trip count
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert p.fallback_ops == {}
