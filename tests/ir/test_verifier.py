"""verify() accepts sound graphs and names the node for each kind of breakage."""
import numpy as np
import pytest

from kiln import VerifyError
from kiln.ir import Graph, TensorType, verify
from kiln.ir.graph import Value


def base():
    g = Graph("g")
    x = g.add_input("x", "float32", ("batch", 4))
    a = g.op("Add", x, x, name="first")
    m = g.op("Mul", a, x, name="second")
    g.outputs = [m]
    return g, x, a, m


def test_sound_graph_passes():
    verify(base()[0])


def test_use_before_definition_names_the_node():
    g, x, a, m = base()
    g.nodes.reverse()
    with pytest.raises(VerifyError, match=r"node 'second' \(Mul\): input 0 'first' is not defined before"):
        verify(g)


def test_wrong_input_dtype_names_node_and_allowed_types():
    g = Graph()
    x = g.add_input("x", "bool", (3,))
    g.add_node("Add", [x, x], output_types=[TensorType("bool", (3,))], name="bad")
    g.outputs = [g.nodes[0].output]
    with pytest.raises(VerifyError, match=r"node 'bad' \(Add\): input 0 \('A'\) is bool; allowed:"):
        verify(g)


def test_missing_type_and_wrong_recorded_type():
    g, x, a, m = base()
    a.type = None
    with pytest.raises(VerifyError, match="value 'first' .* has no type"):
        verify(g)
    a.type = TensorType("float32", ("batch", 5))
    with pytest.raises(VerifyError, match=r"output 'first' is typed float32\[batch,5\], inference gives"):
        verify(g)


def test_duplicate_definition_and_undefined_output():
    g, x, a, m = base()
    # A node list holds a node once; a value can still be listed as the output of a second node.
    other = g.add_node("Relu", [x], name="other")
    other.outputs = [a]
    with pytest.raises(VerifyError, match="defined more than once"):
        verify(g)
    g2, *_ = base()
    g2.outputs = [Value("ghost", TensorType("float32", (1,)), g2)]
    with pytest.raises(VerifyError, match="output 'ghost' .* is not defined"):
        verify(g2)


def test_wrong_input_count():
    g, x, a, m = base()
    a.producer._inputs = (x,)
    with pytest.raises(VerifyError, match="has 1 inputs, Add takes 2..2"):
        verify(g)


def test_uses_out_of_sync_is_reported():
    g, x, a, m = base()
    x._uses.clear()
    with pytest.raises(VerifyError, match="does not list the node among its uses"):
        verify(g)


def test_initializer_type_must_match_data():
    g = Graph()
    w = g.add_initializer("w", np.zeros((2, 2), np.float32))
    w.type = TensorType("float32", (4,))
    g.outputs = [w]
    with pytest.raises(VerifyError, match=r"initializer 'w' is typed float32\[4\] but holds float32\[2,2\]"):
        verify(g)


def test_every_problem_is_listed():
    g, x, a, m = base()
    a.type = None
    m.type = None
    with pytest.raises(VerifyError) as e:
        verify(g)
    assert "'first'" in str(e.value) and "'second'" in str(e.value)
