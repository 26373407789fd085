"""Algebraic simplification: each rule where it fires, where it must not, and output names."""
import numpy as np
import pytest

from kiln.ir import Graph
from kiln.ir.passes import RULES, infer_shapes, simplify
from kiln.ir.passes.simplify import Rule, remove_identity


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


def rand(*shape, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(2).normal(size=shape).astype(dtype)


def test_rules_are_named_data():
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    assert all(isinstance(r, Rule) and r.ops for r in RULES)


def test_identity_chain_removed_and_output_name_kept(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3))
    r = g.op("Relu", x)
    g.outputs = [g.op("Identity", g.op("Identity", r), name="out")]
    check_pass(simplify, g, {"x": rand(2, 3)})
    assert ops(g) == ["Relu"]
    assert g.outputs[0].name == "out" and g.outputs[0].producer.op == "Relu"


def test_identity_of_input_or_initializer_feeding_an_output_stays(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    c = g.add_initializer("c", np.ones(3, np.float32))
    g.outputs = [g.op("Identity", x, name="y"), g.op("Identity", c, name="z")]
    check_pass(simplify, g, {"x": rand(3)}, changes=False)


def test_identity_kept_for_an_output_is_not_read_by_nodes(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    y = g.op("Identity", x, name="y")
    g.outputs = [y, g.op("Neg", y)]
    check_pass(simplify, g, {"x": rand(3)})
    assert ops(g) == ["Identity", "Neg"] and g.outputs[1].producer.inputs[0] is x


def test_neutral_operation_on_an_input_becomes_identity(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    g.outputs = [g.op("Mul", x, g.add_initializer("one", np.ones(3, np.float32)), name="y")]
    check_pass(simplify, g, {"x": rand(3)})
    assert ops(g) == ["Identity"] and g.outputs[0].name == "y"


def test_inference_dropout_removed(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    off = g.add_initializer("off", np.array(False))
    ratio = g.add_initializer("ratio", np.array(0.5, np.float32))
    a = g.op("Dropout", g.op("Relu", x))
    b, _mask = g.op("Dropout", a, ratio, off, outputs=2)
    g.outputs = [g.op("Neg", b)]
    check_pass(simplify, g, {"x": rand(2, 3)})
    assert ops(g) == ["Relu", "Neg"]


def test_dropout_whose_mask_is_read_stays(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3))
    y, mask = g.op("Dropout", x, outputs=2)
    g.outputs = [g.op("Neg", y), mask]
    check_pass(simplify, g, {"x": rand(2, 3)}, changes=False)


NEUTRAL_CASES = [
    ("Mul", "x", 1.0), ("Mul", "c", 1.0), ("Add", "x", 0.0), ("Add", "c", 0.0), ("Sub", "x", 0.0), ("Div", "x", 1.0),
]


@pytest.mark.parametrize("op,first,value", NEUTRAL_CASES)
@pytest.mark.parametrize("c_shape", [(), (1,), (4,), (1, 1, 4)])
def test_neutral_elements(check_pass, op, first, value, c_shape):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3, 4))
    c = g.add_initializer("c", np.full(c_shape, value, np.float32))
    h = g.op("Relu", x)
    args = (h, c) if first == "x" else (c, h)
    g.outputs = [g.op("Exp", g.op(op, *args))]
    check_pass(simplify, g, {"x": rand(2, 3, 4)})
    assert ops(g) == ["Relu", "Exp"]


@pytest.mark.parametrize("op,first,value,c_shape", [
    ("Mul", "x", 1.0, (2, 3, 4)),   # broadcasts x to a bigger shape
    ("Add", "x", 0.0, (5, 1, 1)),   # idem
    ("Mul", "x", 1.0001, (4,)),     # not one
    ("Add", "x", 0.0, (4,)),        # then perturbed below: not all zeros
    ("Sub", "c", 0.0, (4,)),        # 0 - x is -x
    ("Div", "c", 1.0, (4,)),        # 1 / x is not x
])
def test_neutral_elements_must_not_fire(check_pass, op, first, value, c_shape):
    g = Graph()
    x = g.add_input("x", "float32", (3, 4))
    arr = np.full(c_shape, value, np.float32)
    if op == "Add" and c_shape == (4,):
        arr[2] = 1e-3
    c = g.add_initializer("c", arr)
    args = (g.op("Relu", x), c) if first == "x" else (c, g.op("Relu", x))
    g.outputs = [g.op("Exp", g.op(op, *args))]
    check_pass(simplify, g, {"x": np.abs(rand(3, 4)) + 0.5}, changes=False)


def test_neutral_element_of_other_dtype_does_not_fire(check_pass):
    g = Graph()
    x = g.add_input("x", "int32", ("batch", 4))
    g.outputs = [g.op("Neg", g.op("Mul", x, g.add_initializer("one", np.ones(4, np.int32))))]
    check_pass(simplify, g, {"x": np.arange(8, dtype=np.int32).reshape(2, 4)})
    assert ops(g) == ["Neg"]


def test_noop_reshape_and_reshape_of_reshape(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3, 4))

    def s(*dims):
        return g.add_constant(np.array(dims, np.int64), "s")

    same = g.op("Reshape", x, s(2, 3, 4))
    via = g.op("Reshape", g.op("Reshape", g.op("Relu", x), s(6, 4)), s(4, -1))
    back = g.op("Reshape", g.op("Reshape", g.op("Neg", x), s(24)), s(2, 3, 4))
    g.outputs = [g.op("Exp", same), via, back]
    check_pass(simplify, g, {"x": rand(2, 3, 4)})
    # The inner reshapes are left for DCE; the outer ones read the original tensor or vanish.
    assert ops(g).count("Reshape") == 3
    assert g.outputs[0].producer.inputs[0] is x
    assert g.outputs[1].producer.inputs[0].producer.op == "Relu"
    assert g.outputs[2].producer.op == "Neg"


def test_reshape_of_reshape_copying_dims_does_not_merge(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 3, 4))
    inner = g.op("Reshape", x, g.add_initializer("s1", np.array([6, 4], np.int64)))
    # 0 copies the inner result's dim 0 (6), not x's (2).
    g.outputs = [g.op("Reshape", inner, g.add_initializer("s2", np.array([0, 2, 2], np.int64)))]
    check_pass(simplify, g, {"x": rand(2, 3, 4)}, changes=False)


def test_transpose_pairs(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 3, 4))
    r = g.op("Relu", x)
    undo = g.op("Transpose", g.op("Transpose", r, perm=[0, 2, 1]), perm=[0, 2, 1])
    reverse_twice = g.op("Transpose", g.op("Transpose", r))
    composed = g.op("Transpose", g.op("Transpose", r, perm=[1, 0, 2]), perm=[2, 0, 1])
    g.outputs = [g.op("Exp", undo), g.op("Neg", reverse_twice), composed]
    check_pass(simplify, g, {"x": rand(2, 3, 4)})
    exp, neg = g.outputs[0].producer, g.outputs[1].producer
    assert exp.inputs[0] is r and neg.inputs[0] is r
    last = g.outputs[2].producer
    assert last.inputs[0] is r and last.attrs["perm"] == (2, 1, 0)


def test_cast_to_same_dtype(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    same = g.op("Cast", g.op("Relu", x), to=1)
    other = g.op("Cast", same, to=11)
    g.outputs = [other]
    check_pass(simplify, g, {"x": rand(3)})
    assert ops(g) == ["Relu", "Cast"]


def test_rules_apply_inside_bodies_but_keep_body_outputs(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    cond = g.add_input("cond", "bool", ())
    then = g.subgraph("then")
    then.outputs = [then.op("Neg", then.op("Identity", x))]
    other = g.subgraph("else")
    other.outputs = [other.op("Identity", x)]  # an outer value: the Identity must stay
    g.outputs = [g.op("If", cond, then_branch=then, else_branch=other, outputs=1)]
    for flag in (True, False):
        g2 = g.copy()
        check_pass(simplify, g2, {"x": rand(3), "cond": np.array(flag)})
        assert ops(g2) == ["If", "Identity", "Neg"]  # else_branch walks first


def test_custom_rule_table(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (3,))
    g.outputs = [g.op("Neg", g.op("Cast", g.op("Identity", x), to=1))]
    check_pass(lambda graph: simplify(graph, [Rule("only_identity", frozenset({"Identity"}), remove_identity)]),
               g, {"x": rand(3)})
    assert ops(g) == ["Cast", "Neg"]


def _linear_on_rows(g, x, k, n, *, trans_b=False, bias=True, alpha=1.0, beta=1.0, out_shape=None):
    """GPT-2's Conv1D as traced: flatten x's rows, Gemm, unflatten to x's leading dims (read from
    Shape(x), as the trace does, so a symbolic batch stays symbolic)."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(n, k) if trans_b else (k, n)).astype(np.float32)
    flat = g.op("Reshape", x, g.add_constant(np.array([-1, k], np.int64), "flat"))
    args = [flat, g.add_initializer(f"w{len(g.initializers)}", w)]
    if bias:
        args.append(g.add_initializer(f"b{len(g.initializers)}", rng.normal(size=n).astype(np.float32)))
    y = g.op("Gemm", *args, transB=int(trans_b), alpha=alpha, beta=beta)
    if out_shape is None:
        lead = g.op("Shape", x, start=0, end=x.type.rank - 1 if x.type.rank == 3 else 2)
        target = g.op("Concat", lead, g.add_constant(np.array([n], np.int64), "n"), axis=0)
    else:
        target = g.add_constant(np.array(out_shape, np.int64), "s")
    out = g.op("Reshape", y, target)
    infer_shapes(g)  # the whole graph's inference follows Shape values into the target (as after a trace)
    return out


@pytest.mark.parametrize("trans_b,bias,beta", [(False, True, 1.0), (True, True, 0.5), (False, False, 1.0)])
def test_gemm_between_flattens_becomes_matmul_and_bias(check_pass, trans_b, bias, beta):
    from kiln.ir.passes import dce
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 5, 8))
    g.outputs = [g.op("Relu", _linear_on_rows(g, x, 8, 6, trans_b=trans_b, bias=bias, beta=beta))]
    assert g.outputs[0].type.shape == ("batch", 5, 6)
    check_pass(lambda gr: simplify(gr) and (dce(gr) or True), g, {"x": rand(3, 5, 8)})
    assert "Gemm" not in ops(g) and ops(g).count("MatMul") == 1
    mm = next(n for n in g.nodes if n.op == "MatMul")
    assert mm.inputs[0] is x and mm.outputs[0].type.shape == ("batch", 5, 6)
    assert ("Add" in ops(g)) == bias


def test_gemm_between_flattens_merges_trailing_dims(check_pass):
    # x [batch, seq, heads, head_dim] flattened to [-1, heads * head_dim]: attention's output projection.
    from kiln.ir.passes import dce
    g = Graph()
    x = g.add_input("x", "float32", ("batch", 5, 2, 4))
    g.outputs = [_linear_on_rows(g, x, 8, 6)]
    check_pass(lambda gr: simplify(gr) and (dce(gr) or True), g, {"x": rand(2, 5, 2, 4)})
    assert "Gemm" not in ops(g)
    mm = next(n for n in g.nodes if n.op == "MatMul")
    assert mm.inputs[0].producer.op == "Reshape" and mm.inputs[0].type.shape == ("batch", 5, 8)


def test_gemm_between_flattens_must_not_fire(check_pass):
    g = Graph()
    x = g.add_input("x", "float32", (2, 5, 8))
    scaled = _linear_on_rows(g, x, 8, 6, alpha=2.0)                 # alpha is not 1
    swapped = _linear_on_rows(g, x, 8, 6, out_shape=(5, 2, 6))      # rows unflattened in another order
    flat = g.op("Reshape", x, g.add_constant(np.array([-1, 8], np.int64), "flat"))
    shared = g.op("Gemm", flat, g.add_initializer("w_shared", rand(8, 6)))  # the Gemm is read twice
    twice = g.op("Reshape", shared, g.add_constant(np.array([2, 5, 6], np.int64), "s"))
    dynamic_w = g.add_input("w", "float32", (8, 6))                 # a weight that is not a constant
    dyn = g.op("Reshape", g.op("Gemm", flat, dynamic_w), g.add_constant(np.array([2, 5, 6], np.int64), "s"))
    g.outputs = [scaled, swapped, twice, g.op("Neg", shared), dyn]
    check_pass(simplify, g, {"x": rand(2, 5, 8), "w": rand(8, 6)}, changes=False)
    assert ops(g).count("Gemm") == 4
