"""``kiln.FusedElementwise``: a group of elementwise ops that a backend runs as one kernel.

Why a kiln-domain op with a body graph rather than one op per pattern: the fusion pass
(kiln/ir/passes/fuse.py) groups whatever connected elementwise ops it finds, so the set of
patterns is open; a body graph says exactly what the group computes, in ops every backend and
the ONNX exporter already know. A GPU backend compiles the body into one kernel; the CPU
runtime runs it as a nested plan; the ONNX exporter inlines it.

The body is *closed*: its inputs correspond 1:1 to the node's inputs, its outputs 1:1 to the
node's outputs, and it reads nothing else but its own initializers (small constants the pass
pulled in). Unlike an If/Loop body it never reads values of enclosing graphs, so the node is a
pure function of its inputs, safe to move, copy or compile on its own (constant folding still
leaves it alone, like every op with a subgraph).

Inference re-infers the body with the node's input types substituted (symbolic dims included),
without touching the types recorded in the body, so the node's output types follow its inputs
the way the ops inside would.

``kiln.FusedEpilogue``: a Conv/Gemm/MatMul (the *anchor*) and the elementwise ops that consume
its output (bias add, activation, residual add), made by ``fuse_epilogues``. Why a second op
rather than a FusedElementwise with a MatMul inside: a GPU backend runs the two very differently
(a cuDNN/cuBLASLt call with its epilogue applied in the GEMM/convolution, or the anchor followed
by one generated elementwise kernel reading its output), and it must find the anchor and its
operands without searching the body. So the body has a fixed layout, checked by
:func:`epilogue_parts` on every inference (and so by ``kiln.ir.verify``):

- ``body.nodes[0]`` is the anchor: a default-domain op of ``ANCHOR_OPS`` with one output;
- ``body.inputs[:k]`` are the anchor's inputs in order (k = the number of anchor inputs, none
  omitted: a trailing omitted optional input is simply not there), read by no other body node;
  ``node.inputs[:k]`` are the outer values (weights stay outer constants, whatever their size);
- ``body.inputs[k:]`` are the epilogue's other external inputs (a residual, a large bias);
  small constants may be body initializers, as in FusedElementwise;
- every other body node is an elementwise op of ``ELEMENTWISE_OPS`` whose output has the
  anchor output's shape; the anchor's output is read by the epilogue only, never a body output.

Otherwise it is a FusedElementwise: closed, the same inference, the same evaluator, the same
CPU kernel (a nested plan) and ONNX expansion (the body inlined).
"""
from __future__ import annotations

from typing import NoReturn, Optional

import numpy as np

from kiln.errors import KilnError
from kiln.ir.evaluator import run_subgraph
from kiln.ir.graph import Graph
from kiln.ir.ops._common import ALL
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN, Attr, AttrKind, In, InferContext, normalize_inferred, op
from kiln.ir.types import TensorType, dims_compatible

FUSED_OP = "FusedElementwise"
EPILOGUE_OP = "FusedEpilogue"

# Elementwise ops of the default domain: each output element depends only on the input elements
# at the same (broadcast) position. What fuse_elementwise groups and what an epilogue may hold.
ELEMENTWISE_OPS = frozenset("""
Abs Add And Cast Ceil Clip Cos Div Elu Equal Erf Exp Floor Gelu Greater GreaterOrEqual HardSigmoid
HardSwish IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mul Neg Not Or Pow PRelu Reciprocal
Relu Selu Sigmoid Sign Sin Softplus Softsign Sqrt Sub Sum Tanh Where Xor
""".split())

# Ops a FusedEpilogue is built around: those whose GPU libraries apply an epilogue in the kernel.
ANCHOR_OPS = frozenset({"Conv", "Gemm", "MatMul"})


def body_output_types(body: Graph, input_types: list, fail) -> list:
    """The types of ``body``'s outputs when its inputs have ``input_types`` (None: use the type
    declared on the body input). ``fail(msg)`` raises; the body's recorded types are not changed."""
    types = body_types(body, input_types, fail)
    return [types[v] for v in body.outputs]


def body_types(body: Graph, input_types: list, fail) -> dict:
    """Like :func:`body_output_types`, but the type of every value of the body (Value -> type)."""
    types: dict = {}
    for i, v in enumerate(body.inputs):
        t = input_types[i] if i < len(input_types) else None
        declared = v.type
        if t is not None and declared is not None:
            if t.dtype is not declared.dtype:
                fail(f"input {i} is {t.dtype} but the body takes {declared.dtype} ('{v.name}')")
            if t.shape is not None and declared.shape is not None and (
                    len(t.shape) != len(declared.shape)
                    or not all(dims_compatible(a, b) for a, b in zip(t.shape, declared.shape))):
                fail(f"input {i} has shape {t} but the body takes {declared} ('{v.name}')")
        types[v] = t if t is not None else declared
    for v in body.initializers.values():
        types[v] = TensorType.of(v.const)
    for inner in body.nodes:
        if any(True for _ in inner.subgraphs()):
            fail(f"body node {inner.describe()} has a subgraph; a fused body holds plain ops only")
        for k, v in enumerate(inner.inputs):
            if v is not None and v not in types:
                fail(f"body node {inner.describe()} reads '{v.name}' (input {k}), which the body does not "
                     "define: a fused body reads only its inputs and initializers")
        schema = inner.schema
        ctx = InferContext(inner, schema, [None if v is None else types[v] for v in inner.inputs],
                           [None if v is None else v.const for v in inner.inputs])
        try:
            inferred = normalize_inferred(ctx, schema.infer(ctx))
        except (KilnError, ValueError, IndexError, TypeError, KeyError) as e:
            fail(f"in the body: {e}")
        for out, t in zip(inner.outputs, inferred):
            types[out] = t if t is not None else out.type
    for v in body.outputs:
        if v not in types:
            fail(f"body output '{v.name}' is not defined in the body")
    return types


def epilogue_parts(body: Graph, types: Optional[dict] = None) -> tuple:
    """``(anchor, k)`` of a FusedEpilogue body: its first node and the number of its inputs,
    which are ``body.inputs[:k]``. Raises KilnError naming the layout rule (module docstring) the
    body breaks. Shapes are compared in ``types`` (Value -> TensorType, as :func:`body_types`
    gives; default: the types recorded on the body's values)."""
    def broken(rule: str) -> NoReturn:
        raise KilnError(f"FusedEpilogue body '{body.name}': {rule}")

    if not body.nodes:
        broken("anchor rule: the body has no nodes, its first node must be the anchor")
    anchor = body.nodes[0]
    if anchor.domain != ONNX_DOMAIN or anchor.op not in ANCHOR_OPS or len(anchor.outputs) != 1:
        broken(f"anchor rule: the first node {anchor.describe()} must be one of {sorted(ANCHOR_OPS)} "
               "(default domain) with one output")
    k = len(anchor.inputs)
    if any(v is None for v in anchor.inputs):
        broken(f"anchor input rule: the anchor {anchor.describe()} has an omitted input; "
               "anchor inputs are never None")
    if len(body.inputs) < k or any(a is not b for a, b in zip(anchor.inputs, body.inputs)):
        broken(f"anchor input rule: the anchor {anchor.describe()} must read body inputs 0..{k - 1}, in order")
    own = set(body.inputs[:k])
    y = anchor.outputs[0]
    for inner in body.nodes[1:]:
        if inner.domain != ONNX_DOMAIN or inner.op not in ELEMENTWISE_OPS or len(inner.outputs) != 1:
            broken(f"epilogue rule: {inner.describe()} is not an elementwise op with one output")
        if own.intersection(inner.inputs):
            broken(f"anchor input rule: {inner.describe()} reads an anchor input; "
                   f"only the anchor reads body inputs 0..{k - 1}")
    if own.intersection(body.outputs):
        broken(f"anchor input rule: an anchor input (body inputs 0..{k - 1}) is a body output")
    if any(v is y for v in body.outputs):
        broken(f"anchor output rule: the anchor's output '{y.name}' is a body output")
    if not any(u.graph is body and u is not anchor for u in y.users):
        broken(f"anchor output rule: the anchor's output '{y.name}' is not read by the epilogue")
    type_of = (lambda v: types.get(v)) if types is not None else (lambda v: v.type)
    shape = None if type_of(y) is None else type_of(y).shape
    if shape is None:
        broken(f"shape rule: the anchor's output '{y.name}' has no known shape")
    for inner in body.nodes[1:]:
        t = type_of(inner.outputs[0])
        if t is None or t.shape != shape:
            broken(f"shape rule: {inner.describe()} gives {t}, not the anchor output's shape {list(shape)}")
    return anchor, k


def _check_counts(ctx: InferContext, body: Graph) -> None:
    if len(body.inputs) != len(ctx.inputs):
        ctx.fail(f"body '{body.name}' takes {len(body.inputs)} inputs, the node has {len(ctx.inputs)}")
    if len(body.outputs) != ctx.num_outputs:
        ctx.fail(f"body '{body.name}' returns {len(body.outputs)} values, the node has {ctx.num_outputs} outputs")


def _infer_fused(ctx: InferContext) -> list:
    body: Graph = ctx.attrs["body"]
    _check_counts(ctx, body)
    return body_output_types(body, ctx.inputs, ctx.fail)


def _infer_epilogue(ctx: InferContext) -> list:
    """FusedElementwise's inference, with the body's layout checked (in the substituted types)."""
    body: Graph = ctx.attrs["body"]
    _check_counts(ctx, body)
    types = body_types(body, ctx.inputs, ctx.fail)
    try:
        epilogue_parts(body, types)
    except KilnError as e:
        ctx.fail(str(e))
    return [types[v] for v in body.outputs]


_SIGNATURE = dict(domain=KILN_DOMAIN, inputs=[In("inputs", ALL, variadic=True, optional=True)],
                  outputs=[In("outputs", ALL, variadic=True)], attrs=[Attr("body", AttrKind.GRAPH)])


@op(FUSED_OP, infer=_infer_fused, **_SIGNATURE)
def fused_elementwise(*inputs: Optional[np.ndarray], body: Graph, scope=None):
    """Evaluate the body on the inputs. The body is closed, so the enclosing scope is not passed."""
    return tuple(run_subgraph(body, list(inputs), {}))


# The same evaluator: the anchor is an ordinary op of the body.
op(EPILOGUE_OP, infer=_infer_epilogue, **_SIGNATURE)(fused_elementwise)
