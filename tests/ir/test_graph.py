"""Graph/Node/Value construction and editing keep producers, uses and names consistent."""
import numpy as np
import pytest

from kiln import KilnError
from kiln.ir import Graph, TensorType, evaluate, verify


def small_graph():
    g = Graph("g")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", np.full((1, 4), 2.0, np.float32))
    a = g.op("Add", x, w)
    m = g.op("Mul", a, x)
    g.outputs = [m]
    return g, x, w, a, m


def test_uses_follow_inputs():
    g, x, w, a, m = small_graph()
    assert [n.op for n in x.users] == ["Add", "Mul"]
    assert x.uses == ((a.producer, 0), (m.producer, 1))
    m.producer.set_input(1, w)
    assert x.users == [a.producer]
    assert (m.producer, 1) in w.uses
    verify(g)


def test_replace_all_uses_with_rewires_nodes_and_outputs():
    g, x, w, a, m = small_graph()
    b = g.op("Sub", x, w)
    g.move_before(b.producer, a.producer)
    n = g.replace_all_uses_with(a, b)
    assert n == 1 and a.uses == () and m.producer.inputs[0] is b
    g.replace_all_uses_with(m, a)
    assert g.outputs == [a]
    verify(g)


def test_insert_before_and_after_keep_order():
    g, x, w, a, m = small_graph()
    n1 = g.add_node("Sub", [x, w], before=a.producer)
    n2 = g.add_node("Add", [a, a], after=a.producer)
    assert [n.op for n in g.nodes] == ["Sub", "Add", "Add", "Mul"]
    assert g.nodes[0] is n1 and g.nodes[2] is n2


def test_names_are_unique_and_stable():
    g = Graph()
    x = g.add_input("x", "float32", (2,))
    outs = [g.op("Add", x, x) for _ in range(3)]
    assert [v.name for v in outs] == ["add", "add_1", "add_2"]
    with pytest.raises(KilnError, match="already used"):
        g.add_input("x", "float32", (2,))
    sub = g.subgraph("body")
    assert sub.fresh_name("add") == "add_3"  # one namespace for a graph and its subgraphs


def test_remove_node_refuses_while_used():
    g, x, w, a, m = small_graph()
    with pytest.raises(KilnError, match="still used"):
        g.remove_node(a.producer)
    g.outputs = [a]
    g.remove_node(m.producer)
    assert x.users == [a.producer]
    verify(g)


def test_initializers_are_not_copied():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    g = Graph()
    v = g.add_initializer("w", arr)
    assert v.const is arr and v.type == TensorType("float32", (3, 4))
    g2 = g.copy()
    assert g2.initializers["w"].const is arr


def test_copy_is_independent_and_equivalent():
    g, x, w, a, m = small_graph()
    c = g.copy()
    assert str(c) == str(g)
    c.nodes[0].set_input(1, c.inputs[0])
    assert g.nodes[0].inputs[1] is w
    feed = {"x": np.ones((3, 4), np.float32)}
    np.testing.assert_array_equal(evaluate(g, feed)[0], np.full((3, 4), 3.0, np.float32))


def test_unknown_attribute_and_op_are_clear_errors():
    g = Graph()
    x = g.add_input("x", "float32", (2,))
    with pytest.raises(KilnError, match="has no attribute 'alpha'"):
        g.op("Add", x, x, alpha=1.0)
    with pytest.raises(KilnError, match="op 'Frobnicate' is not registered"):
        g.op("Frobnicate", x)


def test_op_counts_and_find():
    g, x, w, a, m = small_graph()
    assert g.op_counts() == {"Add": 1, "Mul": 1}
    assert g.find_value("w") is w
    assert g.find_node(a.producer.name) is a.producer
