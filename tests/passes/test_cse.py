"""Common-subexpression elimination: equal computations and equal small constants are merged."""
import numpy as np

from kiln.ir import Graph
from kiln.ir.passes import cse


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


X = {"x": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)}


def test_equal_nodes_merge_and_chains_collapse_in_one_run(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    a1 = g.op("Exp", g.op("Relu", x))
    a2 = g.op("Exp", g.op("Relu", x))
    g.outputs = [g.op("Sub", a1, a2)]
    check_pass(cse, g, X)
    assert ops(g) == ["Relu", "Exp", "Sub"]
    sub = g.nodes[-1]
    assert sub.inputs[0] is sub.inputs[1]


def test_commutative_inputs_in_any_order(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    y = g.op("Neg", x)
    g.outputs = [g.op("Mul", g.op("Add", x, y), g.op("Add", y, x)),
                 g.op("Add", g.op("Sub", x, y), g.op("Sub", y, x))]
    check_pass(cse, g, X)
    # Add(x, y) == Add(y, x), but Sub(x, y) != Sub(y, x).
    assert ops(g) == ["Neg", "Add", "Mul", "Sub", "Sub", "Add"]


def test_attributes_must_match_with_defaults_filled(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    default = g.op("LeakyRelu", x)
    explicit_default = g.op("LeakyRelu", x, alpha=0.01)
    other = g.op("LeakyRelu", x, alpha=0.2)
    t1 = g.op("Transpose", x, perm=[1, 0])
    t2 = g.op("Transpose", x)
    g.outputs = [g.op("Sum", default, explicit_default, other), g.op("Add", t1, t2)]
    check_pass(cse, g, X)
    assert ops(g) == ["LeakyRelu", "LeakyRelu", "Transpose", "Transpose", "Sum", "Add"]


def test_tensor_attributes_compare_dtype_shape_and_bytes(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    shape = g.add_initializer("shape", np.array([2, 3], np.int64))
    twos = [g.op("ConstantOfShape", shape, value=np.array([2.0], np.float32)) for _ in range(2)]
    g.outputs = [g.op("Add", g.op("Mul", x, twos[0]), twos[1]),
                 g.op("ConstantOfShape", shape, value=np.array([2], np.int32)),
                 g.op("ConstantOfShape", shape, value=np.array([3.0], np.float32))]
    check_pass(cse, g, X)
    assert ops(g) == ["ConstantOfShape", "Mul", "Add", "ConstantOfShape", "ConstantOfShape"]


def test_equal_small_initializers_merge(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    c1 = g.add_initializer("c1", np.array([1.0, 2.0, 3.0], np.float32))
    c2 = g.add_initializer("c2", np.array([1.0, 2.0, 3.0], np.float32))
    # Same bytes, other dtype or shape: not the same constant.
    zero_f = g.add_initializer("zero_f", np.zeros((1, 3), np.float32))
    zero_i = g.add_initializer("zero_i", np.zeros((1, 3), np.int32))
    zero_flat = g.add_initializer("zero_flat", np.zeros(3, np.float32))
    cast = g.op("Cast", zero_i, to=1)
    g.outputs = [g.op("Sub", g.op("Mul", x, c1), g.op("Mul", x, c2)),
                 g.op("Sum", g.op("Add", x, zero_f), g.op("Add", x, zero_flat), g.op("Add", x, cast))]
    check_pass(cse, g, X)
    assert sorted(g.initializers) == ["c1", "zero_f", "zero_flat", "zero_i"]
    assert ops(g).count("Mul") == 1


def test_large_initializers_are_not_compared(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 2048))
    big = np.ones(2048, np.float32)  # 8 KiB, above the default cap
    g.outputs = [g.op("Add", g.op("Mul", x, g.add_initializer("a", big)), g.op("Mul", x, g.add_initializer("b", big)))]
    check_pass(cse, g, {"x": np.ones((2, 2048), np.float32)}, changes=False)
    assert cse(g, max_initializer_bytes=1 << 20) is True
    assert ops(g) == ["Mul", "Add"]


def test_graph_outputs_keep_their_names(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    inner = g.op("Relu", x, name="inner")
    g.outputs = [g.op("Exp", inner, name="out_a"), g.op("Exp", inner, name="out_b"), g.op("Relu", x, name="out_c")]
    # out_a and out_b are both outputs: merging would lose a name, so they stay. out_c is
    # merged into `inner`, which takes the name out_c.
    check_pass(cse, g, X)
    assert [v.name for v in g.outputs] == ["out_a", "out_b", "out_c"]
    assert ops(g) == ["Relu", "Exp", "Exp"]
    assert g.outputs[2] is g.nodes[0].outputs[0]


def test_body_nodes_merge_into_earlier_outer_nodes(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    cond = g.add_input("cond", "bool", ())
    outer = g.op("Exp", x)
    then = g.subgraph("then")
    then.outputs = [then.op("Add", then.op("Exp", x), then.op("Exp", x))]
    other = g.subgraph("else")
    other.outputs = [other.op("Exp", x)]  # a body output: stays in its body
    g.outputs = [g.op("Mul", outer, g.op("If", cond, then_branch=then, else_branch=other, outputs=1))]
    for flag in (True, False):
        g2 = g.copy()
        check_pass(cse, g2, {**X, "cond": np.array(flag)})
        assert ops(g2) == ["Exp", "If", "Mul", "Exp", "Add"]  # walk: bodies in attribute-name order
        add = g2.nodes[1].attrs["then_branch"].nodes[0]
        assert add.inputs[0] is add.inputs[1] is g2.nodes[0].outputs[0]


def test_nodes_with_bodies_are_left_alone(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    cond = g.add_input("cond", "bool", ())
    ifs = []
    for _ in range(2):
        then = g.subgraph("then")
        then.outputs = [then.op("Neg", x)]
        other = g.subgraph("else")
        other.outputs = [other.op("Relu", x)]
        ifs.append(g.op("If", cond, then_branch=then, else_branch=other, outputs=1))
    g.outputs = [g.op("Sub", *ifs)]
    check_pass(cse, g, {**X, "cond": np.array(True)}, changes=False)
