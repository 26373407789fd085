"""Algebraic simplification, written as data: a table of named rewrite rules.

Each :class:`Rule` names the ops it applies to and a small function ``rewrite(node, ed)`` that
tries to rewrite one such node through the :class:`Editor` ``ed``, returning whether it did
(in the spirit of tinygrad's PatternMatcher). The driver tries the rules on every node,
bodies of If/Loop included, until none applies.

A rule that makes a node's output equal to another value calls :func:`forward`: readers
read that value and the node goes. When the output is a graph output that cannot take the
value's place (the value is a graph input or an initializer), the node becomes an
``Identity`` instead, so the output keeps its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes._rewrite import Editor, redirect_uses
from kiln.ir.types import broadcast_shapes


@dataclass(frozen=True)
class Rule:
    name: str
    ops: frozenset
    rewrite: Callable[[Node, Editor], bool]


def forward(node: Node, value: Value, ed: Editor) -> bool:
    """Make every reader of the node's first output read ``value`` and remove the node (its
    other outputs must be unused). Returns whether the graph changed."""
    if ed.replace_node(node, [value] + [None] * (len(node.outputs) - 1)):
        return True
    # A graph output that may not be renamed away: it stays, as Identity(value), and only
    # graph outputs read it.
    changed = redirect_uses(node.outputs[0], value)
    if _is_onnx(node, "Identity"):
        return changed
    node.op = "Identity"
    node.domain = ""
    node.attrs = {}
    node.inputs = [value]
    del node.outputs[1:]
    return True


def _is_onnx(node: Optional[Node], op: str) -> bool:
    return node is not None and node.op == op and node.domain == ""


def _const(v: Optional[Value]) -> Optional[np.ndarray]:
    return None if v is None else v.const


# --------------------------------------------------------------------------- rules


def remove_identity(node: Node, ed: Editor) -> bool:
    return forward(node, node.inputs[0], ed)


def remove_inference_dropout(node: Node, ed: Editor) -> bool:
    """Dropout outside training is the identity on its first output."""
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is not None and (training.const is None or bool(training.const.reshape(-1)[0])):
        return False
    if not ed.only_first_output_used(node):
        return False
    return forward(node, node.inputs[0], ed)


# op -> (neutral element, input positions where it is neutral)
_NEUTRAL = {"Add": (0, (0, 1)), "Sub": (0, (1,)), "Mul": (1, (0, 1)), "Div": (1, (1,))}


def remove_neutral_element(node: Node, ed: Editor) -> bool:
    """x+0, 0+x, x-0, x*1, 1*x, x/1 -> x, unless broadcasting against the constant would
    change x's shape (x*ones(4,1) on x of shape [4] is a [4,4] tensor, not x)."""
    neutral, positions = _NEUTRAL[node.op]
    for pos in positions:
        c = _const(node.inputs[pos])
        x = node.inputs[1 - pos]
        if c is not None and np.all(c == neutral) and _broadcast_keeps(x, c):
            return forward(node, x, ed)
    return False


def _broadcast_keeps(x: Value, c: np.ndarray) -> bool:
    if x.type is None or x.type.shape is None or x.dtype.numpy != c.dtype:
        return False
    try:
        return broadcast_shapes(x.type.shape, c.shape) == x.type.shape
    except ValueError:
        return False


def remove_noop_reshape(node: Node, ed: Editor) -> bool:
    x, y = node.inputs[0], node.outputs[0]
    if x.shape is None or y.shape is None or None in x.shape or x.shape != y.shape:
        return False
    return forward(node, x, ed)


def merge_reshapes(node: Node, ed: Editor) -> bool:
    """Reshape(Reshape(x, s1), s2) -> Reshape(x, s2): the data order never changes. Not when
    s2 copies dims of its input (a 0 without allowzero): those are the inner result's dims."""
    inner = node.inputs[0].producer
    shape = _const(node.inputs[1])
    if not _is_onnx(inner, "Reshape") or shape is None:
        return False
    if node.attr("allowzero") == 0 and np.any(shape == 0):
        return False
    node.set_input(0, inner.inputs[0])
    return True


def merge_transposes(node: Node, ed: Editor) -> bool:
    """Transpose(Transpose(x, p1), p2) is Transpose(x, p1[p2]); the identity perm is x."""
    inner = node.inputs[0].producer
    if not _is_onnx(inner, "Transpose"):
        return False
    x = inner.inputs[0]
    p1 = _perm(inner, x.type.rank if x.type is not None else None)
    p2 = _perm(node, None if p1 is None else len(p1))
    if p1 is None or p2 is None:
        return False
    composed = tuple(p1[i] for i in p2)
    if composed == tuple(range(len(composed))):
        return forward(node, x, ed)
    node.attrs["perm"] = composed
    node.set_input(0, x)
    return True


def _perm(node: Node, rank: Optional[int]) -> Optional[tuple]:
    perm = node.attrs.get("perm")
    if perm is not None:
        return tuple(perm)
    # No perm reverses the axes, which needs the rank.
    return None if rank is None else tuple(reversed(range(rank)))


def remove_noop_cast(node: Node, ed: Editor) -> bool:
    x = node.inputs[0]
    if x.dtype is None or x.dtype.value != node.attr("to"):
        return False
    return forward(node, x, ed)


# Comparisons of a value with itself: their answer, for integer and bool values (a float NaN is
# not equal to itself).
_SELF_COMPARE = {"Equal": True, "LessOrEqual": True, "GreaterOrEqual": True, "Less": False, "Greater": False}


def compare_with_itself(node: Node, ed: Editor) -> bool:
    """``Equal(v, v)`` and its kin on an integer or bool ``v`` of static shape -> a constant. A
    trace leaves such comparisons where Python compared a symbolic size with itself (torch's
    RNN checks its hidden state's batch against the input's), and the guard on it then goes too."""
    a, b = node.inputs[0], node.inputs[1]
    t = node.outputs[0].type
    if a is not b or a.dtype is None or a.dtype.numpy.kind not in "iub" or t is None or t.shape is None or \
            not all(isinstance(d, int) for d in t.shape):
        return False
    value = node.graph.add_constant(np.full(tuple(t.shape), _SELF_COMPARE[node.op]), "compared")
    return forward(node, value, ed)


def decide_constant_check(node: Node, ed: Editor) -> bool:
    """A run-time check (kiln.Guard, kiln.Assert) of a constant is decided now: it passes on every
    run (the trace computed that constant and the check held then), so it goes. One that fails
    stays: every run of the graph will report it."""
    c = _const(node.inputs[0])
    if c is None:
        return False
    try:
        node.schema.reference(c, **node.schema.fill_attrs(node.attrs))
    except Exception:  # noqa: BLE001 - the check fails: leave it to fail every run
        return False
    ed.remove_node(node)
    return True


def gemm_between_flattens(node: Node, ed: Editor) -> bool:
    """``Reshape(Gemm(Reshape(x, [-1, K]), W, c), x.shape[:-1] + [N])`` -> ``MatMul(x, W) + c``
    (x's trailing dims may be several whose product is K: they are merged by a Reshape first).

    A linear layer written with ``addmm`` on flattened rows (transformers' GPT-2 ``Conv1D``, many
    hand-written MLPs) traces to a flatten, a 2-D Gemm and an unflatten. The unflatten hides the
    Gemm from the elementwise op after it (the residual add, the GELU), so no epilogue fusion
    took them: GPT-2 ran its 48 Gemms, their bias adds and 36 epilogues as separate kernels on the
    GPU. As a MatMul on the unflattened ``x`` plus a bias Add it is the graph a ``nn.Linear``
    gives, which every backend fuses. Sound because a Gemm computes each row on its own: the
    flatten keeps ``x``'s last dim (K) and the unflatten gives back ``x``'s leading dims, so row
    order is unchanged (the same for x's trailing dims merged into K). Only for alpha 1, no transposed A, a constant 2-D W and a constant (or
    absent) C of N elements; every dim involved known (ints or named symbols)."""
    gemm = node.inputs[0].producer
    if not _is_onnx(gemm, "Gemm") or gemm.attr("transA") or gemm.attr("alpha") != 1.0:
        return False
    g_out = gemm.outputs[0]
    if len(g_out.uses) != 1 or ed.is_output(g_out):
        return False
    flat = gemm.inputs[0].producer
    w = _const(gemm.inputs[1])
    if not _is_onnx(flat, "Reshape") or w is None or w.ndim != 2:
        return False
    x, y = flat.inputs[0], node.outputs[0]
    xs, fs, ys = x.shape, flat.outputs[0].shape, y.shape
    if xs is None or fs is None or ys is None or len(xs) < 2 or len(fs) != 2 or None in xs or None in ys:
        return False
    k, n = (w.shape[1], w.shape[0]) if gemm.attr("transB") else w.shape
    lead = len(ys) - 1
    if fs[-1] != k or ys[-1] != n or x.dtype != y.dtype or tuple(xs[:lead]) != tuple(ys[:lead]):
        return False
    tail = xs[lead:]  # x's dims that the flatten merges into one row (just K, or e.g. [heads, head_dim])
    if not tail or not all(isinstance(d, int) for d in tail) or int(np.prod(tail)) != k:
        return False
    c = None
    if len(gemm.inputs) > 2 and gemm.inputs[2] is not None:
        c = _const(gemm.inputs[2])
        if c is None or c.size != n or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
            return False
        beta = gemm.attr("beta")
        c = (c * c.dtype.type(beta) if beta != 1.0 else c).reshape(n)
    g = node.graph
    if len(tail) > 1:  # merge the tail into K first: Reshape(x, [0, .., 0, K]) (0 keeps a leading dim)
        target = g.add_constant(np.array([0] * lead + [k], np.int64), "shape")
        x = g.add_node("Reshape", [x, target], before=node, name="reshape", output_types=[y.type.with_shape(
            tuple(ys[:lead]) + (k,))], meta=flat.meta).outputs[0]
    wv = g.add_constant(np.ascontiguousarray(w.T), "weight_t") if gemm.attr("transB") else gemm.inputs[1]
    t = y.type
    out = g.add_node("MatMul", [x, wv], before=node, name="matmul", output_types=[t], meta=gemm.meta).outputs[0]
    if c is not None:
        cv = g.add_constant(c, "bias")
        out = g.add_node("Add", [out, cv], before=node, name="add", output_types=[t], meta=gemm.meta).outputs[0]
    return forward(node, out, ed)


RULES: tuple = (
    Rule("decide_constant_check", frozenset({"kiln.Guard", "kiln.Assert"}), decide_constant_check),
    Rule("compare_with_itself", frozenset(_SELF_COMPARE), compare_with_itself),
    Rule("remove_identity", frozenset({"Identity"}), remove_identity),
    Rule("remove_inference_dropout", frozenset({"Dropout"}), remove_inference_dropout),
    Rule("remove_neutral_element", frozenset(_NEUTRAL), remove_neutral_element),
    Rule("remove_noop_reshape", frozenset({"Reshape"}), remove_noop_reshape),
    Rule("merge_reshapes", frozenset({"Reshape"}), merge_reshapes),
    Rule("gemm_between_flattens", frozenset({"Reshape"}), gemm_between_flattens),
    Rule("merge_transposes", frozenset({"Transpose"}), merge_transposes),
    Rule("remove_noop_cast", frozenset({"Cast"}), remove_noop_cast),
)

# --------------------------------------------------------------------------- driver

# Every rewrite removes a node, turns one into Identity or moves an input to an earlier
# producer, so sweeps end; the cap only guards against a faulty custom rule.
_MAX_SWEEPS = 100


def simplify(graph: Graph, rules: Iterable[Rule] = RULES) -> bool:
    """Apply ``rules`` everywhere until none applies (a rule names ONNX ops by name, others by
    ``domain.op``); returns whether the graph changed."""
    by_op: dict[str, list[Rule]] = {}
    for rule in rules:
        for op in rule.ops:
            by_op.setdefault(op, []).append(rule)
    ed = Editor(graph)
    changed = False
    for _ in range(_MAX_SWEEPS):
        if not _sweep(graph, ed, by_op):
            break
        changed = True
    return changed


def _sweep(graph: Graph, ed: Editor, by_op: dict) -> bool:
    changed = False
    for g in list(graph.all_graphs()):
        for node in list(g.nodes):
            # A rule may remove the node it matched: stop at the first that applies.
            changed |= any(rule.rewrite(node, ed) for rule in by_op.get(node.qualified_op, ()))
    return changed
