"""Executors: ThreadExecutor and ProcessExecutor give Program.run's answers; worker processes stay free
of torch/onnx; a worker killed with SIGKILL fails its in-flight batch with WorkerError at once and is
replaced; a model that cannot load fails start(); close() stops every worker."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kiln
from kiln.errors import FormatError
from kiln.ir import Graph
from kiln.server.batcher import DynamicBatcher
from kiln.server.errors import WorkerError
from kiln.server.workers import Executor, ProcessExecutor, ThreadExecutor, blas_threads, worker_env

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"

pytestmark = pytest.mark.skipif(os.name != "posix", reason="worker processes use POSIX fd passing and signals")


def config(**kw):
    base = dict(max_batch_size=8, max_queue_delay_ms=1, queue_size=1000, timeout_ms=60000, workers=1, instances=1,
                version_policy={"latest": 1}, backend="kiln")
    base.update(kw)
    return SimpleNamespace(**base)


def arun(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def inputs(seed: int, rows: int = 1) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}


def assert_same(got: dict, want: dict) -> None:
    """The same outputs up to float rounding: a worker runs with fewer BLAS threads than this
    process, and OpenBLAS splits a large product differently by thread count (seen bit-different
    on an AMD EPYC, 3.6e-7 apart)."""
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def program():
    return kiln.load(MLP)


@pytest.fixture
def slow_model(tmp_path) -> Path:
    """x[batch, 512] through 100 chained 512x512 MatMul+Tanh: 4,000 rows are 200 GFLOP (seconds on a CPU),
    so the batch is surely still running when the test kills its worker."""
    rng = np.random.default_rng(0)
    g = Graph("slow")
    h = g.add_input("x", "float32", ("batch", 512))
    w = g.add_initializer("w", (rng.standard_normal((512, 512)) / 16).astype(np.float32))
    for _ in range(100):
        h = g.op("Tanh", g.op("MatMul", h, w))
    g.outputs = [h]
    path = tmp_path / "slow.kiln"
    kiln.save(g, path)
    return path


def test_thread_executor_runs_the_program(program):
    ex = ThreadExecutor(MLP, config(instances=2))
    assert not ex.ready
    ex.start()
    assert isinstance(ex, Executor) and ex.ready and ex.capacity == 2
    assert [s.name for s in ex.inputs] == ["x"] and [s.name for s in ex.outputs] == ["logits", "probs"]

    async def main():
        results = await asyncio.gather(*(ex.run(inputs(i, 1 + i % 3)) for i in range(20)))
        await ex.close()
        with pytest.raises(WorkerError):
            await ex.run(inputs(0))
        return results

    for i, got in enumerate(arun(main())):
        assert_same(got, program.run(inputs(i, 1 + i % 3)))
    assert not ex.ready


def test_process_executor_runs_the_program_in_workers_without_torch_or_onnx(program, monkeypatch):
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    ex = ProcessExecutor(MLP, config(workers=2, instances=2))
    ex.start()
    try:
        assert isinstance(ex, Executor) and ex.ready and ex.capacity == 4
        assert len(ex.pids) == 2 and os.getpid() not in ex.pids
        assert [s.name for s in ex.inputs] == ["x"] and [s.name for s in ex.outputs] == ["logits", "probs"]
        big = {"x": np.random.default_rng(5).standard_normal((20000, 16)).astype(np.float32)}  # > 1 MB payload

        async def main():
            small = await asyncio.gather(*(ex.run(inputs(i, 1 + i % 3)) for i in range(40)))
            return small, await ex.run(big), await ex.worker_info()

        small, big_out, infos = arun(main())
        for i, got in enumerate(small):
            assert_same(got, program.run(inputs(i, 1 + i % 3)))
        assert_same(big_out, program.run(big))
        assert sorted(info["pid"] for info in infos) == sorted(ex.pids)
        for info in infos:
            top = {m.split(".")[0] for m in info["modules"]}
            assert "kiln" in top and "numpy" in top
            # nothing heavy, and nothing inherited from this (pytest) process
            assert not top & {"torch", "onnx", "onnxruntime", "fastapi", "uvicorn", "pytest", "_pytest"}, top
            # BLAS threads: the cores but one (left to the HTTP process), shared by the 2 workers
            want = str(max(1, ((os.cpu_count() or 1) - 1) // 2))
            assert info["env"] == {var: want for var in THREAD_VARS}
    finally:
        arun(ex.close())


def test_worker_blas_threads_leave_a_core_to_the_server_unless_the_user_sets_them():
    assert [blas_threads(1, cpus) for cpus in (1, 2, 3, 8)] == [1, 1, 2, 7]
    assert [blas_threads(w, 16) for w in (1, 2, 4, 15, 16, 32)] == [15, 7, 3, 1, 1, 1]
    env = worker_env(1, {"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["PYTHONPATH"]
    assert {env[var] for var in THREAD_VARS} == {str(blas_threads(1))}
    # any variable the user set wins, and the others stay unset (OpenBLAS falls back to OMP_NUM_THREADS)
    env = worker_env(4, {"OMP_NUM_THREADS": "3"})
    assert env["OMP_NUM_THREADS"] == "3" and not any(var in env for var in THREAD_VARS[1:])


def test_killed_worker_fails_its_batch_promptly_and_is_replaced(slow_model):
    ex = ProcessExecutor(slow_model, config(workers=1))
    ex.start()
    try:
        [victim] = ex.pids
        x = {"x": np.random.default_rng(1).standard_normal((4000, 512)).astype(np.float32)}

        async def main():
            running = asyncio.create_task(ex.run(x))
            await asyncio.sleep(0.2)
            assert not running.done(), "the batch finished before the kill: make the slow model slower"
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match=rf"{victim}.*SIGKILL"):
                await asyncio.wait_for(running, 10.0)
            failed_after = time.monotonic() - t0
            deadline = time.monotonic() + 30
            while not (ex.pids and ex.pids[0] != victim):
                assert time.monotonic() < deadline, "no replacement worker"
                await asyncio.sleep(0.02)
            small = {"x": x["x"][:2]}
            return failed_after, await ex.run(small)

        failed_after, out = arun(main())
        assert failed_after < 5.0
        assert ex.restarts == 1 and ex.ready and ex.pids[0] != victim and not alive(victim)
        want = kiln.load(slow_model).run({"x": x["x"][:2]})
        assert_same(out, want)
    finally:
        arun(ex.close())


def test_worker_killed_while_idle_is_replaced_and_the_batcher_keeps_serving(program):
    ex = ProcessExecutor(MLP, config(workers=2))
    ex.start()
    try:
        victim = ex.pids[0]
        os.kill(victim, signal.SIGKILL)

        async def main():
            deadline = time.monotonic() + 10
            while victim in ex.pids:  # a request sent before the death is seen would be in flight: WorkerError
                assert time.monotonic() < deadline, "the death went unnoticed"
                await asyncio.sleep(0.001)
            b = DynamicBatcher(ex, config(workers=2), None, "mlp", "1")
            results = await asyncio.gather(*(b.submit(inputs(i, 2)) for i in range(50)))
            deadline = time.monotonic() + 30
            while len(ex.pids) < 2:
                assert time.monotonic() < deadline, "no replacement worker"
                await asyncio.sleep(0.02)
            return results

        for i, got in enumerate(arun(main())):
            for name, want in program.run(inputs(i, 2)).items():
                np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
        assert victim not in ex.pids and ex.restarts == 1
    finally:
        arun(ex.close())


def test_close_stops_every_worker_and_later_runs_fail():
    ex = ProcessExecutor(MLP, config(workers=2))
    ex.start()
    pids = ex.pids

    async def main():
        await ex.close()
        with pytest.raises(WorkerError, match="not running"):
            await ex.run(inputs(0))

    arun(main())
    assert not ex.ready
    assert not any(alive(p) for p in pids)


def test_model_that_cannot_load_fails_start(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(b"not a kiln file at all")
    ex = ProcessExecutor(bad, config(workers=2))
    with pytest.raises(FormatError):
        ex.start()
    assert not ex.ready and ex.pids == []
