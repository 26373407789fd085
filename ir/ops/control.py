"""Control flow: If and Loop, whose bodies are subgraphs (ONNX opset 18 semantics).

Bodies may read values of enclosing graphs directly, so their references take the
evaluator's ``scope`` (which the evaluator passes to every op with a subgraph attribute) and
run a body with :func:`kiln.ir.evaluator.run_subgraph`. Both are registered not foldable: a
body's reads of outer values are not node inputs, so "all inputs constant" says nothing.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.evaluator import run_subgraph
from kiln.ir.graph import Graph
from kiln.ir.ops._common import ALL, BOOL
from kiln.ir.ops._dims import INT64, scalar_input
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType


def join_types(ctx: InferContext, a: Optional[TensorType], b: Optional[TensorType], what: str) -> Optional[TensorType]:
    """A type covering both ``a`` and ``b`` (dtypes must agree): equal dims are kept, others
    become unknown, and different ranks give an unknown shape."""
    if a is None or b is None:
        return None
    if a.dtype is not b.dtype:
        ctx.fail(f"{what} is {a.dtype} on one path and {b.dtype} on the other")
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return TensorType(a.dtype, None)
    return TensorType(a.dtype, [x if x == y else None for x, y in zip(a.shape, b.shape)])


def _as_bool(a: np.ndarray) -> bool:
    return bool(np.asarray(a).reshape(-1)[0])


# --------------------------------------------------------------------------- If


def _branch_outputs(ctx: InferContext, name: str) -> list:
    g: Graph = ctx.attrs[name]
    if g.inputs:
        ctx.fail(f"{name} '{g.name}' must take no inputs, it takes {len(g.inputs)}")
    if len(g.outputs) != ctx.num_outputs:
        ctx.fail(f"{name} '{g.name}' returns {len(g.outputs)} values, the node has {ctx.num_outputs} outputs")
    return [v.type for v in g.outputs]


def _infer_if(ctx: InferContext) -> list:
    scalar_input(ctx, 0, "cond")
    then_types = _branch_outputs(ctx, "then_branch")
    else_types = _branch_outputs(ctx, "else_branch")
    return [join_types(ctx, a, b, f"output {i}") for i, (a, b) in enumerate(zip(then_types, else_types))]


@op("If", inputs=[In("cond", BOOL, max_elements=1)], outputs=[In("outputs", ALL, variadic=True)],
    attrs=[Attr("then_branch", AttrKind.GRAPH), Attr("else_branch", AttrKind.GRAPH)], infer=_infer_if,
    foldable=False)
def if_(cond, *, then_branch, else_branch, scope=None):
    branch = then_branch if _as_bool(cond) else else_branch
    return tuple(run_subgraph(branch, [], scope or {}))


# --------------------------------------------------------------------------- Loop


def _check_body_signature(ctx: InferContext, body: Graph, n_carried: int) -> int:
    """Checks the body's inputs (iteration_num, cond, carried...) and outputs (cond,
    carried..., scans...); returns the number of scan outputs."""
    if len(body.inputs) != 2 + n_carried:
        ctx.fail(f"body '{body.name}' must take 2 + {n_carried} inputs (iteration_num, cond, carried values), "
                 f"it takes {len(body.inputs)}")
    n_scan = len(body.outputs) - 1 - n_carried
    if n_scan < 0:
        ctx.fail(f"body '{body.name}' must return cond and {n_carried} carried values, it returns {len(body.outputs)}")
    if n_carried + n_scan != ctx.num_outputs:
        ctx.fail(f"the node has {ctx.num_outputs} outputs, the body gives {n_carried} carried + {n_scan} scan values")
    for v, want in ((body.inputs[0], DType.INT64), (body.inputs[1], DType.BOOL), (body.outputs[0], DType.BOOL)):
        if v.type is not None and v.type.dtype is not want:
            ctx.fail(f"body value '{v.name}' must be {want}, is {v.type}")
    return n_scan


def _carried_type(ctx: InferContext, body: Graph, k: int) -> Optional[TensorType]:
    init = ctx.input(2 + k)
    declared = body.inputs[2 + k].type
    if declared is not None and declared.dtype is not init.dtype:
        ctx.fail(f"carried value {k} starts as {init.dtype} but the body takes {declared.dtype}")
    after = body.outputs[1 + k].type
    if after is None:
        return TensorType(init.dtype, None)
    return join_types(ctx, init, after, f"carried value {k}")


def _cond_stays_true(ctx: InferContext, body: Graph) -> bool:
    """Whether the loop runs all M iterations: no cond input, or a constant true cond that
    the body passes through unchanged (the for-loop pattern exporters write)."""
    if not ctx.has_input(1):
        return True
    cond = ctx.const(1)
    if cond is None or not _as_bool(cond):
        return False
    out = body.outputs[0]
    return out is body.inputs[1] or (out.const is not None and _as_bool(out.const))


def _trip_count(ctx: InferContext, body: Graph) -> Dim:
    trips = ctx.symbolic(0) if ctx.has_input(0) else None
    if trips is None or len(trips) != 1 or not _cond_stays_true(ctx, body):
        return None
    m = trips[0]
    return max(m, 0) if isinstance(m, int) else m


def _infer_loop(ctx: InferContext) -> list:
    body: Graph = ctx.attrs["body"]
    n_carried = max(len(ctx.inputs) - 2, 0)
    _check_body_signature(ctx, body, n_carried)
    if ctx.has_input(0):
        scalar_input(ctx, 0, "M")
    if ctx.has_input(1):
        scalar_input(ctx, 1, "cond")
    carried = [_carried_type(ctx, body, k) for k in range(n_carried)]
    trips = _trip_count(ctx, body)
    scans = []
    for v in body.outputs[1 + n_carried:]:
        t = v.type
        scans.append(None if t is None else TensorType(t.dtype, None if t.shape is None else (trips,) + t.shape))
    return carried + scans


def _stack(values: list, body_out) -> np.ndarray:
    """Scan outputs stacked on a new axis 0; after zero iterations, an empty tensor of the
    body output's type."""
    if values:
        return np.stack(values)
    t = body_out.type
    dtype = t.dtype.numpy if t is not None else np.float32
    shape = t.shape if t is not None and t.is_static else ()
    return np.zeros((0,) + tuple(shape), dtype=dtype)


@op("Loop", inputs=[In("M", INT64, optional=True, max_elements=1), In("cond", BOOL, optional=True, max_elements=1),
                    In("v_initial", ALL, variadic=True, optional=True)],
    outputs=[In("v_final_and_scan_outputs", ALL, variadic=True)], attrs=[Attr("body", AttrKind.GRAPH)],
    infer=_infer_loop, foldable=False)
def loop(m=None, cond=None, *v_initial, body, scope=None):
    if m is None and cond is None:
        raise ValueError("a Loop with neither a trip count M nor a cond input never ends")
    trips = None if m is None else int(np.asarray(m).reshape(-1)[0])
    keep_going = True if cond is None else _as_bool(cond)
    carried = list(v_initial)
    n = len(carried)
    scans: list[list] = [[] for _ in body.outputs[1 + n:]]
    i = 0
    while keep_going and (trips is None or i < trips):
        outs = run_subgraph(body, [np.array(i, np.int64), np.array(keep_going), *carried], scope or {})
        # Without a cond input ONNX ignores the body's cond output (a plain for loop).
        if cond is not None:
            keep_going = _as_bool(outs[0])
        carried = list(outs[1:1 + n])
        for k, s in enumerate(scans):
            s.append(outs[1 + n + k])
        i += 1
    return tuple(carried + [_stack(s, v) for s, v in zip(scans, body.outputs[1 + n:])])
