"""Program.run's fast paths (issue 5): the remembered input signatures must never let a bad input
through or change an error, the plan's per-arity step kinds must run every instruction shape as
the general loop did, and Gemm's Linear-layer closure must match the op's reference."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import InputError
from kiln.ir import Graph, evaluate
from kiln.runtime import Program
from kiln.runtime.plan import execute


def two_inputs() -> Graph:
    g = Graph("two")
    a = g.add_input("a", "float32", ("batch", 2))
    b = g.add_input("b", "float32", ("batch", 2))
    g.outputs = [g.op("Add", a, b)]
    return g


def test_a_remembered_signature_still_rejects_bad_inputs():
    p = Program(two_inputs())
    a = np.ones((3, 2), np.float32)
    for _ in range(2):  # the second run takes the remembered signature
        np.testing.assert_array_equal(p.run([a, a])[p.outputs[0].name], a + a)
        np.testing.assert_array_equal(p.run({"a": a, "b": a}, as_list=True)[0], a + a)
    with pytest.raises(InputError, match=r"input 'b': expected float32\[batch,2\], got float32\[4, 2\] \(batch=3"):
        p.run([a, np.ones((4, 2), np.float32)])
    with pytest.raises(InputError, match=r"input 'a': expected float32\[batch,2\], got float64\[3, 2\]"):
        p.run([a.astype(np.float64), a])
    with pytest.raises(InputError, match=r"missing \['b'\], unexpected \['c'\]"):
        p.run({"a": a, "c": a})
    with pytest.raises(InputError, match="takes 2 inputs"):
        p.run([a])
    # Other iterables take the full check, as before; so does a signature seen
    # only with a bad partner.
    np.testing.assert_array_equal(p.run(iter([a, a]), as_list=True)[0], a + a)
    np.testing.assert_array_equal(p.run((a, a), as_list=True)[0], a + a)
    with pytest.raises(InputError, match=r"got float32\[3, 2\] \(batch=4"):
        p.run([np.ones((4, 2), np.float32), a])


def test_the_signature_cache_is_bounded():
    p = Program(two_inputs())
    for n in range(1, Program.ACCEPTED_MAX + 10):
        x = np.ones((n, 2), np.float32)
        np.testing.assert_array_equal(p.run([x, x], as_list=True)[0], x + x)
        assert len(p._accepted) <= Program.ACCEPTED_MAX


def test_outputs_are_the_callers_own(tmp_path):
    """A constant output read from a file is a read-only view of it: the caller gets a copy."""
    g = Graph("const_out")
    x = g.add_input("x", "float32", (2,))
    c = g.add_initializer("c", np.arange(2, dtype=np.float32))
    g.outputs = [g.op("Add", x, c), c]
    p = kiln.load(kiln.save(g, tmp_path / "const_out.kiln"))
    for _ in range(2):
        y, k = p.run([np.ones(2, np.float32)], as_list=True)
        assert y.flags.writeable and k.flags.writeable
        k[:] = 7  # must not reach the model's constant
    np.testing.assert_array_equal(p.run([np.zeros(2, np.float32)], as_list=True)[1], [0, 1])


def test_step_kinds_cover_every_arity():
    """Unary (Relu), binary (Add), ternary (Gemm, Clip with an omitted input), four-input
    (Concat: the general branch) and multi-output (Split) instructions."""
    rng = np.random.default_rng(0)
    g = Graph("kinds")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", rng.standard_normal((4, 4)).astype(np.float32))
    bias = g.add_initializer("bias", rng.standard_normal(4).astype(np.float32))
    lo = g.add_initializer("lo", np.float32(-0.5))
    h = g.op("Relu", g.op("Gemm", x, w, bias, transB=1))
    h = g.op("Add", h, x)
    h = g.op("Clip", h, lo, None)
    s1, s2 = g.op("Split", h, axis=1, num_outputs=2, outputs=2)
    g.outputs = [g.op("Concat", s2, s1, s1, s2, axis=1)]
    p = Program(g)
    kinds = {step[-1] for step in p.plan.steps}
    assert {4, 5, 6, 1, 0} <= kinds
    for batch in (1, 3, 3):
        xa = rng.standard_normal((batch, 4)).astype(np.float32)
        (want,) = evaluate(g, [xa])
        np.testing.assert_allclose(p.run([xa], as_list=True)[0], want, rtol=1e-5, atol=1e-6)
        slots = list(p._template)
        slots[p.plan.input_slots[0]] = xa
        execute(p.plan, slots)  # releases leave only the inputs, constants and outputs
        live = {i for i, v in enumerate(slots) if v is not None}
        assert live <= set(p.plan.input_slots) | set(p.plan.output_slots) | \
            {i for i, v in enumerate(p._template) if v is not None}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("attrs", [{}, {"transB": 1}, {"alpha": 0.5}, {"beta": 2.0, "transB": 1},
                                   {"transA": 1}])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemm_constant_weight_matches_reference(dtype, attrs, rows):
    rng = np.random.default_rng(rows)
    g = Graph("gemm")
    a_shape = (6, rows) if attrs.get("transA") else (rows, 6)
    x = g.add_input("x", dtype, a_shape)
    w_shape = (3, 6) if attrs.get("transB") else (6, 3)
    w = g.add_initializer("w", rng.standard_normal(w_shape).astype(dtype))
    bias = g.add_initializer("bias", rng.standard_normal(3).astype(dtype))
    g.outputs = [g.op("Gemm", x, w, bias, **attrs)]
    p = kiln.load(g, optimize=False)
    xa = rng.standard_normal(a_shape).astype(dtype)
    (want,) = evaluate(g, [xa])
    for _ in range(2):
        got = p.run([xa], as_list=True)[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_constant_and_pass_through_outputs_are_copies():
    import numpy as np

    from kiln.ir import Graph
    from kiln.runtime import Program

    g = Graph("g")
    x = g.add_input("x", "float32", (3,))
    c = g.add_initializer("c", np.arange(3, dtype=np.float32))
    g.outputs = [x, c, g.op("Relu", x)]
    program = Program(g)
    feed = np.ones(3, np.float32)
    out_x, out_c, _ = program.run([feed], as_list=True)
    out_x[:] = 7
    out_c[:] = 7
    assert (feed == 1).all()  # the caller's input is not handed back to be written through
    np.testing.assert_array_equal(program.run([feed], as_list=True)[1], np.arange(3, dtype=np.float32))
