"""kiln.Guard on the CUDA backend: device values are checked by a kernel writing a record, read
once per run; host values (shape arithmetic) at once; captured CUDA graphs hold the guard
kernels and check every replay; a failed guard raises the same GuardFailed as the CPU runtime,
before any output is returned, and does not disable graph capture for its signature.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.checks import GuardFailed  # noqa: E402
from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402

ATTRS = {"what": "w", "location": "m.py:7", "code": "if x.sum() > 0:"}


def _guarded(read: str, expected, dtype="float32", shape=(4, 8), reduce="ReduceSum", rtol=0.0) -> Graph:
    """x -> [reduce ->] Guard; output relu(x) * 2 (a few kernels, so graphs are captured)."""
    g = Graph("guarded")
    x = g.add_input("x", dtype, list(shape))
    v = g.op(reduce, x, keepdims=0) if reduce else x
    if read == "bool":
        v = g.op("Greater", v, g.add_constant(np.array(0, dtype)))
    g.add_node("Guard", [v], {"expected": np.asarray(expected), "read": read, "rtol": rtol, **ATTRS},
               domain="kiln", num_outputs=0)
    y = g.op("Relu", x)
    y = g.op("Mul", y, g.add_constant(np.array(2, dtype)))
    g.outputs = [g.op("Add", y, g.add_constant(np.array(1, dtype)))]
    infer_shapes(g)
    return g


CASES = [
    ("bool", np.array(True), lambda: np.ones((4, 8), np.float32), lambda: -np.ones((4, 8), np.float32)),
    ("int", np.array(32, np.int64), lambda: np.ones((4, 8), np.float32), lambda: np.full((4, 8), 2, np.float32)),
    ("float", np.array(32.0), lambda: np.ones((4, 8), np.float32), lambda: np.full((4, 8), 1.1, np.float32)),
]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("read,expected,good,bad", CASES, ids=[c[0] for c in CASES])
def test_device_guard_passes_and_refuses(read, expected, good, bad, graphs):
    g = _guarded(read, expected, rtol=1e-5 if read == "float" else 0.0)
    p = CudaProgram(g, output="numpy", cuda_graphs=graphs)
    for _ in range(3):  # first run captures, later ones replay
        np.testing.assert_allclose(p.run([good()], as_list=True)[0], evaluate(g, [good()])[0], rtol=1e-6)
        with pytest.raises(GuardFailed, match=r"kiln.Guard failed at m.py:7 `if x.sum\(\) > 0:`"):
            p.run([bad()])
    if graphs:
        assert p.captured_graphs() == 1 and not p.graph_failures


def test_value_read_reports_the_first_differing_element():
    g = Graph("values")
    x = g.add_input("x", "int64", [5])
    g.add_node("Guard", [x], {"expected": np.arange(5), "read": "value", **ATTRS}, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Neg", x)]
    infer_shapes(g)
    p = CudaProgram(g, output="numpy", cuda_graphs=False)
    np.testing.assert_array_equal(p.run([np.arange(5)], as_list=True)[0], -np.arange(5))
    bad = np.arange(5)
    bad[3] = 9
    with pytest.raises(GuardFailed, match=r"this input gives 9 at flat index 3 \(where the trace saw 3\)"):
        p.run([bad])


def test_host_shape_guard_needs_no_device_read():
    g = Graph("shape")
    x = g.add_input("x", "float32", ["batch", 3])
    n = g.op("Shape", x, start=0, end=1)
    ok = g.op("Greater", n, g.add_constant(np.array([2], np.int64)))
    g.add_node("Guard", [g.op("Squeeze", ok, g.add_constant(np.array([0], np.int64)))],
               {"expected": np.array(True), "read": "bool", **ATTRS}, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Relu", x)]
    infer_shapes(g)
    p = CudaProgram(g, output="numpy")
    p.run([np.ones((4, 3), np.float32)])
    with pytest.raises(GuardFailed, match="gave True while the model was traced; this input gives False"):
        p.run([np.ones((2, 3), np.float32)])


def test_guard_matches_the_cpu_runtime_on_random_inputs():
    import kiln

    g = _guarded("bool", np.array(True), reduce="ReduceMean")
    cpu, gpu = kiln.load(g), CudaProgram(g, output="numpy")
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        outcomes = []
        for p in (cpu, gpu):
            try:
                outcomes.append(np.asarray(p.run([x], as_list=True)[0]))
            except GuardFailed:
                outcomes.append("refused")
        refused = [isinstance(o, str) for o in outcomes]
        assert refused[0] == refused[1]
        if not refused[0]:
            np.testing.assert_allclose(outcomes[1], outcomes[0], rtol=1e-6)
