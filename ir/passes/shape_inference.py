"""Shape and type inference over a whole graph (subgraphs included).

Each node's output types come from its op's ``infer`` function. Small integer tensors that
describe shapes (``Shape(x)`` and what is computed from it) are tracked symbolically, so a
``Reshape`` to ``[Shape(x)[0], -1]`` keeps the symbolic ``batch`` dim. Types already on a
value (declared by a frontend or a file) are merged with the inferred ones: the more precise
dim wins, and a contradiction is an error naming the node.
"""
from __future__ import annotations

from typing import Optional

from kiln.errors import ShapeInferenceError
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.registry import InferContext, normalize_inferred
from kiln.ir.types import TensorType, dims_compatible, merge_dim

# Symbolic values of 1-D int tensors computed from shapes, keyed by Value. Kept by the pass
# (not stored on values) so it can never go stale after a graph edit.
SymbolTable = dict


def infer_node(node: Node, symbols: Optional[SymbolTable] = None) -> bool:
    """Infer the output types of one node from its inputs; returns whether a type changed."""
    symbols = {} if symbols is None else symbols
    schema = node.schema
    types = [None if v is None else v.type for v in node.inputs]
    consts = [None if v is None else v.const for v in node.inputs]
    syms = [None if v is None else symbols.get(v) for v in node.inputs]
    ctx = InferContext(node, schema, types, consts, syms)
    try:
        inferred = normalize_inferred(ctx, schema.infer(ctx))
    except (ValueError, IndexError, TypeError, KeyError) as e:
        raise ShapeInferenceError(f"{node.describe()}: {e}") from e
    changed = False
    for out, t in zip(node.outputs, inferred):
        merged = _merge(node, out, t)
        if merged != out.type:
            out.type = merged
            changed = True
    if schema.propagate is not None and len(node.outputs) == 1:
        try:
            sym = schema.propagate(ctx)
        except (ValueError, IndexError, TypeError):
            sym = None
        if sym is not None:
            symbols[node.outputs[0]] = tuple(sym)
    return changed


def _merge(node: Node, out: Value, inferred: Optional[TensorType]) -> Optional[TensorType]:
    old = out.type
    if inferred is None:
        return old
    if old is None:
        return inferred
    if old.dtype is not inferred.dtype:
        raise ShapeInferenceError(
            f"{node.describe()}: output '{out.name}' is declared {old} but inferred {inferred}")
    if old.shape is None:
        return inferred
    if inferred.shape is None:
        return old
    if len(old.shape) != len(inferred.shape) or not all(
            dims_compatible(a, b) for a, b in zip(old.shape, inferred.shape)):
        raise ShapeInferenceError(
            f"{node.describe()}: output '{out.name}' is declared {old} but inferred {inferred}")
    return TensorType(old.dtype, [merge_dim(a, b) for a, b in zip(old.shape, inferred.shape)])


def infer_shapes(graph: Graph) -> bool:
    """Infer every node's output types, in order, subgraphs first where a node has them.

    Returns whether any type changed. Raises ShapeInferenceError naming the node on failure.
    """
    symbols: SymbolTable = {}
    return _infer_graph(graph, symbols)


def _infer_graph(graph: Graph, symbols: SymbolTable) -> bool:
    changed = False
    for node in graph.nodes:
        for sg in node.subgraphs():
            changed |= _infer_graph(sg, symbols)
        changed |= infer_node(node, symbols)
    return changed
