"""Common-subexpression elimination: compute each distinct thing once.

Two nodes are the same computation when they have the same op, domain and attributes
(defaults filled; tensors compared by dtype, shape and bytes; floats bit for bit) and read
the same values; for two-input commutative ops the order of the inputs does not matter.
The later node is replaced by the earlier one. Nodes with subgraphs and ops that are not
pure functions of their inputs (not foldable: random ops) are left alone, except run-time
checks (ops with a side effect and no outputs: ``kiln.Guard``, ``kiln.Assert``): a check of the
same values with the same condition as an earlier one is removed, whatever line it came from
(the descriptive attributes ``location``/``code``/``what`` do not count), since it fails exactly
when the first one does, which fails the run first. A node inside an
If/Loop body may be merged into an equal node of an enclosing graph defined before it.
Identical small initializers (same dtype, shape and bytes) are merged the same way. The bodies
of fused nodes are closed (they read only their inputs and their own initializers): merging
happens inside them, never with what an enclosing graph defines.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import numpy as np

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.ops.fused import ATTENTION_OP, EPILOGUE_OP, FUSED_OP
from kiln.ir.passes._rewrite import Editor
from kiln.ir.registry import KILN_DOMAIN, ops_with

CLOSED_BODY_OPS = frozenset({FUSED_OP, EPILOGUE_OP, ATTENTION_OP})

DEFAULT_MAX_INITIALIZER_BYTES = 4096

# Two-input ops whose result does not depend on the order of the inputs. (Sum/Mean of three
# or more are left out: float addition is not associative, so order changes rounding.)
COMMUTATIVE = ops_with("commutative")  # the trait on each op's @op


def cse(graph: Graph, *, max_initializer_bytes: int = DEFAULT_MAX_INITIALIZER_BYTES) -> bool:
    """Merge equal nodes and equal small initializers in ``graph`` and its subgraphs; returns
    whether anything was merged."""
    return _cse_graph(graph, Editor(graph), {}, {}, max_initializer_bytes)


def _cse_graph(graph: Graph, ed: Editor, nodes_seen: dict, consts_seen: dict, max_bytes: int) -> bool:
    # Copies: what a body defines is not visible to its enclosing graph.
    nodes_seen = dict(nodes_seen)
    consts_seen = dict(consts_seen)
    changed = _merge_initializers(graph, ed, consts_seen, max_bytes)
    for node in list(graph.nodes):
        closed = node.domain == KILN_DOMAIN and node.op in CLOSED_BODY_OPS
        for sg in node.subgraphs():
            # A fused node's body is closed (it reads only its inputs and its own initializers):
            # nothing outside may stand in for what it defines.
            changed |= _cse_graph(sg, ed, {} if closed else nodes_seen, {} if closed else consts_seen, max_bytes)
        key = node_key(node)
        if key is None:
            continue
        first = nodes_seen.get(key)
        if first is None:
            nodes_seen[key] = node
        elif ed.replace_node(node, first.outputs):  # a repeated check has no outputs: just removed
            changed = True
    return changed


def _merge_initializers(graph: Graph, ed: Editor, seen: dict, max_bytes: int) -> bool:
    changed = False
    for v in list(graph.initializers.values()):
        if v.const.nbytes > max_bytes:
            continue
        key = _tensor_key(v.const)
        first: Optional[Value] = seen.get(key)
        if first is None:
            seen[key] = v
        elif ed.replace_value(v, first):
            del graph.initializers[v.name]  # unused now: replace_value refuses graph outputs
            changed = True
    return changed


# Attributes of run-time checks that describe where they came from, not what they check.
_DESCRIPTIVE = frozenset({"location", "code", "what"})


def node_key(node: Node) -> Optional[Hashable]:
    """What identifies the node's computation, or None if it must not be merged."""
    schema = node.schema
    if schema.side_effect and not node.outputs and not schema.has_subgraphs:
        attrs = schema.fill_attrs(node.attrs)
        checked = tuple(sorted((k, _attr_key(a)) for k, a in attrs.items() if k not in _DESCRIPTIVE))
        return "check", node.domain, node.op, checked, node.inputs
    if schema.has_subgraphs or not schema.foldable or not node.outputs:
        return None
    inputs: tuple = node.inputs
    if node.domain == "" and node.op in COMMUTATIVE and len(inputs) == 2 and None not in inputs:
        # Any fixed order will do: the key is only compared, never used to rebuild the node.
        inputs = tuple(sorted(inputs, key=id))
    attrs = schema.fill_attrs(node.attrs)
    attrs_key = tuple(sorted((k, _attr_key(a)) for k, a in attrs.items()))
    return node.domain, node.op, attrs_key, inputs, len(node.outputs)


def _attr_key(a: Any) -> Hashable:
    if isinstance(a, np.ndarray):
        return _tensor_key(a)
    if isinstance(a, float):
        # Bit for bit: 0.0 and -0.0 differ, and a NaN equals itself.
        return ("float", a.hex())
    if isinstance(a, tuple):
        return tuple(_attr_key(x) for x in a)
    return a


def _tensor_key(a: np.ndarray) -> Hashable:
    return "tensor", a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes()
