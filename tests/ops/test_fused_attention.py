"""kiln.FusedAttention: inference re-infers the closed body with the node's input types (symbols
included) and checks its attention layout (MatMul(q, kt), [Mul|Div by c], [Add mask], Softmax
over the last axis, MatMul(., v)); the reference evaluates the body and the CPU runtime agrees;
``attention_parts`` gives the scale a GPU kernel multiplies the scores by, and each broken layout
rule is named by it, by inference and by ``verify``."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import KilnError, ShapeInferenceError, VerifyError
from kiln.ir import Graph, evaluate, verify
from kiln.ir.ops.fused import attention_parts
from kiln.ir.passes import infer_shapes
from kiln.ir.types import TensorType
from op_harness import check_backends

RNG = np.random.default_rng(0)
H, D, DV = 2, 4, 3


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attention(scale: str, mask: bool) -> Graph:
    """softmax(q @ kt [* c | / c] [+ mask]) @ v as one FusedAttention node: q [batch, H, seq, D],
    kt [batch, H, D, seq], v [batch, H, seq, DV], mask [batch, 1, 1, seq]; the body typed for
    batch 2 and seq 5, the node for symbols."""
    g = Graph(f"attention_{scale}_{mask}")
    shapes = {"q": ("batch", H, "seq", D), "kt": ("batch", H, D, "seq"), "v": ("batch", H, "seq", DV),
              "mask": ("batch", 1, 1, "seq")}
    names = ["q", "kt", "v"] + (["mask"] if mask else [])
    outer = [g.add_input(n, "float32", shapes[n]) for n in names]
    body = g.subgraph("attention_body")
    fixed = lambda s: tuple({"batch": 2, "seq": 5}.get(d, d) for d in s)  # noqa: E731
    bq, bk, bv, *bm = [body.add_input(f"b{n}", "float32", fixed(shapes[n])) for n in names]
    s = body.op("MatMul", bq, bk)
    if scale == "mul":
        s = body.op("Mul", body.add_constant(np.array(0.5, np.float32), "c"), s)  # either operand order
    elif scale == "div":
        s = body.op("Div", s, body.add_constant(np.array(2.0, np.float32), "c"))
    if mask:
        s = body.op("Add", s, bm[0])
    body.outputs = [body.op("MatMul", body.op("Softmax", s, axis=-1), bv)]
    node = g.add_node("FusedAttention", outer, {"body": body}, domain="kiln", num_outputs=1)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    verify(g)
    return g


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("scale", ["none", "mul", "div"])
def test_inference_reference_and_cpu_runtime(scale, mask):
    g = _attention(scale, mask)
    (out,) = g.outputs
    assert out.type == TensorType("float32", ("batch", H, "seq", DV))  # the node's types, not the body's
    body = g.nodes[0].attrs["body"]
    assert attention_parts(body) == {"scale": {"none": 1.0, "mul": 0.5, "div": 0.5}[scale], "mask": mask, "safe": False}
    for batch, seq in ((1, 3), (3, 7)):
        feeds = [RNG.standard_normal(shape).astype(np.float32)
                 for shape in ((batch, H, seq, D), (batch, H, D, seq), (batch, H, seq, DV), (batch, 1, 1, seq))]
        feeds = feeds[:4 if mask else 3]
        outs = evaluate(g, feeds)
        scores = feeds[0] @ feeds[1] * attention_parts(body)["scale"] + (feeds[3] if mask else 0)
        np.testing.assert_allclose(outs[0], softmax(scores) @ feeds[2], rtol=1e-5, atol=1e-6)
        check_backends(g, feeds, outs)


# --------------------------------------------------------------------------- rejected bodies


def hand_built(make_body, q=(2, 2, 5, 4), kt=(2, 2, 4, 5), v=(2, 2, 5, 3), mask=None, dtype="float32"):
    """A FusedAttention node over graph inputs of these shapes whose body outputs what
    ``make_body(body, bq, bk, bv[, bm])`` returns; outputs typed [2, 2, 5, 3] (so ``verify``
    re-runs inference on it)."""
    g = Graph("hand")
    shapes = [q, kt, v] + ([mask] if mask is not None else [])
    outer = [g.add_input(n, dtype, s) for n, s in zip(("q", "kt", "v", "mask"), shapes)]
    body = g.subgraph("attention_body")
    inner = [body.add_input(f"b{v.name}", dtype, v.type.shape) for v in outer]
    body.outputs = make_body(body, *inner)
    node = g.add_node("FusedAttention", outer, {"body": body}, domain="kiln", num_outputs=len(body.outputs),
                      output_types=[TensorType(dtype, (2, 2, 5, 3))] * len(body.outputs))
    g.outputs = list(node.outputs)
    return g, body


def _const(body, value=0.5, dtype=np.float32):
    return body.add_constant(np.array(value, dtype), "c")


def _extra_node(b, q, k, v):
    return [b.op("MatMul", b.op("Softmax", b.op("Relu", b.op("MatMul", q, k))), v)]


def _read_twice(b, q, k, v):
    s = b.op("MatMul", q, k)
    return [b.op("MatMul", b.op("Softmax", b.op("Mul", s, s)), v)]


def _scores_also_an_output(b, q, k, v):
    s = b.op("MatMul", q, k)
    return [b.op("MatMul", b.op("Softmax", s), v), s]


def _two_initializers(b, q, k, v):
    b.add_constant(np.ones(3, np.float32), "unused")
    return [b.op("MatMul", b.op("Softmax", b.op("MatMul", q, k)), v)]


def _plain(b, q, k, v, *, axis=-1):
    return [b.op("MatMul", b.op("Softmax", b.op("MatMul", q, k), axis=axis), v)]


# case -> (body builder, keyword arguments of hand_built, the rule the error must name)
BROKEN = {
    "three nodes of the wrong ops": (lambda b, q, k, v: [b.op("MatMul", b.op("Relu", b.op("MatMul", q, k)), v)], {},
                                     "node rule"),
    "an extra node": (_extra_node, {}, "node rule"),
    "scale after the mask": (lambda b, q, k, v, m: [b.op("MatMul", b.op("Softmax", b.op(
        "Mul", b.op("Add", b.op("MatMul", q, k), m), _const(b))), v)], {"mask": (2, 1, 1, 5)}, "node rule"),
    "q and kt swapped": (lambda b, q, k, v: [b.op("MatMul", b.op("Softmax", b.op("MatMul", k, q)), v)],
                         {"q": (2, 2, 4, 5), "kt": (2, 2, 5, 4)}, "input rule"),
    "v as the first operand": (lambda b, q, k, v: [b.op("MatMul", v, b.op("Softmax", b.op("MatMul", q, k)))],
                               {"v": (2, 2, 5, 5)}, "input rule"),
    "c / s": (lambda b, q, k, v: [b.op("MatMul", b.op("Softmax", b.op("Div", _const(b), b.op("MatMul", q, k))), v)],
              {}, "scale rule"),
    "a computed scale (a fourth input)": (lambda b, q, k, v, m: [b.op("MatMul", b.op("Softmax", b.op(
        "Mul", b.op("MatMul", q, k), m)), v)], {"mask": (1,)}, "mask rule"),
    "a scale of two elements": (lambda b, q, k, v: [b.op("MatMul", b.op("Softmax", b.op(
        "Mul", b.op("MatMul", q, k), b.add_constant(np.array([0.5, 0.5], np.float32), "c"))), v)],
        {"kt": (2, 2, 4, 2), "v": (2, 2, 2, 3)}, "scale rule"),
    "a zero divisor": (lambda b, q, k, v: [b.op("MatMul", b.op("Softmax", b.op("Div", b.op("MatMul", q, k),
                                                                              _const(b, 0.0))), v)], {}, "scale rule"),
    "an initializer besides the scale": (_two_initializers, {}, "scale rule"),
    "scores read twice": (_read_twice, {}, "chain rule"),
    "scores also a body output": (_scores_also_an_output, {}, "chain rule"),
    "the output twice": (lambda b, q, k, v: _plain(b, q, k, v) * 2, {}, "output rule"),
    "a mask input without the Add": (lambda b, q, k, v, m: _plain(b, q, k, v), {"mask": (2, 1, 1, 5)}, "mask rule"),
    "softmax over another axis": (lambda b, q, k, v: _plain(b, q, k, v, axis=2), {}, "softmax rule"),
    "rank 2": (_plain, {"q": (5, 4), "kt": (4, 5), "v": (5, 3)}, "shape rule"),
    "ranks differ": (_plain, {"v": (5, 3)}, "shape rule"),
    "broadcast batch dims": (_plain, {"kt": (1, 2, 4, 5)}, "shape rule"),
    "a mask growing the scores": (lambda b, q, k, v, m: [b.op("MatMul", b.op("Softmax", b.op(
        "Add", b.op("MatMul", q, k), m)), v)], {"mask": (3, 2, 2, 5, 5)}, "shape rule"),
    "an unknown dim": (_plain, {"q": (2, 2, None, 4)}, "shape rule"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_bodies_are_rejected_naming_the_rule(case):
    make_body, shapes, rule = BROKEN[case]
    g, body = hand_built(make_body, **shapes)
    with pytest.raises(KilnError, match=rule):
        attention_parts(body)
    with pytest.raises(VerifyError, match=rule):
        verify(g)


def test_inference_rejects_a_bad_body():
    g, _ = hand_built(lambda b, q, k, v: _plain(b, q, k, v, axis=-2))
    with pytest.raises(ShapeInferenceError, match="softmax rule"):
        infer_shapes(g)

