"""Control-flow folding: an ``If`` whose condition is a constant becomes the branch it takes.

kiln.script resolves conditions on Python values while tracing, but a condition computed in
the graph may become constant only later: ``Greater(Gather(Shape(x), 1), 4)`` folds once
shape inference knows dim 1 of ``x`` (a static shape, or a graph specialized to one). Then
the ``If`` is dead weight that also hides its taken branch from every other pass (fusion,
CSE across the boundary, the runtime's flat plan). This pass moves the taken branch's
initializers and nodes into the enclosing graph, just before the ``If``, and makes the If's
readers read the branch's outputs.

No renaming is needed: names are unique across a root graph and all its subgraphs, and a
branch's nodes may already read values of every enclosing graph, all defined before the
``If``. The one rule of :mod:`kiln.ir.passes._rewrite` still holds: an ``If`` output that is a
graph output keeps its name, so when the branch output cannot take its place (it is an outer
value, an initializer, or already another output) an ``Identity`` carries it.

Removing unused If outputs and Loop-carried values is DCE's part (see dce.py); constant
folding inside bodies is fold_constants'.
"""
from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes._rewrite import Editor

# Each inlining removes an If, so sweeps end; nested Ifs moved up are seen by the next sweep.
_MAX_SWEEPS = 100


def inline_constant_branches(graph: Graph) -> bool:
    """Replace every ``If`` of ``graph`` (and of its subgraphs) whose condition is a constant
    by the nodes of the branch it takes; returns whether anything was inlined."""
    changed = False
    for _ in range(_MAX_SWEEPS):
        ed = Editor(graph)
        swept = False
        for g in list(graph.all_graphs()):
            for node in list(g.nodes):
                if node.graph is g and _constant_if(node) is not None:
                    _inline(node, ed)
                    swept = True
        if not swept:
            break
        changed = True
    return changed


def _constant_if(node: Node):
    """The condition's truth value when ``node`` is an If on a constant, else None."""
    if node.op != "If" or node.domain != "" or not node.inputs or node.inputs[0] is None:
        return None
    c = node.inputs[0].const
    if c is None or c.size != 1:
        return None
    return bool(c.reshape(-1)[0])


def _inline(node: Node, ed: Editor) -> None:
    parent = node.graph
    taken: Graph = node.attrs["then_branch" if _constant_if(node) else "else_branch"]
    for name, v in taken.initializers.items():
        v.graph = parent
        parent.initializers[name] = v
    taken.initializers = {}
    for inner in list(taken.nodes):  # in the If's place, in order
        _move(inner, parent)
        parent.nodes.insert_before(node, inner)
    branch_outputs = list(taken.outputs)
    taken.nodes = []  # so removing the If below does not detach the nodes just moved
    taken.outputs = []
    # The branch's outputs are plain values of the parent now: they may take an output's place.
    ed.outputs.difference_update(branch_outputs)
    for old, new in zip(node.outputs, branch_outputs):
        _replace(old, new, node, ed)
    ed.remove_node(node)


def _move(node: Node, parent: Graph) -> None:
    node.graph = parent
    for v in node.outputs:
        v.graph = parent
    for sg in node.subgraphs():
        sg.parent = parent


def _replace(old: Value, new: Value, anchor: Node, ed: Editor) -> None:
    if not old.uses and not ed.is_output(old):
        return
    if ed.replace_value(old, new):
        return
    # ``old`` is a graph output that ``new`` may not rename away: Identity(new) takes its place.
    ident = anchor.graph.add_node("Identity", [new], before=anchor, output_types=[new.type])
    ed.replace_value(old, ident.outputs[0])
