"""Editing helpers shared by the rewriting passes.

The one rule every pass must keep: a graph's outputs keep their names (they are the model's
signature, and If/Loop bodies hand their outputs to the enclosing node by position). So a
value that is a graph output may only be replaced by a value computed by a node of the same
graph, which then takes over the output's name; never by a graph input, an initializer, a
value of an enclosing graph or another graph output.

An :class:`Editor` is made once per pass run: it knows every graph output up front, so each
check and each replacement costs the uses of one value, not a walk of the whole graph.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.graph import Graph, Node, Value


def graph_outputs(graph: Graph) -> set:
    """Every output of ``graph`` and of its subgraphs (a set of Values)."""
    return {v for g in graph.all_graphs() for v in g.outputs}


class Editor:
    """Replaces values and removes nodes in ``graph`` (and its subgraphs), keeping output names."""

    def __init__(self, graph: Graph):
        self.root = graph.root
        # Outputs of bodies removed later stay in the set: that only makes checks stricter.
        self.outputs = graph_outputs(self.root)

    def is_output(self, v: Value) -> bool:
        return v in self.outputs

    def can_replace(self, old: Value, new: Value) -> bool:
        """Whether every reader of ``old`` may read ``new`` instead."""
        if old is new:
            return False
        if old not in self.outputs:
            return True
        return new.producer is not None and new.graph is old.graph and new not in self.outputs

    def replace_value(self, old: Value, new: Value) -> bool:
        """Rewire every reader of ``old`` (graph outputs included) to ``new``, if allowed.

        When ``old`` is a graph output, ``new`` takes its name and ``old`` gets a fresh one, so
        the signature is unchanged. Returns False (changing nothing) when not allowed.
        """
        if not self.can_replace(old, new):
            return False
        redirect_uses(old, new)
        if old in self.outputs:
            self._replace_output(old, new)
        return True

    def _replace_output(self, old: Value, new: Value) -> None:
        for g in self.root.all_graphs():
            g.outputs = [new if v is old else v for v in g.outputs]
        self.outputs.discard(old)
        self.outputs.add(new)
        name = old.name
        old.name = old.graph.fresh_name(name)
        new.name = name

    def replace_node(self, node: Node, values: Sequence[Optional[Value]]) -> bool:
        """Replace each output of ``node`` by the value at the same position and remove it.

        A ``None`` entry is allowed only for an output nobody reads. All or nothing: returns
        False, changing nothing, if one output may not be replaced.
        """
        for old, new in zip(node.outputs, values):
            if new is None:
                if old.uses or old in self.outputs:
                    return False
            elif not self.can_replace(old, new):
                return False
        for old, new in zip(node.outputs, values):
            if new is not None:
                self.replace_value(old, new)
        self.remove_node(node)
        return True

    def remove_node(self, node: Node) -> None:
        """Remove a node whose outputs are unused (checked here, cheaply)."""
        for v in node.outputs:
            if v.uses or v in self.outputs:
                raise KilnError(f"cannot remove {node.describe()}: output '{v.name}' is still used")
        node.graph.remove_node(node, force=True)

    def only_first_output_used(self, node: Node) -> bool:
        """Whether outputs after the first are read by nobody (nor are graph outputs)."""
        return all(not v.uses and v not in self.outputs for v in node.outputs[1:])


def redirect_uses(old: Value, new: Value) -> bool:
    """Make the nodes reading ``old`` read ``new``; graph outputs keep ``old``. Returns whether
    any node was rewired."""
    users = old.users
    for n in users:
        n.replace_input(old, new)
    return bool(users)


def rename_initializer(v: Value, name: str) -> None:
    """Give initializer ``v`` the name ``name``, freed by a value that has just been removed."""
    graph = v.graph
    del graph.initializers[v.name]
    v.name = name
    graph.initializers[name] = v


def tensor_attr_bytes(node: Node) -> int:
    """Bytes held in the node's tensor attributes (``Constant``'s value, ...)."""
    return sum(a.nbytes for a in node.attrs.values() if isinstance(a, np.ndarray))
