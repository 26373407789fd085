"""Constant folding: what is known at compile time becomes initializers, within a size cap."""
import numpy as np

from kiln.ir import Graph, verify
from kiln.ir.passes import fold_constants, infer_shapes


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


def test_constant_chain_folds_in_one_run(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    a = g.add_initializer("a", rng.normal(size=3).astype(np.float32))
    b = g.add_initializer("b", rng.normal(size=3).astype(np.float32))
    s = g.op("Add", a, b, name="s")
    t = g.op("Mul", s, b, name="t")
    g.outputs = [g.op("Sub", x, t, name="y")]
    check_pass(fold_constants, g, {"x": rng.normal(size=(2, 3)).astype(np.float32)})
    assert ops(g) == ["Sub"]
    folded = g.nodes[0].inputs[1]
    # The folded value keeps the name its readers knew it by.
    assert folded.name == t.name and folded.is_initializer
    np.testing.assert_array_equal(folded.const, (a.const + b.const) * b.const)


def test_transposed_weight_is_folded_densely(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", (2, 4))
    w = g.add_initializer("w", rng.normal(size=(5, 4)).astype(np.float32))
    g.outputs = [g.op("MatMul", x, g.op("Transpose", w, perm=[1, 0]))]
    check_pass(fold_constants, g, {"x": rng.normal(size=(2, 4)).astype(np.float32)})
    assert ops(g) == ["MatMul"]
    wt = g.nodes[0].inputs[1].const
    assert wt.flags.c_contiguous
    np.testing.assert_array_equal(wt, w.const.T)


def test_shape_of_static_value_folds_but_symbolic_dim_does_not(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 4, 5))
    shape = g.op("Shape", x)
    dim1 = g.op("Gather", shape, g.add_initializer("one", np.array([1], np.int64)))
    dim0 = g.op("Gather", shape, g.add_initializer("zero", np.array([0], np.int64)))
    new_shape = g.op("Concat", dim0, dim1, g.add_initializer("rest", np.array([-1], np.int64)), axis=0)
    g.outputs = [g.op("Reshape", x, new_shape)]
    check_pass(fold_constants, g, {"x": rng.normal(size=(3, 4, 5)).astype(np.float32)})
    # Shape(x) and dim 0 depend on the batch size; dim 1 is known (4) although x's shape is not.
    assert ops(g) == ["Shape", "Gather", "Concat", "Reshape"]
    concat = g.nodes[2]
    assert concat.inputs[1].is_initializer
    np.testing.assert_array_equal(concat.inputs[1].const, [4])
    assert g.outputs[0].shape == ("batch", 4, 5)


def test_shape_and_size_of_static_input(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", (2, 6))
    y = g.add_input("y", "float32", (3, 4))
    reshaped = g.op("Reshape", y, g.op("Shape", x))
    count = g.op("Cast", g.op("Size", x), to=1)
    g.outputs = [g.op("Mul", reshaped, count)]
    check_pass(fold_constants, g, {"x": np.zeros((2, 6), np.float32), "y": rng.normal(size=(3, 4)).astype(np.float32)})
    assert ops(g) == ["Reshape", "Mul"]
    np.testing.assert_array_equal(g.nodes[1].inputs[1].const, np.float32(12))


def test_size_cap_keeps_large_generated_constants(rng):
    g = Graph()
    x = g.add_input("x", "float32", (512, 1024))
    big = g.op("ConstantOfShape", g.add_initializer("shape", np.array([512, 1024], np.int64)),
               value=np.array([2.0], np.float32))
    g.outputs = [g.op("Add", x, big)]
    infer_shapes(g)
    assert fold_constants(g) is False
    assert ops(g) == ["ConstantOfShape", "Add"]
    assert fold_constants(g, max_bytes=4 << 20) is True
    assert ops(g) == ["Add"]
    verify(g)


def test_size_cap_allows_outputs_no_larger_than_inputs(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", (1, 1024))
    w = g.add_initializer("w", rng.normal(size=(1024, 512)).astype(np.float32))  # 2 MiB
    g.outputs = [g.op("MatMul", x, g.op("Neg", w))]
    check_pass(fold_constants, g, {"x": rng.normal(size=(1, 1024)).astype(np.float32)}, rtol=1e-4)
    assert ops(g) == ["MatMul"]


def test_transpose_of_a_large_weight_stays_a_view(rng):
    """Folding it would copy the weight, rename it and store tied weights twice."""
    g = Graph()
    ids = g.add_input("ids", "int64", (3,))
    emb = g.add_initializer("wte.weight", rng.normal(size=(16, 8)).astype(np.float32))  # 512 bytes, tied
    h = g.op("Gather", emb, ids)
    g.outputs = [g.op("MatMul", h, g.op("Transpose", emb))]
    assert not fold_constants(g)
    assert ops(g) == ["Gather", "Transpose", "MatMul"] and list(g.initializers) == ["wte.weight"]
    small = Graph()
    x = small.add_input("x", "float32", (1, 4))
    w = small.add_initializer("w", np.ones((4, 4), np.float32))
    small.outputs = [small.op("MatMul", x, small.op("Transpose", w))]
    assert fold_constants(small) and ops(small) == ["MatMul"]


def test_constant_graph_output_keeps_its_name(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2,))
    c = g.add_initializer("c", np.array([1.0, 2.0], np.float32))
    const_out = g.op("Add", c, c, name="doubled")
    also_read = g.op("Mul", const_out, c)
    g.outputs = [g.op("Mul", x, also_read), const_out]
    check_pass(fold_constants, g, {"x": np.array([-1.0, 1.0], np.float32)})
    # An output cannot be an initializer: an Identity of the folded value keeps the name,
    # while readers read the constant itself (so Mul(doubled, c) folds in the same run).
    assert ops(g) == ["Identity", "Mul"]
    assert g.outputs[1].name == "doubled" and g.outputs[1].producer.op == "Identity"
    np.testing.assert_array_equal(g.nodes[0].inputs[0].const, [2.0, 4.0])
    np.testing.assert_array_equal(g.nodes[1].inputs[1].const, [2.0, 8.0])


def test_constant_node_and_unused_outputs(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (4,))
    k = g.op("Constant", value=np.array([4.0, 3.0, 2.0, 1.0], np.float32))
    first, _unused = g.op("Split", k, num_outputs=2, outputs=2)
    g.outputs = [g.op("Mul", x, g.op("Concat", first, first, axis=0))]
    check_pass(fold_constants, g, {"x": np.ones(4, np.float32)})
    assert ops(g) == ["Mul"]
    np.testing.assert_array_equal(g.nodes[0].inputs[1].const, [4.0, 3.0, 4.0, 3.0])


def test_not_folded_nodes():
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    c = g.add_initializer("c", np.ones(3, np.float32))
    # Depends on an input; fails at evaluation (index 5 of 3): both left for run time.
    y = g.op("Add", x, c)
    g.op("ScatterND", c, g.add_initializer("at", np.array([[5]], np.int64)), g.add_initializer("v", np.ones(1, np.float32)))
    g.outputs = [y]
    verify(g)
    assert fold_constants(g) is False
    assert ops(g) == ["Add", "ScatterND"]


def test_folds_inside_if_branches_but_not_the_if(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    cond = g.add_input("cond", "bool", ())
    c = g.add_initializer("c", np.arange(3, dtype=np.float32))
    then = g.subgraph("then")
    then.outputs = [then.op("Add", x, then.op("Mul", c, c))]
    other = g.subgraph("else")
    other.outputs = [other.op("Neg", x)]
    g.outputs = [g.op("If", cond, then_branch=then, else_branch=other, outputs=1)]
    for flag in (True, False):
        g2 = g.copy()
        check_pass(fold_constants, g2, {"x": np.ones(3, np.float32), "cond": np.array(flag)})
        assert ops(g2) == ["If", "Neg", "Add"]  # else_branch walks first
        # The folded constant lives in the branch that reads it.
        assert list(g2.nodes[0].attrs["then_branch"].initializers) == [then.nodes[0].outputs[0].name]
