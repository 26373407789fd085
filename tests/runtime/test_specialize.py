"""Plans specialized per input signature (runtime/specialize.py): shape computations folded after a signature's
second run, guarded, exactly the generic plan's answers."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import kiln
from kiln.ir import Graph, evaluate
from kiln.runtime import Program
from kiln.runtime import specialize
from kiln.runtime.plan import execute

RNG = np.random.default_rng(7)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def attention_reshapes() -> Graph:
    """[batch, seq, 12] -> [batch, seq, 3, 4] -> [batch, 3, seq, 4] -> back, its targets computed from Shape
    as a traced model with a dynamic batch computes them."""
    g = Graph("reshapes")
    x = g.add_input("x", "float32", ["batch", "seq", 12])
    w = g.add_initializer("w", rand(12, 12))
    h = g.op("MatMul", x, w)
    shape = g.op("Shape", h)
    b = g.op("Gather", shape, g.add_initializer("i0", np.array(0, np.int64)), axis=0)
    s = g.op("Gather", shape, g.add_initializer("i1", np.array(1, np.int64)), axis=0)
    ub, us = (g.op("Unsqueeze", v, g.add_initializer(f"ax{n}", np.array([0], np.int64))) for n, v in ((0, b), (1, s)))
    heads = g.op("Concat", ub, us, g.add_initializer("hd", np.array([3, 4], np.int64)), axis=0)
    split = g.op("Transpose", g.op("Reshape", h, heads), perm=[0, 2, 1, 3])
    back = g.op("Concat", ub, us, g.add_initializer("m1", np.array([-1], np.int64)), axis=0)
    y = g.op("Reshape", g.op("Transpose", g.op("Relu", split), perm=[0, 2, 1, 3]), back)
    g.outputs = [y, g.op("Mul", shape, g.add_initializer("two", np.array(2, np.int64)))]
    return g


def test_a_signatures_shape_computations_are_folded_from_its_second_run():
    g = attention_reshapes()
    program = Program(g)
    spec = program._specializer
    assert spec is not None and spec.candidates
    for batch, seq in ((2, 5), (1, 5), (2, 5), (2, 5), (3, 7), (2, 5), (3, 7), (3, 7)):
        x = rand(batch, seq, 12)
        got = program.run([x], as_list=True)
        want = evaluate(g, [x])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[1], want[1])
    special = spec.specialized(((2, 5, 12), np.dtype(np.float32)))
    assert special is not None and special.folded >= 8  # Shape, 2 Gathers, 2 Unsqueezes, 2 Concats, the Mul
    kept = [ins.node.op for ins in special.plan.instructions]
    assert "Concat" not in kept and "Gather" not in kept and "Unsqueeze" not in kept
    assert kept.count("Shape") == 1  # Shape of a computed value: a guard in its place
    assert spec.specialized(((1, 5, 12), np.dtype(np.float32))) is None  # seen once: not specialized
    assert spec.specialized(((3, 7, 12), np.dtype(np.float32))) is not None


def test_specialized_runs_match_the_generic_plan_bit_for_bit():
    g = attention_reshapes()
    program, generic = Program(g), Program(g)
    generic._specializer = None
    x = rand(2, 6, 12)
    for _ in range(4):
        for got, want in zip(program.run([x], as_list=True), generic.run([x], as_list=True)):
            np.testing.assert_array_equal(got, want)


def test_folded_outputs_are_the_callers_own():
    """An output that is a folded value comes back as a fresh writeable array on every run."""
    g = attention_reshapes()
    program = Program(g)
    x = rand(2, 3, 12)
    outs = [program.run([x], as_list=True)[1] for _ in range(4)]
    for o in outs:
        assert o.flags.writeable
        np.testing.assert_array_equal(o, [4, 6, 24])
    outs[-1][:] = 0
    np.testing.assert_array_equal(program.run([x], as_list=True)[1], [4, 6, 24])


def test_no_run_writes_into_a_folded_value(monkeypatch):
    """A value folded from a shape (Neg(ConstantOfShape(Shape(x)))) that the generic plan overwrites in place (Add's
    variant writes into its dying input) stays as recorded: the specialized runs (and the recording run itself)
    make a fresh result instead."""
    from kiln.runtime import plan as plan_module
    monkeypatch.setattr(plan_module, "INPLACE_MIN_BYTES", 0)
    g = Graph("inplace")
    x = g.add_input("x", "float32", ["batch", 16])
    ones = g.op("Neg", g.op("ConstantOfShape", g.op("Shape", x), value=np.array([1.0], np.float32)))
    g.outputs = [g.op("Add", ones, x)]
    program = Program(g)
    assert [ins.inplace for ins in program.plan.instructions if ins.node.op == "Add"] == [0]
    x = rand(4, 16)
    for _ in range(5):
        np.testing.assert_array_equal(program.run([x], as_list=True)[0], x - 1)
    assert program._specializer.specialized(((4, 16), np.dtype(np.float32))) is not None


def test_a_shape_the_signature_does_not_fix_is_caught_by_its_guard():
    """Shape of NonZero's output depends on the data, not on the input's shape: the guard sees the change, the
    call starts over on the generic plan (right answer), one warning says so, and the signature stays generic."""
    g = Graph("nonzero")
    x = g.add_input("x", "float32", [6])
    nz = g.op("NonZero", x)
    count = g.op("Gather", g.op("Shape", nz), g.add_initializer("one", np.array(1, np.int64)), axis=0)
    g.outputs = [g.op("Mul", count, g.add_initializer("ten", np.array(10, np.int64)))]
    program = Program(g)
    a = np.array([1, 0, 2, 0, 3, 0], np.float32)
    b = np.array([1, 1, 1, 1, 0, 0], np.float32)
    assert int(program.run([a], as_list=True)[0]) == 30
    assert int(program.run([a], as_list=True)[0]) == 30  # the second run: recorded, specialized
    spec = program._specializer
    assert spec.specialized(((6,), np.dtype(np.float32))) is not None
    with pytest.warns(RuntimeWarning, match="runs without specialization"):
        assert int(program.run([b], as_list=True)[0]) == 40
    assert spec.specialized(((6,), np.dtype(np.float32))) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert int(program.run([a], as_list=True)[0]) == 30
        assert int(program.run([b], as_list=True)[0]) == 40


def test_ops_with_side_effects_are_never_folded():
    """Only ops the IR may fold: a kiln.Assert on a shape runs in every run, specialized or not."""
    g = Graph("assert")
    x = g.add_input("x", "float32", ["batch", 4])
    batch = g.op("Gather", g.op("Shape", x), g.add_initializer("zero", np.array(0, np.int64)), axis=0)
    g.op("Assert", g.op("Less", batch, g.add_initializer("four", np.array(4, np.int64))), domain="kiln",
         outputs=0, message="at most 3 rows")
    g.outputs = [g.op("Relu", x)]
    program = Program(g)
    ops = {program.plan.instructions[i].node.op for i in program._specializer.candidates}
    assert ops == {"Shape", "Gather", "Less"}
    for _ in range(3):
        program.run([rand(2, 4)])
    special = program._specializer.specialized(((2, 4), np.dtype(np.float32)))
    assert [ins.node.op for ins in special.plan.instructions] == ["Assert", "Relu"]
    for _ in range(3):
        with pytest.raises(AssertionError, match="at most 3 rows"):
            program.run([rand(5, 4)])


def test_large_values_stay_in_the_plan(monkeypatch):
    monkeypatch.setattr(specialize, "FOLD_MAX_BYTES", 64)
    g = Graph("large")
    x = g.add_input("x", "float32", ["batch", 32])
    g.outputs = [g.op("Add", g.op("ConstantOfShape", g.op("Shape", x), value=np.array([2.0], np.float32)), x)]
    program = Program(g)
    x = rand(3, 32)
    for _ in range(3):
        np.testing.assert_array_equal(program.run([x], as_list=True)[0], x + 2)
    special = program._specializer.specialized(((3, 32), np.dtype(np.float32)))
    assert [ins.node.op for ins in special.plan.instructions] == ["ConstantOfShape", "Add"]


def test_the_signature_table_is_bounded(monkeypatch):
    monkeypatch.setattr(specialize, "SIGNATURES_MAX", 4)
    program = Program(attention_reshapes())
    for seq in range(1, 12):
        for _ in range(2):
            program.run([rand(1, seq, 12)])
        assert len(program._specializer._table) <= 4


def test_a_model_without_shape_computations_has_no_specializer():
    g = Graph("plain")
    x = g.add_input("x", "float32", ["batch", 4])
    g.outputs = [g.op("Relu", x)]
    assert Program(g)._specializer is None


def test_the_profiler_times_the_specialized_plan(tmp_path):
    from kiln.runtime.profile import profile_program
    program = Program(attention_reshapes())
    p = profile_program(program, [rand(2, 4, 12)], runs=3)
    ops = {s.op for s in p.ops}
    assert "Concat" not in ops and "MatMul" in ops


def test_a_traced_dynamic_batch_model_is_specialized(tmp_path):
    torch = pytest.importorskip("torch")
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    path = kiln.save(kiln.trace(layer, (x,), dynamic_batch=True), tmp_path / "enc.kiln")
    program = kiln.load(path)
    for batch in (1, 3, 3, 3, 1, 1):
        xb = torch.randn(batch, 5, 16)
        with torch.inference_mode():
            want = layer(xb).numpy()
        np.testing.assert_allclose(program.run([xb.numpy()], as_list=True)[0], want, rtol=1e-4, atol=1e-5)
    for batch in (1, 3):
        special = program._specializer.specialized(((batch, 5, 16), np.dtype(np.float32)))
        assert special is not None and special.folded > 0
        assert len(special.plan.instructions) < len(program.plan.instructions)
        slots = list(special.template)
        slots[special.plan.input_slots[0]] = np.zeros((batch, 5, 16), np.float32)
        execute(special.plan, slots)  # the plan runs on its own (no generic step needed)


def test_kiln_bench_says_when_its_runs_took_a_specialized_plan(tmp_path, capsys):
    from kiln.cli import main
    path = kiln.save(attention_reshapes(), tmp_path / "reshapes.kiln")
    assert main(["bench", str(path), "--batch", "2", "--dim", "seq=3", "--warmup", "1", "--repeat", "3"]) == 0
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plan ")]
    assert len(plan) == 1 and "specialized to these input shapes" in plan[0]
    special = [int(w) for w in plan[0].replace(",", " ").split() if w.isdigit()]
    assert special[0] < len(Program(attention_reshapes()).plan.instructions) and special[1] >= 8


def qkv_split(batch="batch") -> Graph:
    """A packed QKV projection split into heads as torch's MultiheadAttention exports it: Reshape -> Unsqueeze ->
    Transpose -> Squeeze -> Gather (q, k, v) -> Reshape -> Transpose, then the products; every link a view."""
    g = Graph("qkv")
    x = g.add_input("x", "float32", [5, batch, 8])
    qkv = g.op("MatMul", x, g.add_initializer("w", rand(8, 24)))
    c = g.add_initializer
    parts = g.op("Squeeze", g.op("Transpose", g.op("Unsqueeze", g.op("Reshape", qkv, c("s3", np.array([5, -1, 3, 8]))),
                                                   c("a0", np.array([0]))), perm=[3, 1, 2, 0, 4]),
                 c("a3", np.array([3])))
    q, k, v = (g.op("Gather", parts, c(f"i{n}", np.array(n)), axis=0) for n in range(3))
    heads = [g.op("Transpose", g.op("Reshape", t, c(f"h{n}", np.array([5, -1, 4]))), perm=[1, 0, 2])
             for n, t in enumerate((q, k, v))]
    scores = g.op("MatMul", heads[0], g.op("Transpose", heads[1], perm=[0, 2, 1]))
    g.outputs = [g.op("MatMul", g.op("Softmax", scores, axis=-1), heads[2]), g.op("Relu", heads[2])]
    return g


def test_view_chains_are_made_direct_with_the_same_answers():
    g = qkv_split()
    program, generic = Program(g), Program(g)
    generic._specializer = None
    for batch in (1, 2, 1, 1, 2, 2, 2):
        x = rand(5, batch, 8)
        for got, want in zip(program.run([x], as_list=True), generic.run([x], as_list=True)):
            np.testing.assert_array_equal(got, want)
    special = program._specialized([rand(5, 1, 8)])  # every link a view: the heads made from the MatMul's output
    assert special is not None and special.views == 14
    kept = [ins.node.op for ins in special.plan.instructions]
    assert kept == ["MatMul", "Transpose", "Transpose", "Transpose", "MatMul", "Softmax", "MatMul", "Relu"]
    assert all(ins.inputs == special.plan.instructions[0].outputs for ins in special.plan.instructions[1:4])
    # At batch 2 a head's Reshape copies (its Gather's view is not contiguous): the chains break there.
    special = program._specialized([rand(5, 2, 8)])
    assert special is not None and 4 <= special.views < 14
    out = program.run([rand(5, 2, 8)], as_list=True)[1]
    assert out.flags.writeable  # a view of a fresh result, as the chain gave


def test_a_source_of_another_layout_starts_the_call_over_on_the_generic_plan():
    """A direct view checks its source's layout: a kernel handing back another one (here the products made to
    return Fortran-ordered results) sends the call to the generic plan, with one warning."""
    g = qkv_split()
    program, generic = Program(g), Program(g)
    generic._specializer = None
    x = rand(5, 2, 8)
    for _ in range(3):
        program.run([x])
    special = program._specialized([x])
    at = next(k for k, ins in enumerate(special.plan.instructions) if ins.node.op == "MatMul")
    kernel, *rest = special.plan.steps[at]
    special.plan.steps[at] = (lambda a, b: np.asfortranarray(kernel(a, b)), *rest)
    with pytest.warns(RuntimeWarning, match="strides"):
        got = program.run([x], as_list=True)
    for o, w in zip(got, generic.run([x], as_list=True)):
        np.testing.assert_array_equal(o, w)
    assert program._specialized([x]) is None  # that signature stays generic


def test_views_of_graph_inputs_stay_in_the_plan():
    """The caller decides an input's layout: a chain over one is never made direct, so a non-contiguous input
    after the plan was specialized on contiguous ones runs without a fallback."""
    g = Graph("input_views")
    x = g.add_input("x", "float32", [4, 6])
    r = g.op("Reshape", x, g.add_initializer("s", np.array([2, 2, 6])))
    g.outputs = [g.op("Relu", g.op("Transpose", r, perm=[0, 2, 1]))]
    program = Program(g)
    a = rand(4, 6)
    for _ in range(3):
        program.run([a])
    special = program._specialized([a])
    assert special is None or special.views == 0
    b = np.asfortranarray(rand(4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(program.run([b], as_list=True)[0], evaluate(g, [b])[0])


def test_a_reshape_target_read_through_a_read_only_alias_is_read_each_call():
    """The same read-only array, its contents changed through a writeable alias between calls: every call reshapes
    to what it holds then (nothing is remembered by the array's identity)."""
    g = Graph("target_input")
    x = g.add_input("x", "float32", [6])
    s = g.add_input("s", "int64", [2])
    g.outputs = [g.op("Relu", g.op("Reshape", x, s))]
    program = Program(g)
    backing = np.array([2, 3], np.int64)
    target = backing.view()
    target.flags.writeable = False
    a = rand(6)
    for _ in range(3):
        assert program.run([a, target], as_list=True)[0].shape == (2, 3)
    backing[:] = [3, 2]
    np.testing.assert_array_equal(program.run([a, target], as_list=True)[0], np.maximum(a, 0).reshape(3, 2))
