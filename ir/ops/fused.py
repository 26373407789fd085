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

``kiln.FusedAttention``: scaled dot-product attention, ``softmax(q @ kt * scale [+ mask]) @ v``,
made by ``fuse_attention``. Why a third op: a GPU backend runs it as one fused kernel that never
writes the [..., Lq, Lk] score matrix to memory (the scores of a row block live in registers and
shared memory, the softmax is computed online), which no elementwise/epilogue fusion can do: the
softmax is a reduction over the scores, and its output is the left operand of a second GEMM. The
kernel must find q, kt, v, the scale and the mask without searching the body, so the body has a
fixed layout, checked by :func:`attention_parts` on every inference (and so by ``verify``):

- ``body.inputs`` are ``[q, kt, v]`` or ``[q, kt, v, mask]``, ``node.inputs`` the outer values
  1:1 (kt is k already transposed: [..., D, Lk]);
- ``body.nodes`` are, in this order: ``MatMul(q, kt)``; optionally ``Mul(s, c)`` (either
  operand order) or ``Div(s, c)`` (only s / c), c a one-element float body initializer (the
  body's only one); ``Add(s, mask)`` (either operand order) exactly when there is a mask input;
  ``Softmax(s)`` over the last axis; optionally the *safe softmax* tail ``ReduceMax(s, last axis,
  keepdims)``, ``Equal(max, -inf)`` (either order), ``Where(equal, 0, p)`` (torch's
  ``_safe_softmax``, which the math attention of torch >= 2.5 uses: a row whose every score is
  masked out gives zeros instead of NaN), the ReduceMax reading the Softmax's input, -inf, 0 and a
  ReduceMax axes input one-element or last-axis body initializers; ``MatMul(p, v)``. Each
  intermediate is read only by the next node, once (the Softmax's input also by the ReduceMax);
  ``body.outputs`` is ``[the last MatMul's output]``;
- q [..., Lq, D], kt [..., D, Lk], v [..., Lk, Dv] have one rank r >= 3, one float dtype and
  the same batch dims ``[...]`` (no broadcasting among them); every value's shape is fully known
  (ints and symbols). The mask has their dtype and broadcasts into the scores' shape without
  growing it ([B, 1, 1, Lk], [Lq, Lk], ...); every intermediate has the scores' shape.

Otherwise it is a FusedElementwise too (the same evaluator, CPU kernel and ONNX expansion): the
CPU runs the body's ops as they are (Div as a division), while a GPU kernel multiplies the scores
by the ``scale`` that :func:`attention_parts` returns (1/c for a Div).
"""
from __future__ import annotations

from typing import Callable, NoReturn, Optional

import numpy as np

from kiln.errors import KilnError
from kiln.ir.dtypes import FLOAT_TYPES
from kiln.ir.evaluator import run_subgraph
from kiln.ir.graph import Graph
from kiln.ir.ops._common import ALL
from kiln.ir.registry import (KILN_DOMAIN, ONNX_DOMAIN, Attr, AttrKind, In, InferContext, normalize_inferred, op,
                               ops_with)
from kiln.ir.types import TensorType, dims_compatible

FUSED_OP = "FusedElementwise"
EPILOGUE_OP = "FusedEpilogue"
ATTENTION_OP = "FusedAttention"

# Elementwise ops of the default domain (declared with the "elementwise" trait on their @op): each output
# element depends only on the input elements at the same (broadcast) position. What fuse_elementwise groups
# and what an epilogue may hold.
ELEMENTWISE_OPS = ops_with("elementwise")

# Ops a FusedEpilogue is built around (the "anchor" trait): those whose GPU libraries apply an epilogue in the
# kernel.
ANCHOR_OPS = ops_with("anchor")


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


def attention_parts(body: Graph, types: Optional[dict] = None) -> dict:
    """``dict(scale=float, mask=bool)`` of a FusedAttention body: the factor the scores are
    multiplied by (c for ``Mul(s, c)``, 1/c for ``Div(s, c)``, 1.0 without either) and whether
    there is a mask input. Raises KilnError naming the layout rule (module docstring) the body
    breaks. Types are read from ``types`` (Value -> TensorType, as :func:`body_types` gives;
    default: the types recorded on the body's values)."""
    def broken(rule: str) -> NoReturn:
        raise KilnError(f"FusedAttention body '{body.name}': {rule}")

    if len(body.inputs) not in (3, 4) or len(set(body.inputs)) != len(body.inputs):
        broken(f"input rule: the body takes [q, kt, v] or [q, kt, v, mask], distinct values, "
               f"not {len(body.inputs)} inputs")
    q, kt, v = body.inputs[:3]
    mask = body.inputs[3] if len(body.inputs) == 4 else None
    nodes = list(body.nodes)
    for inner in nodes:
        if inner.domain != ONNX_DOMAIN or len(inner.outputs) != 1:
            broken(f"node rule: {inner.describe()} is not a default-domain op with one output")
    names = [n.op for n in nodes]
    tail = None  # the safe-softmax tail (ReduceMax, Equal, Where), if any
    if len(nodes) >= 6 and names[-5:] == ["Softmax", "ReduceMax", "Equal", "Where", "MatMul"]:
        tail = nodes[-4:-1]
        nodes = nodes[:-4] + nodes[-1:]
        names = [n.op for n in nodes]
    if len(nodes) < 3 or names[0] != "MatMul" or names[-2:] != ["Softmax", "MatMul"]:
        broken(f"node rule: the nodes must be MatMul, [Mul|Div], [Add], Softmax, [ReduceMax, Equal, Where], MatMul; "
               f"got {[n.op for n in body.nodes]}")
    first, softmax, last = nodes[0], nodes[-2], nodes[-1]
    middle = nodes[1:-2]
    scaler = middle[0] if middle and middle[0].op in ("Mul", "Div") else None
    adder = middle[-1] if middle and middle[-1].op == "Add" else None
    if len(middle) != (scaler is not None) + (adder is not None):
        broken(f"node rule: the nodes must be MatMul, [Mul|Div], [Add], Softmax, MatMul; got {names}")
    if (adder is not None) != (mask is not None):
        broken("mask rule: an Add(s, mask) needs a fourth body input (the mask), and a mask input needs the Add")
    if list(first.inputs) != [q, kt]:
        broken(f"input rule: the first node {first.describe()} must be MatMul(q, kt) of body inputs 0 and 1")
    if len(last.inputs) != 2 or last.inputs[1] is not v:
        broken(f"input rule: the last node {last.describe()} must read v (body input 2) as its second input")

    # The chain: each node reads the previous node's output once (at a fixed position for Div,
    # Softmax and the last MatMul) and nothing else reads it.
    chain = [first] + [n for n in (scaler, adder) if n is not None] + [softmax] + ([tail[2]] if tail else []) + [last]
    constants = set()
    if tail is not None:
        constants |= _safe_tail(tail, softmax, broken)
    for prev, nxt in zip(chain, chain[1:]):
        s = prev.outputs[0]
        at = {"Mul": None, "Add": None, "Where": 2}.get(nxt.op, 0)
        positions = [i for i, x in enumerate(nxt.inputs) if x is s]
        if nxt.op == "Div" and positions == [1]:
            broken(f"scale rule: {nxt.describe()} must divide the scores by c (s / c), not c by the scores")
        arity = {"Softmax": 1, "Where": 3}.get(nxt.op, 2)
        if len(nxt.inputs) != arity or len(positions) != 1 or at not in (None, positions[0]):
            broken(f"chain rule: {nxt.describe()} must read '{s.name}' ({prev.describe()}'s output) once"
                   + ("" if at is None else f", as input {at}") + f" and {arity - 1} other value(s)")
        readers = [nxt] + ([tail[0]] if tail is not None and nxt is softmax else [])
        if sorted((id(u) for u, _ in s.uses)) != sorted(id(r) for r in readers) or any(s is o for o in body.outputs):
            broken(f"chain rule: '{s.name}' ({prev.describe()}'s output) must be read by "
                   f"{' and '.join(r.describe() for r in readers)} only")
    if len(body.outputs) != 1 or body.outputs[0] is not last.outputs[0]:
        broken("output rule: the body's only output is the last MatMul's output")
    if adder is not None and mask not in adder.inputs:
        broken(f"mask rule: {adder.describe()} must add the mask (body input 3) to the scores")
    scale = 1.0
    if scaler is not None:
        c = scaler.inputs[1] if scaler.inputs[0] is first.outputs[0] else scaler.inputs[0]
        if (c is None or body.initializers.get(c.name) is not c or c.const is None or c.const.size != 1
                or TensorType.of(c.const).dtype not in FLOAT_TYPES):
            broken(f"scale rule: the scale of {scaler.describe()} must be a one-element float body initializer")
        scale = float(c.const.reshape(()))
        if scaler.op == "Div":
            scale = 1.0 / scale if scale != 0.0 else float("inf")
        if not np.isfinite(scale):
            broken(f"scale rule: the scale of {scaler.describe()} gives the factor {scale}, not a finite number")
        constants.add(c)
    if set(body.initializers.values()) != constants:
        broken("scale rule: the body's only initializers are the scale constant c (none without a Mul/Div) and "
               "the safe-softmax tail's constants")
    for x, role in ((q, "q"), (kt, "kt"), (v, "v"), (mask, "mask")):
        if x is not None and {u for u, _ in x.uses if u.graph is body} != {
                {"q": first, "kt": first, "v": last, "mask": adder}[role]}:
            broken(f"input rule: body input '{x.name}' ({role}) is read by other nodes than its own")

    type_of = (lambda x: types.get(x)) if types is not None else (lambda x: x.type)
    values = [q, kt, v] + ([mask] if mask is not None else []) + [n.outputs[0] for n in chain]
    for x in values:
        t = type_of(x)
        if t is None or t.shape is None or any(d is None for d in t.shape):
            broken(f"shape rule: '{x.name}' has no fully known shape ({t})")
    tq, tk, tv = type_of(q), type_of(kt), type_of(v)
    r = len(tq.shape)
    if r < 3 or len(tk.shape) != r or len(tv.shape) != r:
        broken(f"shape rule: q, kt, v must have one rank >= 3, not {tq}, {tk}, {tv}")
    if tq.dtype not in FLOAT_TYPES or tk.dtype is not tq.dtype or tv.dtype is not tq.dtype:
        broken(f"dtype rule: q, kt, v must have one float dtype, not {tq.dtype}, {tk.dtype}, {tv.dtype}")
    if not tq.shape[:-2] == tk.shape[:-2] == tv.shape[:-2]:
        broken(f"shape rule: q, kt, v must have the same batch dims (no broadcasting), not {tq}, {tk}, {tv}")
    if tq.shape[-1] != tk.shape[-2] or tk.shape[-1] != tv.shape[-2]:
        broken(f"shape rule: q [..., Lq, D], kt [..., D, Lk], v [..., Lk, Dv] do not fit: {tq}, {tk}, {tv}")
    scores = tq.shape[:-1] + tk.shape[-1:]
    for n in chain[:-1]:
        t = type_of(n.outputs[0])
        if t.shape != scores or t.dtype is not tq.dtype:
            broken(f"shape rule: {n.describe()} gives {t}, not the scores' type {tq.dtype}{list(scores)}")
    if mask is not None and (type_of(mask).dtype is not tq.dtype or len(type_of(mask).shape) > r):
        broken(f"mask rule: the mask must be {tq.dtype} of rank <= {r}, not {type_of(mask)}")
    axis = softmax.schema.fill_attrs(softmax.attrs).get("axis", -1)
    if axis not in (-1, r - 1):
        broken(f"softmax rule: {softmax.describe()} must normalize over the last axis (-1 or {r - 1}), not {axis}")
    if tail is not None:
        for n in tail:
            t = type_of(n.outputs[0])
            if t is None or t.shape is None or len(t.shape) != r or t.shape[:-1] != scores[:-1]:
                broken(f"safe-softmax rule: {n.describe()} gives {t}, not the scores' shape (or its rows)")
    return {"scale": scale, "mask": mask is not None, "safe": tail is not None}


def _safe_tail(tail: list, softmax, broken) -> set:
    """Check the safe-softmax tail ``ReduceMax(s), Equal(max, -inf), Where(equal, 0, p)`` of an attention
    body (``s`` the Softmax's input, ``p`` its output); returns the body constants it reads."""
    reducemax, equal, where = tail
    s, p = softmax.inputs[0], softmax.outputs[0]

    def const(v, want) -> bool:
        g = v.graph if v is not None else None
        return (v is not None and g is not None and g.initializers.get(v.name) is v and v.const is not None
                and v.const.size == 1 and (np.issubdtype(v.const.dtype, np.floating) or v.const.dtype.name == "bfloat16")
                and bool(want(v.const.astype(np.float32)).all()))

    used = set()
    if not reducemax.inputs or reducemax.inputs[0] is not s:
        broken(f"safe-softmax rule: {reducemax.describe()} must read the Softmax's input '{s.name}'")
    attrs = reducemax.schema.fill_attrs(reducemax.attrs)
    axes = attrs.get("axes")
    if len(reducemax.inputs) > 1 and reducemax.inputs[1] is not None:
        a = reducemax.inputs[1]
        if a.graph.initializers.get(a.name) is not a or a.const is None:
            broken(f"safe-softmax rule: {reducemax.describe()}'s axes must be a body initializer")
        axes = a.const.reshape(-1).tolist()
        used.add(a)
    rank = s.type.rank if s.type is not None else None
    if axes is None or len(axes) != 1 or axes[0] not in (-1, None if rank is None else rank - 1) \
            or not attrs.get("keepdims", 1):
        broken(f"safe-softmax rule: {reducemax.describe()} must reduce the last axis only, keeping it")
    mx = reducemax.outputs[0]
    other = [x for x in equal.inputs if x is not mx]
    if len(equal.inputs) != 2 or len(other) != 1 or not const(other[0], np.isneginf):
        broken(f"safe-softmax rule: {equal.describe()} must compare the ReduceMax's output with a -inf constant")
    used.add(other[0])
    if [u for u, _ in mx.uses] != [equal] or [u for u, _ in equal.outputs[0].uses] != [where]:
        broken("safe-softmax rule: the ReduceMax's output is read by the Equal only, and the Equal's by the Where only")
    if len(where.inputs) != 3 or where.inputs[0] is not equal.outputs[0] or where.inputs[2] is not p \
            or not const(where.inputs[1], lambda c: c == 0):
        broken(f"safe-softmax rule: {where.describe()} must be Where(equal, 0, softmax)")
    used.add(where.inputs[1])
    return used


def _check_counts(ctx: InferContext, body: Graph) -> None:
    if len(body.inputs) != len(ctx.inputs):
        ctx.fail(f"body '{body.name}' takes {len(body.inputs)} inputs, the node has {len(ctx.inputs)}")
    if len(body.outputs) != ctx.num_outputs:
        ctx.fail(f"body '{body.name}' returns {len(body.outputs)} values, the node has {ctx.num_outputs} outputs")


def _infer_fused(ctx: InferContext) -> list:
    body: Graph = ctx.attrs["body"]
    _check_counts(ctx, body)
    return body_output_types(body, ctx.inputs, ctx.fail)


def _infer_with_layout(parts) -> Callable:
    """FusedElementwise's inference, with the body's layout checked by ``parts(body, types)`` (in
    the substituted types): FusedEpilogue's and FusedAttention's."""
    def infer(ctx: InferContext) -> list:
        body: Graph = ctx.attrs["body"]
        _check_counts(ctx, body)
        types = body_types(body, ctx.inputs, ctx.fail)
        try:
            parts(body, types)
        except KilnError as e:
            ctx.fail(str(e))
        return [types[v] for v in body.outputs]
    return infer


_infer_epilogue = _infer_with_layout(epilogue_parts)
_infer_attention = _infer_with_layout(attention_parts)


_SIGNATURE = dict(domain=KILN_DOMAIN, inputs=[In("inputs", ALL, variadic=True, optional=True)],
                  outputs=[In("outputs", ALL, variadic=True)], attrs=[Attr("body", AttrKind.GRAPH)])


@op(FUSED_OP, infer=_infer_fused, **_SIGNATURE)
def fused_elementwise(*inputs: Optional[np.ndarray], body: Graph, scope=None):
    """Evaluate the body on the inputs. The body is closed, so the enclosing scope is not passed."""
    return tuple(run_subgraph(body, list(inputs), {}))


# The same evaluator: the anchor is an ordinary op of the body.
op(EPILOGUE_OP, infer=_infer_epilogue, **_SIGNATURE)(fused_elementwise)
op(ATTENTION_OP, infer=_infer_attention, **_SIGNATURE)(fused_elementwise)
