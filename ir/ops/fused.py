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
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.errors import KilnError
from kiln.ir.evaluator import run_subgraph
from kiln.ir.graph import Graph
from kiln.ir.ops._common import ALL
from kiln.ir.registry import KILN_DOMAIN, Attr, AttrKind, In, InferContext, normalize_inferred, op
from kiln.ir.types import TensorType, dims_compatible

FUSED_OP = "FusedElementwise"


def body_output_types(body: Graph, input_types: list, fail) -> list:
    """The types of ``body``'s outputs when its inputs have ``input_types`` (None: use the type
    declared on the body input). ``fail(msg)`` raises; the body's recorded types are not changed."""
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
    return [types[v] for v in body.outputs]


def _infer_fused(ctx: InferContext) -> list:
    body: Graph = ctx.attrs["body"]
    if len(body.inputs) != len(ctx.inputs):
        ctx.fail(f"body '{body.name}' takes {len(body.inputs)} inputs, the node has {len(ctx.inputs)}")
    if len(body.outputs) != ctx.num_outputs:
        ctx.fail(f"body '{body.name}' returns {len(body.outputs)} values, the node has {ctx.num_outputs} outputs")
    return body_output_types(body, ctx.inputs, ctx.fail)


@op(FUSED_OP, domain=KILN_DOMAIN, inputs=[In("inputs", ALL, variadic=True, optional=True)],
    outputs=[In("outputs", ALL, variadic=True)], attrs=[Attr("body", AttrKind.GRAPH)], infer=_infer_fused)
def fused_elementwise(*inputs: Optional[np.ndarray], body: Graph, scope=None):
    """Evaluate the body on the inputs. The body is closed, so the enclosing scope is not passed."""
    return tuple(run_subgraph(body, list(inputs), {}))
