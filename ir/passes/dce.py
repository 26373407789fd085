"""Dead-code elimination: drop what no graph output depends on.

A node is dead when none of its outputs is read or is a graph output; an If/Loop whose
outputs are unused goes with its whole body (ops are pure, so nothing else can observe it).
The exception is an op with a side effect (registered with ``side_effect=True``: ``kiln.Assert``
and ``kiln.Guard``, run-time checks with no outputs): it is always live, and so is an If/Loop whose body holds one.
Inside the bodies of live If/Loop nodes dead nodes go too, then every initializer nobody
reads. The main graph's inputs are the model's signature and stay unless ``prune_inputs``.

A live If/Loop also sheds the outputs nobody reads, which frees what computed them in the
bodies: an unused If output goes from the node and from both branches; an unused Loop scan
output from the node and the body. An unused Loop-carried value goes only when nothing else
depends on it either: its body input must be read by nothing (no node of the body or of a
nested body, no body output other than its own pass-through slot), since the carried value
of iteration k feeds iteration k+1's computations. Then its initial value, body input, body
output and node output go together. Other subgraph inputs are bound by position and stay.
"""
from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes._rewrite import graph_outputs



def dce(graph: Graph, *, prune_inputs: bool = False) -> bool:
    """Remove dead nodes, then unused initializers (and unused inputs if ``prune_inputs``)
    in ``graph`` and its subgraphs; returns whether anything was removed."""
    live = graph_outputs(graph)
    changed = False
    # Pruning outputs of one node can make another's unused (a Loop inside a branch): repeat.
    while _prune_control_flow_outputs(graph, live):
        changed = True
        live = graph_outputs(graph)
    changed |= _remove_dead_nodes(graph, live)
    changed |= _remove_unused_initializers(graph, live)
    if prune_inputs:
        changed |= _remove_unused_inputs(graph, live)
    return changed


def has_side_effect(node: Node) -> bool:
    """Whether ``node`` is, or has in a body (at any depth), an op registered with a side effect."""
    if node.schema.side_effect:
        return True
    return any(n.schema.side_effect for sg in node.subgraphs() for n in sg.walk())


def _is_dead(node: Node, live: set) -> bool:
    return all(not v.uses and v not in live for v in node.outputs) and not has_side_effect(node)


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


def _unused(v: Value, live: set) -> bool:
    return not v.uses and v not in live


def _prune_control_flow_outputs(graph: Graph, live: set) -> bool:
    changed = False
    for node in list(graph.walk()):
        if node.domain != "" or not any(_unused(v, live) for v in node.outputs):
            continue
        if node.op == "If":
            changed |= _prune_if(node, live)
        elif node.op == "Loop":
            changed |= _prune_loop(node, live)
    return changed


def _prune_if(node: Node, live: set) -> bool:
    keep = [k for k, v in enumerate(node.outputs) if not _unused(v, live)]
    if not keep:
        return False  # the whole node is dead: _remove_dead_nodes takes it with its bodies
    for name in ("then_branch", "else_branch"):
        branch = node.attrs[name]
        branch.outputs = [branch.outputs[k] for k in keep]
    _keep_outputs(node, keep)
    return True


def _prune_loop(node: Node, live: set) -> bool:
    body = node.attrs["body"]
    n_carried = max(len(node.inputs) - 2, 0)
    if len(node.outputs) == sum(_unused(v, live) for v in node.outputs):
        return False
    drop_carried = [k for k in range(n_carried)
                    if _unused(node.outputs[k], live) and _carried_unread(body, k)]
    drop_scan = [n_carried + j for j in range(len(node.outputs) - n_carried)
                 if _unused(node.outputs[n_carried + j], live)]
    if not drop_carried and not drop_scan:
        return False
    gone = set(drop_carried) | set(drop_scan)
    keep = [k for k in range(len(node.outputs)) if k not in gone]
    body.inputs = [v for i, v in enumerate(body.inputs) if i - 2 not in drop_carried]
    body.outputs = [body.outputs[0]] + [body.outputs[1 + k] for k in keep]
    node.inputs = [v for i, v in enumerate(node.inputs) if i - 2 not in drop_carried]
    _keep_outputs(node, keep)
    return True


def _carried_unread(body: Graph, k: int) -> bool:
    """Whether carried value ``k`` influences nothing but itself: its body input is read by no
    node and is no output of the body (other than its own slot) or of a nested body."""
    v = body.inputs[2 + k]
    if v.uses:
        return False
    if any(o is v for i, o in enumerate(body.outputs) if i != 1 + k):
        return False
    return not any(o is v for g in body.all_graphs() if g is not body for o in g.outputs)


def _keep_outputs(node: Node, keep: list) -> None:
    node.outputs = [node.outputs[k] for k in keep]
    for i, v in enumerate(node.outputs):
        v.index = i


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
