"""Dead-code elimination: drop what no graph output depends on.

A node is dead when none of its outputs is read or is a graph output; an If/Loop whose
outputs are unused goes with its whole body (ops are pure, so nothing else can observe it).
Inside the bodies of live If/Loop nodes dead nodes go too, then every initializer nobody
reads. The main graph's inputs are the model's signature and stay unless ``prune_inputs``;
subgraph inputs are bound by position and always stay.
"""
from __future__ import annotations

from kiln.ir.graph import Graph, Node
from kiln.ir.passes._rewrite import graph_outputs


def dce(graph: Graph, *, prune_inputs: bool = False) -> bool:
    """Remove dead nodes, then unused initializers (and unused inputs if ``prune_inputs``)
    in ``graph`` and its subgraphs; returns whether anything was removed."""
    live = graph_outputs(graph)
    changed = _remove_dead_nodes(graph, live)
    changed |= _remove_unused_initializers(graph, live)
    if prune_inputs:
        changed |= _remove_unused_inputs(graph, live)
    return changed


def _is_dead(node: Node, live: set) -> bool:
    return all(not v.uses and v not in live for v in node.outputs)


def _remove_dead_nodes(graph: Graph, live: set) -> bool:
    # Backwards, so removing a node frees its producers before they are visited. A live
    # node's bodies are cleaned when it is visited, before the nodes defining the outer
    # values those bodies read.
    changed = False
    for node in reversed(list(graph.nodes)):
        if _is_dead(node, live):
            graph.remove_node(node, force=True)  # checked just above, without a graph walk
            changed = True
            continue
        for sg in node.subgraphs():
            changed |= _remove_dead_nodes(sg, live)
    return changed


def _remove_unused_initializers(graph: Graph, live: set) -> bool:
    changed = False
    for g in list(graph.all_graphs()):
        for v in list(g.initializers.values()):
            if not v.uses and v not in live:
                del g.initializers[v.name]  # checked just above, without a graph walk
                changed = True
    return changed


def _remove_unused_inputs(graph: Graph, live: set) -> bool:
    kept = [v for v in graph.inputs if v.uses or v in live]
    changed = len(kept) != len(graph.inputs)
    graph.inputs = kept
    return changed
