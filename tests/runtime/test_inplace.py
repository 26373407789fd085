"""In-place outputs (issue 5): a kernel writes its result into an input whose value dies there.

Every test compares the in-place plan with the same graph's plan built with ``inplace=False``
(and, where it matters, with the IR reference) and checks that nothing the caller or the model
owns is written: graph inputs, constants, graph outputs, and values still visible through a view.
That in-place writes really happen is checked by buffer identity: a recording slot list keeps
each slot's first value, so an in-place output is the very array its input was.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kiln.ir import Graph, evaluate
from kiln.ir.passes import infer_shapes
from kiln.runtime import Program
from kiln.runtime.kernels import cpu
from kiln.runtime import plan as plan_module
from kiln.runtime.plan import FRESH_OPS, PlanBuilder, _is_fresh, execute, ufunc_inplace
from kiln.runtime.program import _choose_cpu

F32 = np.float32


@pytest.fixture(autouse=True)
def inplace_at_any_size(monkeypatch, request):
    """These tests use small arrays: let them run in place (the default skips outputs of a
    static size under INPLACE_MIN_BYTES; test_small_static_outputs_stay_out_of_place checks that)."""
    if "default_threshold" not in request.keywords:
        monkeypatch.setattr(plan_module, "INPLACE_MIN_BYTES", 0)


def plain(program: Program) -> Program:
    """``program`` with its plan rebuilt without in-place variants."""
    builder = PlanBuilder(_choose_cpu)
    other = Program.__new__(Program)
    other.__dict__.update(program.__dict__)
    other.plan = builder.build(program.graph, inplace=False)
    other._template = builder.template
    other._specializer = None  # the generic plan on every run (the program's own specializes from its second)
    return other


def inplace_ops(program: Program) -> list:
    """(op, overwritten input) of every instruction running an in-place variant."""
    return [(ins.node.op, ins.inplace) for ins in program.plan.instructions if ins.inplace >= 0]


class Recording(list):
    """A slot list that remembers the first value written to each slot (releases write None)."""

    def __init__(self, items):
        super().__init__(items)
        self.first: dict = {}

    def __setitem__(self, i, v):
        if v is not None:
            self.first.setdefault(i, v)
        super().__setitem__(i, v)


def record(program: Program, feeds: list) -> dict:
    """Run ``program``; return {Value: the array first written for it}."""
    slots = Recording(program._template)
    for s, a in zip(program.plan.input_slots, feeds):
        slots[s] = a
    execute(program.plan, slots)
    return {v: slots.first.get(s) for ins in program.plan.instructions
            for v, s in zip(ins.node.outputs, ins.outputs)}


def check_same(g: Graph, feeds: list, *, runs: int = 2) -> Program:
    """In-place and plain plans agree exactly with each other (and with the reference up to fast
    kernels' rounding), run after run, and leave the caller's inputs and the model's constants as they were."""
    program = Program(g)
    before = [f.copy() for f in feeds]
    consts = {name: v.const.copy() for name, v in g.initializers.items()}
    want = evaluate(g, [f.copy() for f in feeds])
    baseline = plain(program)
    for _ in range(runs):
        got, base = program.run(feeds, as_list=True), baseline.run(feeds, as_list=True)
        for w, o, b in zip(want, got, base):
            assert o.dtype == w.dtype and o.shape == w.shape
            np.testing.assert_array_equal(o, b)  # the same kernels: bit for bit
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)  # fast kernels may round
    for b, f in zip(before, feeds):
        np.testing.assert_array_equal(f, b)
    for name, v in g.initializers.items():
        np.testing.assert_array_equal(v.const, consts[name])
    return program


def rand(rng: np.random.Generator, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(F32)


# --------------------------------------------------------------------------- the basic cases


def test_a_chain_of_elementwise_ops_reuses_one_buffer(rng):
    g = Graph("chain")
    x = g.add_input("x", "float32", ["batch", 8])
    c = g.add_initializer("c", rand(rng, 8))
    a = g.op("Add", x, c)             # fresh: x is the caller's
    r = g.op("Relu", a)               # into a
    m = g.op("Mul", r, r)             # x * x, into r
    n = g.op("Neg", m)                # into m
    g.outputs = [g.op("Div", n, c)]   # into n
    program = check_same(g, [rand(rng, 3, 8)])
    assert inplace_ops(program) == [("Relu", 0), ("Mul", 0), ("Neg", 0), ("Div", 0)]
    seen = record(program, [rand(rng, 3, 8)])
    assert seen[r] is seen[a] and seen[m] is seen[a] and seen[n] is seen[a] and seen[g.outputs[0]] is seen[a]


def test_graph_inputs_and_constants_are_never_written(rng):
    g = Graph("pinned")
    x = g.add_input("x", "float32", [4])
    c = g.add_initializer("c", rand(rng, 4))
    t = g.op("Identity", c)           # the constant itself
    u = g.op("Transpose", c)          # a view of the constant
    y = g.op("Relu", g.op("Neg", x))  # Neg reads the caller's x: not in place; Relu then is
    g.outputs = [g.op("Add", g.op("Relu", t), g.op("Abs", u)), y]
    program = check_same(g, [rand(rng, 4)], runs=3)
    assert inplace_ops(program) == [("Relu", 0), ("Add", 0)]


def test_a_value_seen_through_a_live_view_is_not_overwritten(rng):
    """a is reshaped; Relu(a) must not write into a while the reshape is still to be read."""
    g = Graph("view")
    x = g.add_input("x", "float32", [2, 6])
    a = g.op("Add", x, x)
    v = g.op("Reshape", a, g.add_initializer("shape", np.array([3, 4], np.int64)))
    r = g.op("Relu", a)
    back = g.op("Reshape", r, g.add_initializer("shape2", np.array([3, 4], np.int64)))
    g.outputs = [g.op("Sub", v, back)]
    program = check_same(g, [rand(rng, 2, 6)])
    relu = next(ins for ins in program.plan.instructions if ins.node.op == "Relu")
    assert relu.inplace == -1
    # The Sub reads a view of Relu's fresh output that dies with it, but that view is not a
    # buffer's owner: Sub writes into neither (v still aliases a, and back is a view).
    assert inplace_ops(program) == []


def test_a_view_that_died_earlier_does_not_block(rng):
    g = Graph("dead_view")
    x = g.add_input("x", "float32", [2, 6])
    a = g.op("Add", x, x)
    v = g.op("Reshape", a, g.add_initializer("shape", np.array([12], np.int64)))
    s = g.op("Sigmoid", v)    # v's last reader (a fresh kernel: s shares nothing with a)
    r = g.op("Relu", a)       # a dies here and v is dead: in place
    g.outputs = [g.op("Mul", r, g.op("Reshape", s, g.add_initializer("back", np.array([2, 6], np.int64))))]
    program = check_same(g, [rand(rng, 2, 6)])
    assert ("Relu", 0) in inplace_ops(program)


def test_graph_outputs_and_their_views_are_kept(rng):
    g = Graph("outputs")
    x = g.add_input("x", "float32", [3, 4])
    a = g.op("Add", x, x)
    b = g.op("Mul", x, x)
    flat = g.op("Reshape", b, g.add_initializer("shape", np.array([12], np.int64)))
    g.outputs = [a, g.op("Relu", a), flat, g.op("Neg", b)]
    program = check_same(g, [rand(rng, 3, 4)])
    assert inplace_ops(program) == []


def test_residual_add_writes_into_the_input_that_dies(rng):
    """y = Relu(x + c); out = y + Relu(y): the second Relu keeps y alive, the Add overwrites."""
    g = Graph("residual")
    x = g.add_input("x", "float32", ["batch", 5])
    y = g.op("Relu", g.op("Add", x, g.add_initializer("c", rand(rng, 5))))
    z = g.op("Relu", y)
    g.outputs = [g.op("Add", y, z)]
    program = check_same(g, [rand(rng, 4, 5)])
    assert inplace_ops(program) == [("Relu", 0), ("Add", 0)]
    assert next(ins for ins in program.plan.instructions if ins.node.outputs[0] is z).inplace == -1


def test_the_input_that_fits_the_output_is_the_one_written(rng):
    """Add(bias-shaped, full-shaped): the full one (input 1) takes the result."""
    g = Graph("broadcast")
    x = g.add_input("x", "float32", [4])
    w = g.add_input("w", "float32", [3, 4])
    small = g.op("Relu", x)
    big = g.op("Neg", w)
    g.outputs = [g.op("Sub", small, big)]
    program = check_same(g, [rand(rng, 4), rand(rng, 3, 4)])
    assert inplace_ops(program) == [("Sub", 1)]
    seen = record(program, [rand(rng, 4), rand(rng, 3, 4)])
    assert seen[g.outputs[0]] is seen[big]


def test_x_plus_x_with_both_arguments_the_dying_value(rng):
    g = Graph("double")
    x = g.add_input("x", "float32", [6])
    a = g.op("Neg", x)
    g.outputs = [g.op("Add", a, a)]
    program = check_same(g, [rand(rng, 6)])
    assert inplace_ops(program) == [("Add", 0)]


def test_another_argument_viewing_the_dying_value_blocks(rng):
    """Sub(a, transpose(a)): the transpose is a view of a, so a is not overwritten."""
    g = Graph("self_view")
    x = g.add_input("x", "float32", [4, 4])
    a = g.op("Neg", x)
    g.outputs = [g.op("Sub", a, g.op("Transpose", a))]
    program = check_same(g, [rand(rng, 4, 4)])
    assert inplace_ops(program) == []


def test_integer_and_half_types(rng):
    g = Graph("dtypes")
    i = g.add_input("i", "int32", [5])
    h = g.add_input("h", "float16", [5])
    g.outputs = [g.op("Abs", g.op("Mul", i, i)), g.op("Relu", g.op("Neg", h)),
                 g.op("Div", g.op("Add", i, i), g.add_initializer("three", np.full(5, 3, np.int32)))]
    program = check_same(g, [rng.integers(-9, 9, 5).astype(np.int32), rand(rng, 5).astype(np.float16)])
    # Integer Div keeps the reference (truncating): no variant; the others write in place.
    assert sorted(inplace_ops(program)) == [("Abs", 0), ("Relu", 0)]


# --------------------------------------------------------------------------- control flow


def test_if_branches_neither_write_nor_expose_outer_values(rng):
    """A branch returns the outer a itself; Relu of the If's result must not write into a,
    which is read afterwards; inside the branches nothing runs in place."""
    g = Graph("if")
    c = g.add_input("c", "bool", [])
    x = g.add_input("x", "float32", [4])
    a = g.op("Neg", x)
    then_g = g.subgraph("then")
    then_g.outputs = [then_g.op("Identity", a)]
    else_g = g.subgraph("else")
    else_g.outputs = [else_g.op("Relu", else_g.op("Add", a, a))]
    picked = g.op("If", c, then_branch=then_g, else_branch=else_g)
    r = g.op("Relu", picked)
    g.outputs = [g.op("Sub", r, a)]
    infer_shapes(g)
    for cond in (True, False):
        program = check_same(g, [np.array(cond), rand(rng, 4)])
        # Only Sub may write in place (into r, fresh from Relu); the If result is not a root.
        assert inplace_ops(program) == [("Sub", 0)]


def test_loop_bodies_run_without_inplace(rng):
    """acc = Relu(acc + w) M times; the body's Add output dies at the Relu, but bodies stay plain."""
    g = Graph("loop")
    acc0 = g.add_input("acc0", "float32", [3])
    w = g.add_input("w", "float32", [3])
    body = g.subgraph("body")
    body.add_input("i", "int64", [])
    cond = body.add_input("cond", "bool", [])
    acc = body.add_input("acc", "float32", [3])
    body.outputs = [cond, body.op("Relu", body.op("Add", acc, w))]
    out = g.op("Loop", g.add_initializer("m", np.array(4, np.int64)), g.add_initializer("t", np.array(True)),
               g.op("Neg", acc0), body=body)
    g.outputs = [g.op("Add", out, w)]
    infer_shapes(g)
    feeds = [rand(rng, 3), rand(rng, 3)]
    program = check_same(g, feeds)
    assert inplace_ops(program) == []  # the Loop's result may be its carried input: not a root
    built = PlanBuilder(_choose_cpu).build(body, liveness=False)
    assert all(ins.inplace == -1 for ins in built.instructions)


# --------------------------------------------------------------------------- random graphs


def random_graph(seed: int) -> tuple[Graph, list]:
    """A random DAG of elementwise ops and views (reshapes, transposes, Identity) over [2, 4, 4]
    values, with constants and views of constants mixed in and random values made outputs."""
    rng = np.random.default_rng(seed)
    g = Graph(f"random{seed}")
    shape = (2, 4, 4)
    inputs = [g.add_input(f"x{k}", "float32", list(shape)) for k in range(2)]
    const = g.add_initializer("c", rand(rng, *shape))
    row = g.add_initializer("row", rand(rng, 4) + 3.0)
    flat = g.add_initializer("flat", np.array([8, 4], np.int64))
    full = g.add_initializer("full", np.array(shape, np.int64))
    pool = [*inputs, const, g.op("Transpose", const, perm=[0, 2, 1])]
    for _ in range(int(rng.integers(4, 14))):
        a = pool[int(rng.integers(len(pool)))]
        b = pool[int(rng.integers(len(pool)))]
        kind = int(rng.integers(8))
        if kind < 3:
            v = g.op(["Add", "Sub", "Mul"][kind], a, b if rng.random() < 0.8 else row)
        elif kind == 3:
            v = g.op("Div", a, row) if rng.random() < 0.5 else g.op("Div", row, g.op("Abs", a))
        elif kind == 4:
            v = g.op(["Relu", "Neg", "Abs", "Sqrt"][int(rng.integers(4))], a)
        elif kind == 5:
            v = g.op("Reshape", g.op("Reshape", a, flat), full)
        elif kind == 6:
            v = g.op("Transpose", a, perm=[0, 2, 1])
        else:
            v = g.op("Identity", a)
        pool.append(v)
    made = pool[4:]
    extra = [v for v in made[:-1] if rng.random() < 0.3]
    g.outputs = list(dict.fromkeys(extra + [made[-1]]))
    infer_shapes(g)
    return g, [rand(rng, *shape) for _ in inputs]


def test_random_graphs_match_the_plain_plan_and_the_reference():
    """Four runs each: from the third, the specialized plan (runtime/specialize.py), its view chains made direct,
    runs with the in-place writes."""
    writes = direct = 0
    for seed in range(250):
        g, feeds = random_graph(seed)
        program = check_same(g, feeds, runs=4)
        writes += len(inplace_ops(program))
        special = program._specialized(feeds)
        direct += 0 if special is None else special.views
    assert writes > 100  # the generator does exercise in-place writes
    assert direct > 100  # and views made direct


# --------------------------------------------------------------------------- threads and kernels


def test_concurrent_runs_share_no_buffers(rng):
    g = Graph("threads")
    x = g.add_input("x", "float32", ["batch", 16])
    c = g.add_initializer("c", rand(rng, 16))
    h = g.op("Relu", g.op("Add", x, c))
    for _ in range(6):
        h = g.op("Add", g.op("Mul", h, c), g.op("Relu", g.op("Neg", h)))
    g.outputs = [h]
    program = Program(g)
    assert len(inplace_ops(program)) >= 10
    feeds = [rand(rng, 64, 16) for _ in range(8)]
    reference = plain(program)
    want = [reference.run([f], as_list=True)[0] for f in feeds]
    c_before = c.const.copy()
    errors: list = []

    def worker(k: int) -> None:
        try:
            for _ in range(40):
                np.testing.assert_array_equal(program.run([feeds[k]], as_list=True)[0], want[k])
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    np.testing.assert_array_equal(c.const, c_before)


FRESH_CASES = {
    "Shape": ([np.zeros((2, 3), F32)], {}),
    "MatMul": ([np.ones((2, 3), F32), np.ones((3, 4), F32)], {}),
    "Gemm": ([np.ones((2, 3), F32), np.ones((3, 4), F32), np.ones(4, F32)], {}),
    "Conv": ([np.ones((1, 2, 5, 5), F32), np.ones((3, 2, 1, 1), F32)], {}),
    "LayerNormalization": ([np.ones((2, 4), F32), np.ones(4, F32), np.zeros(4, F32)], {}),
    "Softmax": ([np.ones((2, 4), F32)], {}),
    "Gelu": ([np.ones((2, 4), F32)], {}),
    "Tanh": ([np.ones((2, 4), F32)], {}),
    "Sigmoid": ([np.ones((2, 4), F32)], {}),
    "Erf": ([np.ones((2, 4), F32)], {}),
    "Size": ([np.zeros((2, 3), F32)], {}),
    "ConvTranspose": ([np.ones((1, 2, 3, 3), F32), np.ones((2, 3, 1, 1), F32)], {}),
    "BatchNormalization": ([np.ones((2, 3, 2), F32), np.ones(3, F32), np.zeros(3, F32), np.zeros(3, F32),
                            np.ones(3, F32)], {}),
    "LogSoftmax": ([np.ones((2, 4), F32)], {}),
    "HardSigmoid": ([np.ones((2, 4), F32)], {}),
    "HardSwish": ([np.ones((2, 4), F32)], {}),
}


def test_every_fresh_op_is_checked():
    assert set(FRESH_CASES) == FRESH_OPS


@pytest.mark.parametrize("op", sorted(FRESH_CASES))
@pytest.mark.parametrize("const", [False, True], ids=["computed", "constant"])
def test_fresh_ops_return_new_arrays(op, const):
    """The plan takes the kernels of FRESH_OPS as fresh: their outputs share memory with no
    input, no constant, and nothing from an earlier run (all inputs constant, when asked)."""
    assert op in FRESH_OPS
    arrays, attrs = FRESH_CASES[op]
    g = Graph(op)
    values = [g.add_initializer(f"c{k}", a) if const or k else g.add_input(f"x{k}", a.dtype, a.shape)
              for k, a in enumerate(arrays)]
    g.outputs = [g.op(op, *values, **attrs)]
    program = Program(g)
    ins = program.plan.instructions[-1]
    assert _is_fresh(ins.kernel, ins.node)
    feeds = [] if const else [arrays[0].copy()]
    first = program.run(feeds, as_list=True)[0]
    second = program.run(feeds, as_list=True)[0]
    owned = [*feeds, *(v.const for v in g.initializers.values()), second]
    assert not any(np.shares_memory(first, a) for a in owned)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_div_and_sqrt_kernels_round_as_the_references_do(dtype):
    """The kernels call the ufunc in the dtype; the references compute in float64 and round:
    for / and sqrt the results are the same bits (zeros, infinities and NaN included)."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(dtype)
    b = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(dtype)
    a[:4], b[:4] = [0, 1, -1, np.inf], [0, 0, 0, np.inf]
    g = Graph("exact")
    x, y = g.add_input("x", np.dtype(dtype).name, [20000]), g.add_input("y", np.dtype(dtype).name, [20000])
    g.outputs = [g.op("Div", x, y), g.op("Sqrt", x)]
    got, want = Program(g).run([a, b], as_list=True), evaluate(g, [a, b])
    for o, w in zip(got, want):
        assert o.dtype == w.dtype
        np.testing.assert_array_equal(o.view(np.uint8), w.view(np.uint8))


def test_ufunc_variant_falls_back_when_it_cannot_write():
    into0 = ufunc_inplace(np.add, 0, 2, np.dtype(F32))
    small, big = np.ones((1, 3), F32), np.arange(6, dtype=F32).reshape(2, 3)
    out = into0(small, big)                       # the result is bigger than input 0
    assert out.shape == (2, 3) and not np.shares_memory(out, small)
    np.testing.assert_array_equal(small, np.ones((1, 3), F32))
    frozen = np.ones(3, F32)
    frozen.flags.writeable = False
    assert not np.shares_memory(into0(frozen, frozen), frozen)
    wide = np.ones(3, np.float64)                 # another dtype than the plan was built for
    assert into0(wide, np.ones(3, F32)).dtype == np.float64
    x = np.ones(3, F32)
    assert into0(x, np.ones(3, F32)) is x and x.tolist() == [2, 2, 2]
    scalar = np.add(np.ones((), F32), np.ones((), F32))   # a numpy scalar, not an array
    assert into0(scalar, np.ones((), F32)) == 3


def test_elementwise_kernels_declare_the_protocol():
    g = Graph("k")
    x = g.add_input("x", "float32", [3])
    for op in ("Relu", "Sqrt"):
        node = g.op(op, x).producer
        k = cpu.choose(node, node.schema.fill_attrs(node.attrs))
        assert k.fresh and set(k.inplace) == {0}
    node = g.op("Div", x, x).producer
    k = cpu.choose(node, node.schema.fill_attrs(node.attrs))
    assert k.fresh and set(k.inplace) == {0, 1}


@pytest.mark.default_threshold
def test_small_static_outputs_stay_out_of_place():
    def chain(shape):
        g = Graph("g")
        x = g.add_input("x", "float32", shape)
        y = g.op("Relu", g.op("Add", x, x))
        g.outputs = [g.op("Mul", y, y)]
        return Program(g)

    assert plan_module.INPLACE_MIN_BYTES > 4 * 8
    assert inplace_ops(chain((1, 8))) == []
    big = (1, plan_module.INPLACE_MIN_BYTES // 4)
    assert inplace_ops(chain(big)) and inplace_ops(chain(("batch", 8)))
