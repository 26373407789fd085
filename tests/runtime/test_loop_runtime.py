"""The CPU runtime paths a recurrent layer's Loop runs every time step (issue 15): the Loop
kernel's slot bookkeeping (carried values, read-only counters, scans, a cond), Gather of one
step by the run-time counter as a view, and Split into views. Each is checked against the IR
reference evaluator."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import infer_shapes
from kiln.runtime import Program
from kiln.runtime import control
from op_harness import build_single, check_backends

RNG = np.random.default_rng(5)


def _checked(g: Graph) -> Graph:
    infer_shapes(g)
    verify(g)
    return g


def _same(g: Graph, feeds: list) -> list:
    want = evaluate(g, feeds)
    got = Program(g).run(feeds, as_list=True)
    for w, o in zip(want, got):
        assert o.shape == w.shape and o.dtype == w.dtype
        np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)
    return got


def _body(g: Graph, carried: list) -> tuple:
    body = g.subgraph("body")
    i = body.add_input("body_i", "int64", [])
    cond = body.add_input("body_cond", "bool", [])
    values = [body.add_input(f"body_{k}", dt, shape) for k, (dt, shape) in enumerate(carried)]
    return body, i, cond, values


# ---------------------------------------------------------------------------- Loop
@pytest.mark.parametrize("trips", [0, 1, 4])
def test_carried_values_swapped_by_the_body(trips):
    """(a, b) -> (b + i, a): every carried output is read before any input slot is rewritten."""
    g = Graph("swap")
    a0 = g.add_input("a0", "float32", [3])
    b0 = g.add_input("b0", "float32", [3])
    body, i, cond, (a, b) = _body(g, [("float32", [3]), ("float32", [3])])
    body.outputs = [cond, body.op("Add", b, body.op("Cast", i, to=1)), a, a]
    m = g.add_initializer("m", np.array(trips, np.int64))
    g.outputs = list(g.op("Loop", m, None, a0, b0, body=body, outputs=3))
    _same(_checked(g), [RNG.standard_normal(3).astype(np.float32), RNG.standard_normal(3).astype(np.float32)])


def test_counters_past_the_shared_cache_and_read_only():
    """A trip count beyond the shared counters (fresh arrays from there on); the counters the body
    sees cannot be written."""
    trips = control._COUNTER_CAP + 100
    g = Graph("count")
    x = g.add_input("x", "int64", [])
    body, i, cond, (acc,) = _body(g, [("int64", [])])
    body.outputs = [cond, body.op("Add", acc, i), body.op("Identity", i)]
    m = g.add_initializer("m", np.array(trips, np.int64))
    g.outputs = list(g.op("Loop", m, None, x, body=body, outputs=2))
    total, seen = _same(_checked(g), [np.array(3, np.int64)])
    assert total == 3 + trips * (trips - 1) // 2
    np.testing.assert_array_equal(seen, np.arange(trips))
    counter = control._counters(10)[7]
    assert counter == 7 and not counter.flags.writeable


def test_while_loop_cond_from_the_body():
    """No trip count: the body's cond stops it (x doubles while below the limit)."""
    g = Graph("while")
    x0 = g.add_input("x0", "float32", [])
    limit = g.add_input("limit", "float32", [])
    body, _, _, (x,) = _body(g, [("float32", [])])
    doubled = body.op("Mul", x, body.add_initializer("two", np.array(2, np.float32)))
    body.outputs = [body.op("Less", doubled, limit), doubled, doubled]
    g.outputs = list(g.op("Loop", None, g.op("Less", x0, limit), x0, body=body, outputs=2))
    g = _checked(g)
    for start, lim in [(1.0, 100.0), (3.0, 4.0), (5.0, 2.0)]:
        _same(g, [np.array(start, np.float32), np.array(lim, np.float32)])


def test_concurrent_runs_share_the_counters():
    g = Graph("count")
    x = g.add_input("x", "int64", [])
    body, i, cond, (acc,) = _body(g, [("int64", [])])
    body.outputs = [cond, body.op("Add", acc, i)]
    m = g.add_input("m", "int64", [])
    g.outputs = [g.op("Loop", m, None, x, body=body)]
    program = Program(_checked(g))
    errors = []

    def work(n: int) -> None:
        for k in range(20):
            trips = (n * 37 + k * 101) % 3000
            got = program.run([np.array(0, np.int64), np.array(trips, np.int64)], as_list=True)[0]
            if got != trips * (trips - 1) // 2:
                errors.append((trips, int(got)))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---------------------------------------------------------------------------- Gather by a run-time index
def test_gather_by_a_computed_scalar_is_a_view():
    data = RNG.standard_normal((5, 2, 3)).astype(np.float32)
    g, feeds = build_single("Gather", [data, np.array(-2, np.int64)], {"axis": 0})
    kernel = Program(g).plan.instructions[0].kernel
    out = kernel(*feeds)
    assert np.shares_memory(out, data)
    np.testing.assert_array_equal(out, evaluate(g, feeds)[0])
    check_backends(g, [data, np.array(4, np.int64)], evaluate(g, [data, np.array(4, np.int64)]))
    with pytest.raises(IndexError, match="out of range"):
        kernel(data, np.array(5, np.int64))
    idx = np.array([[0, 2], [1, 1]], np.int64)  # not a scalar: np.take, as before
    g, feeds = build_single("Gather", [data, idx], {"axis": -1})
    check_backends(g, feeds, evaluate(g, feeds))


# ---------------------------------------------------------------------------- Split
SPLITS = [  # (shape, attrs, constant split sizes or None)
    ((2, 3, 8), {"axis": -1, "num_outputs": 4}, None),
    ((3, 8, 2), {"axis": 1}, [2, 6]),
    ((7, 2), {"axis": 0, "num_outputs": 3}, None),  # chunks 3, 3, 1
    ((2, 6), {"axis": 1}, [0, 6]),  # an empty part
]


def _fast_split(kernel) -> bool:
    return getattr(kernel, "__qualname__", "").startswith("split.")


@pytest.mark.parametrize("shape,attrs,sizes", SPLITS)
def test_split_gives_views_of_the_reference_parts(shape, attrs, sizes):
    x = RNG.standard_normal(shape).astype(np.float32)
    inputs = [x] if sizes is None else [x, np.array(sizes, np.int64)]
    n = attrs.get("num_outputs") or len(sizes)
    g, feeds = build_single("Split", inputs, attrs, const_inputs=(1,), num_outputs=n)
    kernel = Program(g).plan.instructions[0].kernel
    assert _fast_split(kernel)
    parts = kernel(x) if sizes is None else kernel(x, None)
    want = evaluate(g, feeds)
    assert len(parts) == len(want)
    for p, w in zip(parts, want):
        assert p.shape == w.shape and np.shares_memory(p, x) | (p.size == 0)
        np.testing.assert_array_equal(p, w)
    check_backends(g, feeds, want)


def test_split_falls_back_where_the_bounds_are_not_known_at_load():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    sizes = np.array([1, 5], np.int64)
    g, feeds = build_single("Split", [x, sizes], {"axis": 1}, num_outputs=2)  # sizes computed at run time
    assert not _fast_split(Program(g).plan.instructions[0].kernel)
    check_backends(g, feeds, evaluate(g, feeds))
    g, feeds = build_single("Split", [x], {"axis": 0, "num_outputs": 2}, symbolic_batch=True, num_outputs=2)
    assert not _fast_split(Program(g).plan.instructions[0].kernel)  # a symbolic axis
    check_backends(g, feeds, evaluate(g, feeds))
