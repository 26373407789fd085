"""Dead-code elimination: nodes, bodies and initializers nobody needs go; the signature stays."""
import numpy as np

from kiln.ir import Graph, verify
from kiln.ir.passes import dce


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


def feeds(**shapes) -> dict:
    rng = np.random.default_rng(1)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def test_dead_chain_and_unused_initializers_go(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    unused_input = g.add_input("unused", "float32", (3,))
    w = g.add_initializer("w", np.ones(3, np.float32))
    g.add_initializer("orphan", np.zeros(2, np.float32))
    dead = g.op("Exp", g.op("Mul", x, w))
    g.op("Neg", dead)
    g.outputs = [g.op("Relu", x)]
    check_pass(dce, g, feeds(x=(2, 3), unused=(3,)))
    assert ops(g) == ["Relu"]
    assert g.initializers == {}
    # Graph inputs are the model's signature: kept unless asked.
    assert [v.name for v in g.inputs] == ["x", "unused"]
    assert dce(g, prune_inputs=True) is True
    assert g.inputs == [x] and unused_input not in g.inputs
    verify(g)


def test_everything_live_is_left_alone(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2,))
    a = g.op("Relu", x)
    # A graph output nobody else reads is live; so is each output of a partly used node.
    first, _second = g.op("Split", g.op("Concat", a, a, axis=0), num_outputs=2, outputs=2)
    g.outputs = [a, first]
    check_pass(dce, g, feeds(x=(2,)), changes=False)
    assert ops(g) == ["Relu", "Concat", "Split"]


def _if(g: Graph, cond, then_value_fn, else_value_fn):
    then = g.subgraph("then")
    then.outputs = [then_value_fn(then)]
    other = g.subgraph("else")
    other.outputs = [else_value_fn(other)]
    return g.op("If", cond, then_branch=then, else_branch=other, outputs=1)


def test_dead_if_goes_with_the_outer_values_only_its_body_read(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    cond = g.add_input("cond", "bool", ())
    only_for_if = g.op("Exp", x)
    _if(g, cond, lambda b: b.op("Add", only_for_if, x), lambda b: b.op("Neg", x))
    g.outputs = [g.op("Relu", x)]
    check_pass(dce, g, {**feeds(x=(3,)), "cond": np.array(True)})
    assert ops(g) == ["Relu"]


def test_dead_nodes_inside_a_live_if(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    cond = g.add_input("cond", "bool", ())
    w = g.add_initializer("w", np.full(3, 2.0, np.float32))
    outer = g.op("Exp", x, name="only_dead_inner_reads_me")

    def then(b: Graph):
        b.op("Mul", outer, w, name="dead_inner")
        return b.op("Sin", x)

    g.outputs = [_if(g, cond, then, lambda b: b.op("Neg", x))]
    for flag in (True, False):
        g2 = g.copy()
        check_pass(dce, g2, {**feeds(x=(3,)), "cond": np.array(flag)})
        assert ops(g2) == ["If", "Neg", "Sin"]  # else_branch walks before then_branch
        assert g2.initializers == {}


def test_dead_loop_goes(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    body = g.subgraph("body")
    body.add_input("i", "int64", ())
    keep_going = body.add_input("cond_in", "bool", ())
    acc = body.add_input("acc", "float32", (3,))
    body.outputs = [body.op("Identity", keep_going), body.op("Add", acc, x)]
    trips = g.add_initializer("trips", np.array(3, np.int64))
    g.op("Loop", trips, None, x, body=body, outputs=1)
    g.outputs = [g.op("Neg", x)]
    check_pass(dce, g, feeds(x=(3,)))
    assert ops(g) == ["Neg"]
    assert g.initializers == {}
