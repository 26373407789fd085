"""Graph.nodes is a NodeList (ir/graph.py): a doubly linked list with O(1) edits, in order, one list per node.
Speed is bench/graph_scale_bench.py's; these check the behaviour passes rely on."""
import pytest

from kiln import KilnError
from kiln.ir import Graph


def chain(n=5):
    g = Graph("g")
    v = g.add_input("x", "float32", (2,))
    for i in range(n):
        v = g.op("Relu", v, name=f"r{i}")
    g.outputs = [v]
    return g


def names(nodes):
    return [n.name for n in nodes]


def test_order_length_indexing_and_membership():
    g = chain()
    assert names(g.nodes) == ["r0", "r1", "r2", "r3", "r4"] and len(g.nodes) == 5
    assert names(reversed(g.nodes)) == ["r4", "r3", "r2", "r1", "r0"]
    assert g.nodes[0].name == "r0" and g.nodes[-1].name == "r4" and names(g.nodes[1:3]) == ["r1", "r2"]
    assert g.nodes.index(g.nodes[3]) == 3 and g.nodes[2] in g.nodes
    assert g.nodes == list(g.nodes) and bool(g.nodes) and not Graph().nodes


def test_insert_before_after_move_and_remove():
    g = chain()
    r0, r1, r2, r3, r4 = list(g.nodes)
    extra = g.add_node("Neg", [r0.output], name="neg", before=r2)
    assert names(g.nodes) == ["r0", "r1", "neg", "r2", "r3", "r4"]
    last = g.add_node("Neg", [r4.output], name="last", after=r4)
    first = g.add_node("Neg", [r0.output], name="first", after=r0)
    assert names(g.nodes) == ["r0", "first", "r1", "neg", "r2", "r3", "r4", "last"]
    g.move_before(last, r1)
    assert names(g.nodes) == ["r0", "first", "last", "r1", "neg", "r2", "r3", "r4"]
    for n in (extra, last, first):
        g.remove_node(n)
    assert names(g.nodes) == ["r0", "r1", "r2", "r3", "r4"] and len(g.nodes) == 5
    assert names(reversed(g.nodes)) == ["r4", "r3", "r2", "r1", "r0"]
    with pytest.raises(KilnError, match="is not in graph"):
        g.remove_node(extra, force=True)
    with pytest.raises(KilnError, match="is not in graph"):
        g.add_node("Neg", [r0.output], before=extra)


def test_iteration_survives_removing_the_node_just_yielded_and_sees_insertions_after_it():
    g = chain()
    seen = []
    for n in g.nodes:
        seen.append(n.name)
        if n.name == "r1":
            g.add_node("Neg", [n.output], name="inserted", after=n)
        if n.name in ("r2", "r3"):
            g.remove_node(n, force=True)
    assert seen == ["r0", "r1", "inserted", "r2", "r3", "r4"]
    assert names(g.nodes) == ["r0", "r1", "inserted", "r4"]
    seen = []
    for n in reversed(g.nodes):
        seen.append(n.name)
        g.nodes.remove(n)
    assert seen == ["r4", "inserted", "r1", "r0"] and len(g.nodes) == 0 and list(g.nodes) == []


def test_a_node_is_in_one_list_and_the_setter_takes_nodes_over():
    g = chain(3)
    body = g.subgraph("body")
    r0, r1, r2 = list(g.nodes)
    body.nodes.append(r1)  # taken out of g's list
    assert names(g.nodes) == ["r0", "r2"] and names(body.nodes) == ["r1"]
    g.nodes = [r2, r1, r0]  # the setter: one list again, r1 taken from the body, its graph updated
    assert names(g.nodes) == ["r2", "r1", "r0"] and not body.nodes and r1.graph is g
    g.nodes.reverse()
    assert names(g.nodes) == ["r0", "r1", "r2"]


def test_subgraph_holders_are_tracked_for_graph_walks():
    g = Graph("g")
    c = g.add_input("c", "bool", ())
    x = g.add_input("x", "float32", (2,))
    then_g, else_g = g.subgraph("then"), g.subgraph("else")
    then_g.outputs = [then_g.op("Relu", x)]
    else_g.outputs = [else_g.op("Neg", x)]
    plain = g.op("Abs", x)
    node = g.add_node("If", [c], {"then_branch": then_g, "else_branch": else_g}, output_types=[x.type])
    g.outputs = [node.output, plain]
    assert list(g.nodes.holders) == [node]
    assert {id(sg) for sg in g.graphs_unordered()} == {id(sg) for sg in g.all_graphs()}
    g.outputs = [plain]
    g.remove_node(node)
    assert not g.nodes.holders and list(g.graphs_unordered()) == [g]
