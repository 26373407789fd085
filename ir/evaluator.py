"""The reference evaluator: runs a graph with every op's numpy reference implementation.

It defines what a graph *means*. Constant folding evaluates nodes with it, the property
tests compare optimized graphs against it, and every backend is tested against it. It is
written for clarity, not speed (the runtime is the fast path).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from kiln.errors import InputError, KilnError
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.types import TensorType

Scope = dict  # Value -> np.ndarray


class EvaluationError(KilnError):
    """A reference implementation failed while evaluating a node."""


def evaluate(graph: Graph, inputs: Union[Mapping[str, Any], Sequence[Any]],
             scope: Optional[Scope] = None) -> list[np.ndarray]:
    """Evaluate ``graph`` on ``inputs`` (by name or position); returns the outputs in order."""
    return run_subgraph(graph, _bind_inputs(graph, inputs), scope or {})


def run_node(node: Node, args: Sequence[Optional[np.ndarray]], scope: Optional[Scope] = None) -> list[np.ndarray]:
    """Run one node's reference implementation; errors name the node."""
    schema = node.schema
    attrs = schema.fill_attrs(node.attrs)
    if schema.has_subgraphs:
        attrs["scope"] = scope if scope is not None else {}
    try:
        out = schema.reference(*args, **attrs)
    except KilnError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the node named
        raise EvaluationError(f"while evaluating {node.describe()}: {type(e).__name__}: {e}") from e
    results = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(results) < len(node.outputs):
        raise EvaluationError(f"{node.describe()}: reference returned {len(results)} outputs, "
                              f"node has {len(node.outputs)}")
    return [np.asarray(r) for r in results[:len(node.outputs)]]


def _bind_inputs(graph: Graph, inputs: Union[Mapping[str, Any], Sequence[Any]]) -> list[np.ndarray]:
    if isinstance(inputs, Mapping):
        missing = [v.name for v in graph.inputs if v.name not in inputs]
        extra = sorted(set(inputs) - {v.name for v in graph.inputs})
        if missing or extra:
            raise InputError(f"graph '{graph.name}' expects inputs {[v.name for v in graph.inputs]}; "
                             f"missing {missing}, unexpected {extra}")
        arrays = [np.asarray(inputs[v.name]) for v in graph.inputs]
    else:
        if len(inputs) != len(graph.inputs):
            raise InputError(f"graph '{graph.name}' expects {len(graph.inputs)} inputs, got {len(inputs)}")
        arrays = [np.asarray(a) for a in inputs]
    bindings: dict = {}
    for v, a in zip(graph.inputs, arrays):
        if v.type is not None and not v.type.matches(a, bindings):
            raise InputError(f"input '{v.name}': expected {v.type}, got {TensorType.of(a)}")
    return arrays


def run_subgraph(graph: Graph, inputs: Sequence[np.ndarray], scope: Scope) -> list[np.ndarray]:
    """Evaluate a nested graph (If branch, Loop body) that may read values of ``scope``.
    Inputs are bound positionally without type checks (Loop bodies carry changing shapes)."""
    env: Scope = dict(scope)
    for v, a in zip(graph.inputs, inputs):
        env[v] = np.asarray(a)
    for v in graph.initializers.values():
        env[v] = v.const
    last = _last_uses(graph)
    keep = set(graph.outputs)
    for i, node in enumerate(graph.nodes):
        results = run_node(node, [None if v is None else env[v] for v in node.inputs], env)
        for v, r in zip(node.outputs, results):
            env[v] = r
        for v in last.get(i, ()):  # freed after their last reader: peak memory is the live set, not the sum
            if v not in keep:
                env.pop(v, None)
    return [env[v] for v in graph.outputs]


def _last_uses(graph: Graph) -> dict[int, list[Value]]:
    """Node position -> the values (of this graph or its enclosing ones) it is the last node to read,
    directly or from inside its subgraphs. Values never read are freed where they are made."""
    last: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            last[v] = i
        for v in _reads(node):
            last[v] = i
    out: dict[int, list[Value]] = {}
    for v, i in last.items():
        out.setdefault(i, []).append(v)
    return out


def _reads(node: Node) -> set[Value]:
    """The values a node reads: its inputs, and those its subgraphs read from outside themselves."""
    reads = {v for v in node.inputs if v is not None}
    for g in node.subgraphs():
        inner = set(g.inputs) | set(g.initializers.values())
        for n in g.nodes:
            reads |= {v for v in _reads(n) if v not in inner}
            inner.update(n.outputs)
        reads |= {v for v in g.outputs if v not in inner}
    return reads
