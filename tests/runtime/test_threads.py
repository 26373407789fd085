"""BLAS threads on a busy host (issue 21): a run drops to one BLAS thread while the host's cores are all taken,
and goes back to the program's count when they free up. Behaviour only (which count is set); the speed is
bench/busy_host_bench.py's."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.runtime import threads

BLAS = threads.blas()
needs_blas = pytest.mark.skipif(BLAS is None, reason="numpy's BLAS thread count cannot be set here")


def mlp() -> Graph:
    g = Graph("mlp")
    x = g.add_input("x", "float32", ["batch", 64])
    w = g.add_initializer("w", np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    g.outputs = [g.op("Relu", g.op("MatMul", x, w))]
    return g


@pytest.fixture
def restore_blas():
    before = BLAS.get() if BLAS is not None else None
    yield
    if BLAS is not None:
        threads.blas_threads(before)


def blas_count(n: int) -> int:
    """The BLAS count a run of ``n`` threads sets: 1 where kiln's products run on the native GEMM's threads."""
    return threads._blas_count(n)


@needs_blas
def test_blas_entry_points_set_and_read_the_count(monkeypatch, restore_blas):
    monkeypatch.setattr(threads, "_OWN_GEMM", [False])
    threads.blas_threads(1)
    assert BLAS.get() == 1 and BLAS.current == 1
    threads.blas_threads(2)
    assert BLAS.get() == 2


@needs_blas
def test_with_kilns_own_gemm_the_blas_stays_at_one_thread(monkeypatch, restore_blas):
    """Where kiln's products run on the native extension's GEMM, a run's threads are its threads, and numpy's
    BLAS (left with small products) is kept at one, so that its workers never spin beside them."""
    monkeypatch.setattr(threads, "_OWN_GEMM", [True])
    threads.blas_threads(2)
    assert BLAS.get() == 1 and threads.kernel_threads() == 2
    p = kiln.load(mlp(), threads=2)
    p.threads.adaptive = False
    p.run({"x": np.ones((4, 64), np.float32)})
    assert BLAS.get() == 1 and threads.kernel_threads() == 2
    monkeypatch.setattr(threads, "_OWN_GEMM", [False])
    p.run({"x": np.ones((4, 64), np.float32)})
    assert BLAS.get() == 2 and threads.kernel_threads() == 2


@needs_blas
def test_a_run_uses_one_thread_while_the_host_is_busy_and_the_cap_otherwise(monkeypatch, restore_blas):
    runnable = {"n": 1}
    monkeypatch.setattr(threads, "runnable_tasks", lambda: runnable["n"])
    monkeypatch.setattr(threads, "SAMPLE_SECONDS", 0.0)
    p = kiln.load(mlp(), threads=2)
    p.threads.cores = 2  # as on a 2-core host, whatever this one has
    x = np.ones((4, 64), np.float32)
    want = np.maximum(x @ p.graph.initializers["w"].const, 0)
    p.run({"x": x})
    # kiln's own parallel kernels (the native convolutions) follow the same count
    assert BLAS.get() == blas_count(2) and threads.kernel_threads() == 2 and p.threads.busy_runs == 0
    runnable["n"] = 9  # eight other tasks on two cores
    np.testing.assert_allclose(p.run({"x": x})[p.outputs[0].name], want, rtol=1e-5, atol=1e-5)
    assert BLAS.get() == 1 and threads.kernel_threads() == 1 and p.threads.busy_runs == 1
    runnable["n"] = 2  # this run and its own team's second thread: quiet again
    p.run({"x": x})
    assert BLAS.get() == blas_count(2) and threads.kernel_threads() == 2 and p.threads.busy_runs == 1


@needs_blas
def test_threads_one_never_raises_the_count_and_threads_must_be_positive(restore_blas):
    p = kiln.load(mlp(), threads=1)
    threads.blas_threads(2)
    p.run({"x": np.ones((2, 64), np.float32)})
    assert BLAS.get() == 1 and not p.threads.adaptive
    for bad in (0, -1, 1.5, True):
        with pytest.raises(KilnError, match="threads= must be a positive int"):
            kiln.load(mlp(), threads=bad)


HOG = """
import os, sys, time
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import numpy as np
a = np.random.default_rng(0).random((128, 128), dtype=np.float32)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    a = (a @ a) * 1e-3 + 0.5
"""


@needs_blas
def test_under_real_load_runs_go_single_threaded_and_stay_right(restore_blas):
    """Busy neighbours (bounded: each stops itself after 20 s, and is terminated at the end) make the
    kernel's runnable count pass the cores: the program notices it and its answers do not change."""
    cores = threads.usable_cores()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, "20"]) for _ in range(2 * cores + 2)]
    try:
        p = kiln.load(mlp(), threads=2)
        x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
        want = np.maximum(x @ p.graph.initializers["w"].const, 0)
        deadline = time.monotonic() + 15
        while p.threads.busy_runs == 0 and time.monotonic() < deadline:
            out = p.run({"x": x})
            np.testing.assert_allclose(list(out.values())[0], want, rtol=1e-5, atol=1e-5)
            time.sleep(threads.SAMPLE_SECONDS)
        assert p.threads.busy_runs > 0, f"the runnable count never passed {cores} cores: {threads.runnable_tasks()}"
        assert BLAS.get() == 1
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.wait(timeout=10)


def test_usable_cores_is_positive_and_at_most_the_affinity():
    import os
    n = threads.usable_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))


@needs_blas
def test_the_default_cap_is_the_process_start_count_not_the_last_run_s(restore_blas):
    kiln.load(mlp(), threads=1).run({"x": np.ones((2, 64), np.float32)})
    assert BLAS.get() == 1
    assert kiln.load(mlp()).threads.max_threads == BLAS.default
