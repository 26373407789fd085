"""Op traits (ir/registry.py): declared on each op's @op, the op sets passes use are derived from them, and
each declaration is checked against the op's own reference implementation."""
import numpy as np
import pytest

from kiln.ir import evaluate
from kiln.ir.dtypes import DType
from kiln.ir.passes import ANCHOR_OPS, ELEMENTWISE_OPS
from kiln.ir.passes.cse import COMMUTATIVE
from kiln.ir.registry import TRAITS, get_schema, op, ops_with

from op_harness import build_single

ATTRS = {"Cast": {"to": DType.FLOAT32.value}}


def _sample(schema, position: int, rng, shape=(3, 5)) -> np.ndarray:
    """An input of the op's input parameter at ``position``: float32 where allowed (values in [0.5, 2):
    valid for Log, Sqrt, Pow, Reciprocal ...), else bool, else int64."""
    allowed = schema.input_param(position).types or frozenset()
    if not allowed or DType.FLOAT32 in allowed:
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if DType.BOOL in allowed:
        return rng.random(shape) < 0.5
    return rng.integers(1, 5, shape).astype(np.int64)


def _inputs(name: str, rng) -> list:
    schema = get_schema(name, "", 21)
    n = max(schema.min_inputs, 2 if schema.max_inputs is None else schema.min_inputs)
    return [_sample(schema, i, rng) for i in range(n)]


def _run(name: str, xs: list) -> np.ndarray:
    g, feeds = build_single(name, xs, ATTRS.get(name))
    return evaluate(g, feeds)[0]


def test_derived_sets_follow_the_declarations():
    assert {"Add", "Relu", "Where", "Cast"} <= set(ELEMENTWISE_OPS) and "MatMul" not in ELEMENTWISE_OPS
    assert set(ANCHOR_OPS) == {"Conv", "Gemm", "MatMul"}
    assert {"Add", "Mul", "Max", "Min"} <= set(COMMUTATIVE) and "Sub" not in COMMUTATIVE
    assert all("elementwise" in get_schema(n, "", 21).traits for n in ELEMENTWISE_OPS)
    assert frozenset({"Conv", "Foo"}) - ANCHOR_OPS == {"Foo"} and frozenset({"Gemm"}) <= ANCHOR_OPS
    with pytest.raises(ValueError, match="unknown trait"):
        ops_with("fast")
    with pytest.raises(ValueError, match="unknown trait"):
        op("Nothing", inputs=["X"], infer=lambda ctx: None, traits=("fast",))
    assert TRAITS == {"elementwise", "commutative", "anchor"}


@pytest.mark.parametrize("name", sorted(ops_with("elementwise")))
def test_elementwise_ops_commute_with_a_permutation_of_elements(name):
    """Output element i depends only on element i of each input: permuting every input's elements the same
    way permutes the output's (shape: the inputs' shape)."""
    rng = np.random.default_rng(0)
    xs = _inputs(name, rng)
    y = _run(name, xs)
    assert y.shape == xs[0].shape
    perm = rng.permutation(xs[0].size)
    yp = _run(name, [x.reshape(-1)[perm].reshape(x.shape) for x in xs])
    np.testing.assert_array_equal(yp.reshape(-1), y.reshape(-1)[perm])


@pytest.mark.parametrize("name", sorted(ops_with("commutative")))
def test_commutative_ops_do_not_depend_on_input_order(name):
    rng = np.random.default_rng(1)
    a, b = _inputs(name, rng)[:2]
    np.testing.assert_array_equal(_run(name, [a, b]), _run(name, [b, a]))


def test_the_extra_op_families_declare_no_trait():
    """The trait sets are read without importing kiln.ir.ops.EXTRA (a process that never meets one of those
    ops does not import them): they stay whole only while no extra op declares a trait."""
    from kiln.ir.ops import EXTRA
    from kiln.ir.registry import all_schemas

    extra = [s for s in all_schemas() if s.reference.__module__.rsplit(".", 1)[-1] in EXTRA]
    assert len({s.reference.__module__ for s in extra}) == len(EXTRA)
    assert [s.qualified_name for s in extra if s.traits] == []


def test_extra_op_families_are_imported_on_first_lookup():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import kiln
        from kiln.ir import Graph
        g = Graph("g")
        x = g.add_input("x", "float32", (2, 3))
        g.outputs = [g.op("Relu", x)]
        kiln.load(g).run([__import__("numpy").ones((2, 3), "float32")])
        from kiln.ir.ops import EXTRA
        print(sum(f"kiln.ir.ops.{m}" in sys.modules for m in EXTRA))
        from kiln.ir.registry import get_schema, has_op
        print(get_schema("Resize").name, has_op("LSTM"), has_op("NoSuchOp"))
        print(sum(f"kiln.ir.ops.{m}" in sys.modules for m in EXTRA) == len(EXTRA))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "Resize", "True", "False", "True"]
