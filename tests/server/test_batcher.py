"""DynamicBatcher: batch formation, the adaptive delay, shape groups, backpressure, timeouts, drain, error isolation.

Most tests drive the batcher with a fake executor that records the batches it is given and can be held
at a gate, so which requests were stacked together is observed directly, not inferred from timing. One
test runs the real MLP fixture on a ThreadExecutor with many concurrent requests and checks each
answer against ``Program.run`` on that request alone.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kiln
from kiln.errors import ExecutionError, InputError
from kiln.ir.batch_independence import BatchAnalysis
from kiln.ir.types import TensorType
from kiln.runtime.program import TensorSpec
from kiln.server.batcher import (BatchTooLarge, Draining, DynamicBatcher, QueueFull, RequestTimeout, WorkerError,
                                 batch_dim)
from kiln.server.workers import ThreadExecutor

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def config(**kw):
    base = dict(max_batch_size=4, max_queue_delay_ms=0, queue_size=64, timeout_ms=20000, workers=0, instances=1,
                version_policy={"latest": 1}, backend="kiln")
    base.update(kw)
    return SimpleNamespace(**base)


def arun(coro, timeout: float = 30.0):
    """Run a test coroutine with a hard bound, so a hang fails instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


class FakeExecutor:
    """y = 2x + 1 row by row; records each batch it runs and can hold runs at a gate."""

    # What a real executor reports from its model's graph: y = 2x + 1 is row-independent.
    batch_analysis = BatchAnalysis(True, "batch", "y = 2x + 1, row by row")

    def __init__(self, shape=("batch", 4), capacity: int = 1, out_shape=None):
        self.inputs = [TensorSpec("x", TensorType("float32", shape))]
        self.outputs = [TensorSpec("y", TensorType("float32", out_shape or shape))]
        self.capacity = capacity
        self.ready = True
        self.batches: list[np.ndarray] = []  # the x of every run, in order
        self.times: list[float] = []         # loop time at which each run started
        self.gate: asyncio.Event | None = None
        self.hold: asyncio.Event | None = None  # like gate, but holds only batches starting with a value < 0
        self.error: Exception | None = None

    def start(self) -> None:
        pass

    async def run(self, inputs):
        x = inputs["x"]
        self.batches.append(x.copy())
        self.times.append(asyncio.get_running_loop().time())
        if self.gate is not None:
            await self.gate.wait()
        if self.hold is not None and x.size and x.reshape(-1)[0] < 0:
            await self.hold.wait()
        if self.error is not None:
            raise self.error
        if np.isnan(x).any():
            raise ExecutionError("NaN in the input")
        return {"y": x * 2 + 1}

    async def close(self) -> None:
        pass

    @property
    def sizes(self):
        return [b.shape[0] for b in self.batches]


def x_of(value: float, rows: int = 1, width: int = 4) -> np.ndarray:
    return np.full((rows, width), value, np.float32)


async def blocked(ex: FakeExecutor, b: DynamicBatcher):
    """Occupy the executor's only slot with one request held at the gate; returns its task."""
    ex.gate = asyncio.Event()
    first = asyncio.create_task(b.submit({"x": x_of(-1)}))
    await until(lambda: len(ex.batches) == 1)
    return first


async def one_slot_busy(ex: FakeExecutor, b: DynamicBatcher):
    """Occupy one of the executor's slots (held until ``ex.hold`` is set), leaving the others free."""
    ex.hold = asyncio.Event()
    first = asyncio.create_task(b.submit({"x": x_of(-1)}))
    await until(lambda: len(ex.batches) == 1)
    return first


def check(result, x):
    np.testing.assert_array_equal(result["y"], x * 2 + 1)


def test_concurrent_requests_each_get_their_own_answer():
    """Many concurrent requests with distinct inputs through a real model: no mix-ups across a batch."""
    program = kiln.load(MLP)
    ex = ThreadExecutor(MLP, config(instances=2))
    ex.start()
    seen = []

    class Recorder:
        def observe_batch(self, model, version, size, queue_seconds, compute_seconds):
            seen.append((size, len(queue_seconds)))

        def set_queue_depth(self, model, version, n):
            pass

    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(300)]

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=8, max_queue_delay_ms=1, queue_size=1000, instances=2),
                           Recorder(), "mlp", "1")
        results = await asyncio.gather(*(b.submit({"x": x}) for x in xs))
        await b.close()
        return results

    results = arun(main())
    for x, got in zip(xs, results):
        want = program.run({"x": x})
        assert set(got) == {"logits", "probs"}
        for name in want:
            assert got[name].shape == want[name].shape
            # Batched GEMMs may round differently from a lone row; a mix-up would be off by far more.
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert sum(size for size, _ in seen) == sum(x.shape[0] for x in xs)
    assert max(n for _, n in seen) > 1, "requests should have been stacked"
    assert max(size for size, _ in seen) <= 8


def test_batches_fill_up_to_max_batch_size_in_arrival_order():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i)})) for i in range(10)]
        await until(lambda: b.queue_depth == 10)
        ex.gate.set()
        return await first, await asyncio.gather(*tasks)

    first, results = arun(main())
    assert ex.sizes == [1, 4, 4, 2]
    assert [list(b[:, 0]) for b in ex.batches[1:]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    check(first, x_of(-1))
    for i, r in enumerate(results):
        check(r, x_of(i))


def test_requests_of_several_rows_are_not_split_or_reordered():
    ex = FakeExecutor()
    rows = [3, 2, 1, 2, 2]

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i, n)})) for i, n in enumerate(rows)]
        await until(lambda: b.queue_depth == len(rows))
        ex.gate.set()
        await first
        return await asyncio.gather(*tasks)

    results = arun(main())
    # FIFO: a batch closes when the next request would not fit.
    assert ex.sizes == [1, 3, 3, 4]
    for i, (n, r) in enumerate(zip(rows, results)):
        check(r, x_of(i, n))


def test_lone_request_on_an_idle_executor_goes_at_once():
    ex = FakeExecutor(capacity=2)

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=8, max_queue_delay_ms=60_000), None, "m", "1")
        results = []
        for i in range(3):  # one after another: each finds the executor idle
            results.append(await asyncio.wait_for(b.submit({"x": x_of(i)}), 5.0))
        return results

    results = arun(main())
    assert ex.sizes == [1, 1, 1], "nothing waited for the one-minute delay"
    for i, r in enumerate(results):
        check(r, x_of(i))


def test_partial_batch_waits_for_max_queue_delay_while_another_slot_is_busy_and_takes_late_arrivals():
    ex = FakeExecutor(capacity=2)

    async def main():
        loop = asyncio.get_running_loop()
        b = DynamicBatcher(ex, config(max_batch_size=8, max_queue_delay_ms=300), None, "m", "1")
        first = await one_slot_busy(ex, b)
        t0 = loop.time()
        a = asyncio.create_task(b.submit({"x": x_of(1)}))
        await asyncio.sleep(0.02)
        late = asyncio.create_task(b.submit({"x": x_of(2)}))
        results = await asyncio.gather(a, late)
        ex.hold.set()
        return t0, results, await first

    t0, results, first = arun(main())
    assert ex.sizes == [1, 2], "the second request arrived within the delay and joins the first"
    waited = ex.times[1] - t0
    assert waited >= 0.29, f"dispatched after {waited:.3f} s, before the 300 ms delay"
    assert waited < 5.0
    check(results[0], x_of(1))
    check(results[1], x_of(2))
    check(first, x_of(-1))


def test_requests_queued_while_the_executor_is_busy_go_together_as_soon_as_it_frees_up():
    ex = FakeExecutor()

    async def main():
        loop = asyncio.get_running_loop()
        b = DynamicBatcher(ex, config(max_batch_size=8, max_queue_delay_ms=60_000), None, "m", "1")
        first = await blocked(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i)})) for i in range(3)]
        await until(lambda: b.queue_depth == 3)
        released = loop.time()
        ex.gate.set()
        await first
        return released, await asyncio.wait_for(asyncio.gather(*tasks), 5.0)

    released, results = arun(main())
    assert ex.sizes == [1, 3], "the partial batch went when the slot freed, not after the delay"
    assert ex.times[1] - released < 5.0
    for i, r in enumerate(results):
        check(r, x_of(i))


def test_full_batch_goes_without_waiting_for_the_delay():
    ex = FakeExecutor(capacity=2)

    async def main():
        loop = asyncio.get_running_loop()
        b = DynamicBatcher(ex, config(max_batch_size=4, max_queue_delay_ms=60_000), None, "m", "1")
        first = await one_slot_busy(ex, b)  # so the delay applies to partial batches
        t0 = loop.time()
        results = await asyncio.gather(*(b.submit({"x": x_of(i)}) for i in range(4)))
        # a fifth request alone cannot fill a batch: it is still waiting for the (one minute) delay
        fifth = asyncio.create_task(b.submit({"x": x_of(9)}))
        await asyncio.sleep(0.2)
        pending = not fifth.done()
        drain = asyncio.create_task(b.drain())  # draining stops the wait
        await until(fifth.done)
        ex.hold.set()
        await drain
        return loop.time() - t0, results, pending, await fifth, await first

    elapsed, results, pending, fifth, first = arun(main())
    assert ex.sizes == [1, 4, 1]
    assert elapsed < 10.0
    assert pending
    for i, r in enumerate(results):
        check(r, x_of(i))
    check(fifth, x_of(9))
    check(first, x_of(-1))


def test_requests_with_different_non_batch_dims_are_never_stacked_together():
    ex = FakeExecutor(shape=("batch", "n"))
    widths = [3, 5, 3, 5, 3, 7]

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=8), None, "m", "1")
        ex.gate = asyncio.Event()
        first = asyncio.create_task(b.submit({"x": x_of(-1, 1, 3)}))
        await until(lambda: len(ex.batches) == 1)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i, 1, w)})) for i, w in enumerate(widths)]
        await until(lambda: b.queue_depth == len(widths))
        ex.gate.set()
        await first
        return await asyncio.gather(*tasks)

    results = arun(main())
    # oldest group first: widths 3 (three requests), then 5 (two), then 7
    assert [b.shape for b in ex.batches[1:]] == [(3, 3), (2, 5), (1, 7)]
    for i, (w, r) in enumerate(zip(widths, results)):
        check(r, x_of(i, 1, w))


def test_bad_inputs_are_refused_before_queueing():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        with pytest.raises(InputError, match="'x'"):
            await b.submit({"x": np.zeros((1, 4), np.float64)})  # wrong dtype
        with pytest.raises(InputError, match="missing"):
            await b.submit({"y": x_of(0)})
        with pytest.raises(BatchTooLarge, match="max_batch_size 4") as info:
            await b.submit({"x": x_of(0, 5)})
        assert isinstance(info.value, InputError) and info.value.status == 400
        return b.queue_depth

    assert arun(main()) == 0
    assert ex.batches == []


def test_max_batch_size_zero_runs_any_request_alone():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=0), None, "m", "1")
        return await asyncio.gather(*(b.submit({"x": x_of(i, 5)}) for i in range(3)))

    results = arun(main())
    assert ex.sizes == [5, 5, 5]
    for i, r in enumerate(results):
        check(r, x_of(i, 5))


def test_model_without_a_batch_dim_runs_request_by_request():
    ex = FakeExecutor(shape=(2, 4))

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=8), None, "m", "1")
        first = await blocked_static(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i, 2)})) for i in range(3)]
        await until(lambda: b.queue_depth == 3)
        ex.gate.set()
        await first
        return await asyncio.gather(*tasks)

    async def blocked_static(ex, b):
        ex.gate = asyncio.Event()
        t = asyncio.create_task(b.submit({"x": x_of(-1, 2)}))
        await until(lambda: len(ex.batches) == 1)
        return t

    results = arun(main())
    assert [b.shape for b in ex.batches] == [(2, 4)] * 4
    for i, r in enumerate(results):
        check(r, x_of(i, 2))


def spec(name, shape):
    return TensorSpec(name, TensorType("float32", shape))


def test_batch_dim_needs_one_symbol_at_dim_0_everywhere():
    assert batch_dim([spec("a", ("batch", 3)), spec("b", ("batch", "seq"))], [spec("y", ("batch",))]) == "batch"
    assert batch_dim([spec("a", ("batch", 3))], [spec("y", ("n", 3))]) is None       # output not batched
    assert batch_dim([spec("a", ("batch", 3)), spec("b", ("n", 3))], [spec("y", ("batch",))]) is None
    assert batch_dim([spec("a", (2, 3))], [spec("y", (2,))]) is None                  # static
    assert batch_dim([spec("a", ("b", "b"))], [spec("y", ("b",))]) is None            # symbol reused
    assert batch_dim([spec("a", ("batch", 3))], [spec("y", None)]) is None            # unknown rank
    assert batch_dim([spec("a", ())], [spec("y", ("batch",))]) is None                # scalar input


def test_queue_full_is_refused_at_once_and_the_queue_keeps_working():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=1, queue_size=2), None, "m", "1")
        first = await blocked(ex, b)
        queued = [asyncio.create_task(b.submit({"x": x_of(i)})) for i in range(2)]
        await until(lambda: b.queue_depth == 2)
        with pytest.raises(QueueFull, match="queue_size 2") as info:
            await b.submit({"x": x_of(5)})
        assert info.value.status == 503 and info.value.retry_after_s >= 1
        ex.gate.set()
        await first
        results = await asyncio.gather(*queued)
        after = await b.submit({"x": x_of(6)})
        return results, after

    results, after = arun(main())
    for i, r in enumerate(results):
        check(r, x_of(i))
    check(after, x_of(6))
    assert 5.0 not in np.concatenate(ex.batches)  # the refused request never ran


def test_request_that_times_out_in_the_queue_is_dropped():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        with pytest.raises(RequestTimeout, match="while queued") as info:
            await b.submit({"x": x_of(99)}, timeout_s=0.05)
        assert info.value.status == 504
        depth = b.queue_depth
        ex.gate.set()
        await first
        return depth, await b.submit({"x": x_of(1)})

    depth, after = arun(main())
    assert depth == 0
    check(after, x_of(1))
    assert 99.0 not in np.concatenate(ex.batches)


def test_request_that_times_out_while_running_gets_the_timeout_and_the_batcher_carries_on():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        ex.gate = asyncio.Event()
        with pytest.raises(RequestTimeout, match="while running"):
            await b.submit({"x": x_of(1)}, timeout_s=0.05)
        still_running = b.running
        ex.gate.set()
        await until(lambda: b.running == 0)
        return still_running, await b.submit({"x": x_of(2)})

    still_running, after = arun(main())
    assert still_running == 1  # the caller was answered while its batch was still in the executor
    check(after, x_of(2))


def test_request_timeout_can_lower_but_not_raise_the_model_timeout():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4, timeout_ms=50), None, "m", "1")
        ex.gate = asyncio.Event()
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await b.submit({"x": x_of(1)}, timeout_s=30.0)
        took = time.monotonic() - t0
        ex.gate.set()
        return took

    assert arun(main()) < 10.0  # the model's 50 ms applied, not the request's 30 s


def test_cancelled_caller_leaves_the_queue():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        gone = asyncio.create_task(b.submit({"x": x_of(77)}))
        await until(lambda: b.queue_depth == 1)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        depth = b.queue_depth
        ex.gate.set()
        await first
        return depth, await b.submit({"x": x_of(1)})

    depth, after = arun(main())
    assert depth == 0
    check(after, x_of(1))
    assert 77.0 not in np.concatenate(ex.batches)


def test_drain_finishes_queued_and_running_requests_and_refuses_new_ones():
    ex = FakeExecutor(capacity=2)

    async def main():
        # a long delay, and a free slot while the first batch runs (capacity 2): draining must dispatch
        # the partial batch instead of waiting for it
        b = DynamicBatcher(ex, config(max_batch_size=8, max_queue_delay_ms=60_000), None, "m", "1")
        ex.gate = asyncio.Event()
        first = asyncio.create_task(b.submit({"x": x_of(-1, 8)}))  # a full batch: runs at once
        await until(lambda: len(ex.batches) == 1)
        queued = [asyncio.create_task(b.submit({"x": x_of(i)})) for i in range(3)]
        await until(lambda: b.queue_depth == 3)
        drain = asyncio.create_task(b.drain())
        await asyncio.sleep(0.01)
        with pytest.raises(Draining) as info:
            await b.submit({"x": x_of(9)})
        assert isinstance(info.value, QueueFull)  # one 503 handler covers both
        drained_early = drain.done()
        ex.gate.set()
        await drain
        return drained_early, await first, [t.result() for t in queued], b.queue_depth, b.running

    drained_early, first, results, depth, running = arun(main())
    assert not drained_early
    assert (depth, running) == (0, 0)
    check(first, x_of(-1, 8))
    for i, r in enumerate(results):
        check(r, x_of(i))
    assert ex.sizes == [8, 3]


def test_execution_error_fails_only_the_request_that_caused_it():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        values = [1.0, np.nan, 3.0, 4.0]
        tasks = [asyncio.create_task(b.submit({"x": x_of(v)})) for v in values]
        await until(lambda: b.queue_depth == 4)
        ex.gate.set()
        await first
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = arun(main())
    assert isinstance(results[1], ExecutionError)
    for i in (0, 2, 3):
        check(results[i], x_of(i + 1.0))
    assert ex.sizes == [1, 4, 1, 1, 1, 1]  # the batch failed, then each request ran alone


def test_worker_error_fails_the_whole_batch():
    ex = FakeExecutor()

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "m", "1")
        first = await blocked(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i)})) for i in range(3)]
        await until(lambda: b.queue_depth == 3)
        ex.error = WorkerError("worker 1 died")
        ex.gate.set()
        return await asyncio.gather(first, *tasks, return_exceptions=True)

    results = arun(main())
    assert all(isinstance(r, WorkerError) for r in results)
    assert ex.sizes == [1, 3]


def test_metrics_see_every_batch_and_the_queue_depth():
    ex = FakeExecutor()
    batches, depths = [], []

    class Recorder:
        def observe_batch(self, model, version, size, queue_seconds, compute_seconds):
            batches.append((model, version, size, len(queue_seconds), compute_seconds))

        def set_queue_depth(self, model, version, n):
            depths.append((model, version, n))

    async def main():
        b = DynamicBatcher(ex, config(max_batch_size=4), Recorder(), "mlp", 3)
        first = await blocked(ex, b)
        tasks = [asyncio.create_task(b.submit({"x": x_of(i, 2)})) for i in range(3)]
        await until(lambda: b.queue_depth == 3)
        ex.gate.set()
        await asyncio.gather(first, *tasks)

    arun(main())
    assert [(m, v, size, n) for m, v, size, n, _ in batches] == [("mlp", "3", 1, 1), ("mlp", "3", 4, 2),
                                                                 ("mlp", "3", 2, 1)]
    assert all(c >= 0 for *_, c in batches)
    assert max(n for *_, n in depths) == 3 and depths[-1] == ("mlp", "3", 0)
