"""The printed form is stable: golden text for a small graph with attributes and metadata."""
import numpy as np

from kiln.ir import Graph

GOLDEN = """\
graph tiny(%x: float32[batch,4]) opset=1 {
  init %w: float32[1,4]
  %add: float32[batch,4] = Add(%x, %w)  # block.0
  %mul: float32[batch,4] = Mul(%add, %add)
  return %mul
}"""


def test_golden_print():
    g = Graph("tiny")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", np.ones((1, 4), np.float32))
    a = g.op("Add", x, w)
    a.producer.meta["scope"] = "block.0"
    g.outputs = [g.op("Mul", a, a)]
    assert str(g) == GOLDEN


def test_print_is_deterministic_across_copies():
    g = Graph("tiny")
    x = g.add_input("x", "float32", (2,))
    g.outputs = [g.op("Add", x, x)]
    assert str(g) == str(g.copy())
