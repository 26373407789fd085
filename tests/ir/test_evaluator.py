"""The reference evaluator binds inputs strictly and names the node that fails."""
import numpy as np
import pytest

from kiln import InputError, KilnError
from kiln.ir import Graph, evaluate


def graph():
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    y = g.add_input("y", "float32", ("batch", 3))
    g.outputs = [g.op("Add", x, y, name="sum")]
    return g


def test_inputs_by_name_or_position():
    g = graph()
    a = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(evaluate(g, {"x": a, "y": a})[0], a + a)
    np.testing.assert_array_equal(evaluate(g, [a, a])[0], a + a)


def test_symbolic_dims_must_agree_between_inputs():
    g = graph()
    with pytest.raises(InputError, match=r"input 'y': expected float32\[batch,3\], got float32\[4,3\]"):
        evaluate(g, [np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)])


def test_missing_and_unexpected_inputs_are_named():
    with pytest.raises(InputError, match=r"missing \['y'\], unexpected \['z'\]"):
        evaluate(graph(), {"x": np.ones((1, 3), np.float32), "z": 1})


def test_reference_failure_names_node():
    g = Graph()
    x = g.add_input("x", "float32", None)
    g.outputs = [g.op("Add", x, x, name="broken")]
    g.nodes[0].inputs = [x, g.add_initializer("c", np.ones((7,), np.float32))]
    with pytest.raises(KilnError, match=r"while evaluating node 'broken' \(Add\)"):
        evaluate(g, [np.ones((2, 3), np.float32)])
