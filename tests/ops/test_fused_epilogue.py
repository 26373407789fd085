"""kiln.FusedEpilogue: inference re-infers the closed body with the node's input types (symbols
included) and checks the body's layout (anchor first, reading the first body inputs), the
reference evaluates the body and the CPU runtime agrees (Conv, Gemm and MatMul anchors)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import infer_shapes
from kiln.ir.types import TensorType
from op_harness import check_backends

RNG = np.random.default_rng(0)


def _epilogue(anchor: str) -> tuple:
    """relu(anchor(x, w[, b]) + r) as one FusedEpilogue, the body typed for batch 2, the node
    for a symbolic batch; returns (graph, feeds maker)."""
    g = Graph(f"epilogue_{anchor.lower()}")
    if anchor == "Conv":
        xs, ws, ys = ("batch", 3, 5, 5), (4, 3, 3, 3), ("batch", 4, 5, 5)
        attrs = {"pads": (1, 1, 1, 1)}
    else:
        xs, ws, ys = ("batch", 6), ((6, 4) if anchor == "MatMul" else (4, 6)), ("batch", 4)
        attrs = {} if anchor == "MatMul" else {"transB": 1}
    x = g.add_input("x", "float32", xs)
    w = g.add_initializer("w", RNG.standard_normal(ws).astype(np.float32))
    r = g.add_input("r", "float32", ys)
    body = g.subgraph("epilogue_body")
    fixed = lambda s: tuple(2 if d == "batch" else d for d in s)  # noqa: E731
    bx, bw = body.add_input("bx", "float32", fixed(xs)), body.add_input("bw", "float32", ws)
    br = body.add_input("br", "float32", fixed(ys))
    body.outputs = [body.op("Relu", body.op("Add", body.op(anchor, bx, bw, **attrs), br))]
    node = g.add_node("FusedEpilogue", [x, w, r], {"body": body}, domain="kiln", num_outputs=1)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    verify(g)
    return g, lambda batch: [RNG.standard_normal((batch,) + xs[1:]).astype(np.float32),
                             RNG.standard_normal((batch,) + ys[1:]).astype(np.float32)]


@pytest.mark.parametrize("anchor", ["Conv", "Gemm", "MatMul"])
def test_inference_reference_and_cpu_runtime(anchor):
    g, make = _epilogue(anchor)
    (out,) = g.outputs
    assert out.type.shape[0] == "batch"  # the node's types, not the body's (batch 2)
    for batch in (1, 3):
        feeds = make(batch)
        outs = evaluate(g, feeds)
        assert outs[0].shape[0] == batch and (outs[0] >= 0).all()
        check_backends(g, feeds, outs)


def test_a_body_whose_first_node_is_no_anchor_is_rejected():
    g = Graph("bad")
    x = g.add_input("x", "float32", (2, 3))
    body = g.subgraph("epilogue_body")
    body.outputs = [body.op("Relu", body.add_input("bx", "float32", (2, 3)))]
    node = g.add_node("FusedEpilogue", [x], {"body": body}, domain="kiln", num_outputs=1,
                      output_types=[TensorType("float32", (2, 3))])
    g.outputs = list(node.outputs)
    with pytest.raises(ShapeInferenceError, match="anchor rule"):
        infer_shapes(g)
