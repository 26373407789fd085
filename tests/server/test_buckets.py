"""Batch buckets (server/buckets.py, issue 17): planning, padding and unpadding, staging buffers written in
place, the BucketedExecutor behind the real batcher (distinct rows per request, every answer equal to
``Program.run`` on that request alone), warm-up of every bucket, unbatched models, and the config keys
(``preferred_batch_size``, ``buckets``, ``instance_group``)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kiln
from kiln.errors import ExecutionError, KilnError
from kiln.ir.batch_independence import BatchAnalysis
from kiln.ir.types import TensorType
from kiln.runtime.program import TensorSpec
from kiln.server.batcher import DynamicBatcher
from kiln.server.buckets import (BucketedExecutor, Staging, bucket_for, pad_batch, plan_buckets, unpad,
                                 uses_buckets)
from kiln.server.repository import ModelConfig, ModelEntry, check_cpu_only, discover
from kiln.server.workers import ProcessExecutor, ThreadExecutor, make_executor

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def config(**kw):
    base = dict(max_batch_size=8, max_queue_delay_ms=0, queue_size=1000, timeout_ms=20000, workers=0, instances=1,
                version_policy={"latest": 1}, backend="kiln", batching="auto", preferred_batch_size=None,
                buckets=True)
    base.update(kw)
    return SimpleNamespace(**base)


def arun(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ------------------------------------------------------------------------------------------------ planning

def test_plan_defaults_are_powers_of_two_up_to_max():
    assert plan_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert plan_buckets(1) == (1,)
    assert plan_buckets(2) == (1, 2)


def test_plan_max_not_a_power_of_two_is_a_bucket():
    assert plan_buckets(12) == (1, 2, 4, 8, 12)
    assert plan_buckets(100)[-2:] == (64, 100)


def test_plan_preferred_sizes_join_the_buckets():
    assert plan_buckets(12, [6, 3, 12, 6]) == (1, 2, 3, 4, 6, 8, 12)
    assert plan_buckets(8, []) == plan_buckets(8)


@pytest.mark.parametrize("args, message", [
    ((0,), "at least 1"),
    ((-4,), "at least 1"),
    ((True,), "must be an integer"),
    ((8.0,), "must be an integer"),
    ((8, [9]), "larger than max_batch_size 8"),
    ((8, [0]), "at least 1"),
    ((8, [True]), "must be an integer"),
    ((8, [2.5]), "must be an integer"),
    ((8, "4"), "list of integers"),
    ((8, 4), "list of integers"),
])
def test_plan_errors_are_clear(args, message):
    with pytest.raises(KilnError, match=message):
        plan_buckets(*args)


def test_bucket_for():
    buckets = plan_buckets(12, [6])
    assert [bucket_for(n, buckets) for n in range(1, 13)] == [1, 2, 4, 4, 6, 6, 8, 8, 12, 12, 12, 12]
    with pytest.raises(KilnError, match="larger than the largest"):
        bucket_for(13, buckets)
    with pytest.raises(KilnError, match="at least 1 row"):
        bucket_for(0, buckets)


# ------------------------------------------------------------------------------------------------ padding

def test_pad_batch_copies_the_last_real_row():
    x = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    ids = np.array([[5, 6], [7, 8], [9, 10]], np.int64)
    padded = pad_batch({"x": x, "ids": ids}, 8)
    assert padded["x"].shape == (8, 4) and padded["ids"].shape == (8, 2)
    np.testing.assert_array_equal(padded["x"][:3], x)
    np.testing.assert_array_equal(padded["x"][3:], np.repeat(x[2:], 5, axis=0))
    np.testing.assert_array_equal(padded["ids"][3:], np.repeat(ids[2:], 5, axis=0))  # in-domain ids, not zeros
    assert padded["ids"].dtype == np.int64
    np.testing.assert_array_equal(x, np.arange(12, dtype=np.float32).reshape(3, 4))  # the input is untouched
    same = pad_batch({"x": x}, 3)
    assert same["x"] is x  # already a bucket: no copy


def test_pad_batch_errors():
    x = np.zeros((3, 2), np.float32)
    with pytest.raises(KilnError, match="does not fit"):
        pad_batch({"x": x}, 2)
    with pytest.raises(KilnError, match="disagree on dim 0"):
        pad_batch({"x": x, "y": np.zeros((2, 2))}, 4)
    with pytest.raises(KilnError, match="without a batch dim"):
        pad_batch({"x": np.float32(1)}, 4)
    with pytest.raises(KilnError, match="empty batch"):
        pad_batch({"x": np.zeros((0, 2))}, 4)


def test_unpad_slices_every_output_and_refuses_outputs_without_the_batch_dim():
    y = np.arange(8 * 2).reshape(8, 2)
    out = unpad({"y": y, "z": y[:, 0]}, 3, 8)
    np.testing.assert_array_equal(out["y"], y[:3])
    np.testing.assert_array_equal(out["z"], y[:3, 0])
    with pytest.raises(ExecutionError, match="no batch dim"):
        unpad({"y": y, "total": np.float32(3)}, 3, 8)  # a scalar may have summed the pad rows in
    with pytest.raises(ExecutionError, match="dim 0 of 8"):
        unpad({"y": np.zeros((3, 2))}, 3, 8)
    # No padding happened: every output passes as it is, scalars included.
    scalar = np.float32(3)
    assert unpad({"total": scalar}, 3, 3)["total"] is scalar
    assert unpad({"y": y}, 8)["y"] is y


# ------------------------------------------------------------------------------------------------ staging

def specs(**shapes):
    return [TensorSpec(name, TensorType(dtype, shape)) for name, (dtype, shape) in shapes.items()]


def test_staging_preallocates_one_buffer_per_bucket_and_input_with_the_allocator():
    calls = []

    def allocator(shape, dtype):
        calls.append((shape, np.dtype(dtype)))
        return np.empty(shape, dtype)

    Staging(specs(x=("float32", ("batch", 4)), ids=("int64", ("batch", 2))), (1, 2, 4), allocator)
    assert sorted(calls) == sorted([((b, 4), np.dtype("float32")) for b in (1, 2, 4)]
                                   + [((b, 2), np.dtype("int64")) for b in (1, 2, 4)])


def test_staging_writes_request_rows_in_place_without_concatenate(monkeypatch):
    staging = Staging(specs(x=("float32", ("batch", 4)), ids=("int64", ("batch", 2))), (1, 2, 4, 8))
    (pre,) = staging.free_sets(8)
    allocations = staging.allocations
    parts = [{"x": np.full((n, 4), i, np.float32), "ids": np.full((n, 2), 10 + i, np.int64)}
             for i, n in enumerate((2, 1, 2))]

    def no_concatenate(*a, **k):
        raise AssertionError("staging must copy rows into the bucket's buffer, not concatenate")

    monkeypatch.setattr(np, "concatenate", no_concatenate)
    staged = staging.stage(parts, 8)
    monkeypatch.undo()
    assert staged.arrays["x"] is pre["x"] and staged.arrays["ids"] is pre["ids"]  # the preallocated buffers
    assert staging.allocations == allocations  # nothing allocated per batch
    assert staging.free_sets(8) == []  # held by this batch
    np.testing.assert_array_equal(staged.arrays["x"][:, 0], [0, 0, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(staged.arrays["ids"][:, 1], [10, 10, 11, 12, 12, 12, 12, 12])
    staged.release()
    staged.release()  # idempotent
    (back,) = staging.free_sets(8)
    assert back["x"] is pre["x"]
    # The next batch of that bucket reuses the same memory.
    again = staging.stage([{"x": np.ones((5, 4), np.float32), "ids": np.ones((5, 2), np.int64)}], 8)
    assert again.arrays["x"] is pre["x"]
    again.release()


def test_staging_decodes_bytes_straight_into_the_buffer():
    staging = Staging(specs(x=("float32", ("batch", 3))), (4,))
    batch = staging.acquire(4)
    rows = np.arange(6, dtype="<f4").reshape(2, 3)
    assert batch.write_bytes("x", rows.tobytes()) == 2
    assert batch.write("x", np.full((1, 3), 9, np.float32)) == 3
    batch.pad()
    np.testing.assert_array_equal(batch.arrays["x"], [[0, 1, 2], [3, 4, 5], [9, 9, 9], [9, 9, 9]])
    with pytest.raises(KilnError, match="whole number of rows"):
        batch.write_bytes("x", b"\0" * 5)
    with pytest.raises(KilnError, match="do not fit"):
        batch.write("x", np.zeros((2, 3), np.float32))
    batch.release()


def test_staging_busy_or_dynamic_shapes_get_their_own_buffers():
    staging = Staging(specs(x=("float32", ("batch", 4)), t=("int64", ("batch", "seq"))), (2,), copies=1)
    first = staging.stage([{"x": np.ones((1, 4), np.float32), "t": np.ones((1, 7), np.int64)}], 2)
    second = staging.stage([{"x": np.zeros((2, 4), np.float32), "t": np.zeros((2, 3), np.int64)}], 2)
    assert first.arrays["x"] is not second.arrays["x"]
    assert first.arrays["t"].shape == (2, 7) and second.arrays["t"].shape == (2, 3)
    np.testing.assert_array_equal(first.arrays["x"], np.ones((2, 4)))  # the second batch did not overwrite it
    first.release()
    second.release()
    assert len(staging.free_sets(2)) == 1  # only the preallocated set is kept


# ------------------------------------------------------------------------------------------------ executor

class RowFake:
    """y = 2x + 1 row by row (row-independent); counts runs by batch size; can hold runs at a gate;
    ``identity`` returns the input array itself (an output that aliases the staging buffer)."""

    batch_analysis = BatchAnalysis(True, "batch", "y = 2x + 1, row by row")

    def __init__(self, shape=("batch", 4), identity=False, capacity=1):
        self.inputs = [TensorSpec("x", TensorType("float32", shape))]
        self.outputs = [TensorSpec("y", TensorType("float32", shape))]
        self.capacity = capacity
        self.ready = False
        self.identity = identity
        self.runs: list[tuple] = []  # the shape of every x it ran
        self.seen: list[np.ndarray] = []
        self.gate: asyncio.Event | None = None
        self.started = 0

    def start(self):
        self.started += 1
        self.ready = True

    async def run(self, inputs):
        x = inputs["x"]
        self.runs.append(x.shape)
        self.seen.append(x.copy())
        self.last = x
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        return {"y": x if self.identity else x * 2 + 1}

    async def close(self):
        self.ready = False


def test_warm_up_runs_every_bucket_once_and_readiness_waits_for_it():
    fake = RowFake()
    ex = BucketedExecutor(fake, config(max_batch_size=12, preferred_batch_size=[6]))

    async def main():
        fake.gate = asyncio.Event()
        task = asyncio.ensure_future(ex.start())
        while not fake.runs:
            await asyncio.sleep(0.001)
        assert fake.ready and not ex.ready  # the inner executor runs, warm-up has not finished
        fake.gate.set()
        await task
        assert ex.ready

    arun(main())
    assert ex.buckets == (1, 2, 4, 6, 8, 12)
    assert fake.runs == [(b, 4) for b in ex.buckets]  # each bucket exactly once, at its size
    assert ex.warm_up_runs == {b: 1 for b in ex.buckets}
    assert fake.started == 1


def test_padding_never_leaks_into_answers_fake_executor():
    """Distinct rows per request through the real batcher: every batch the inner executor sees has a
    bucket's size, pad rows are copies of a real row, and each answer is exactly its own rows."""
    fake = RowFake(capacity=2)
    ex = BucketedExecutor(fake, config(max_batch_size=6, preferred_batch_size=[3], instances=2))
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32) + 10 * i for i in range(200)]

    async def main():
        await ex.start()
        fake.runs.clear()
        fake.seen.clear()
        b = DynamicBatcher(ex, config(max_batch_size=6, instances=2), None, "fake", "1")
        results = await asyncio.gather(*(b.submit({"x": x}) for x in xs))
        await b.close()
        return results

    results = arun(main())
    for x, got in zip(xs, results):
        np.testing.assert_array_equal(got["y"], x * 2 + 1)
    assert {shape[0] for shape in fake.runs} <= set(ex.buckets) == {1, 2, 3, 4, 6}
    assert sum(ex.batches.values()) == len(fake.runs)
    padded = [s for s in fake.seen if len({tuple(r) for r in s}) < len(s)]
    assert padded, "some batch should have been padded"
    all_rows = {tuple(r) for x in xs for r in x}
    for s in fake.seen:  # every row the model ran, pad rows included, is some request's real row
        assert {tuple(r) for r in s} <= all_rows


def test_concurrent_requests_real_model_equal_program_run_alone():
    """The MLP fixture on a ThreadExecutor behind buckets and the real batcher, 300 concurrent requests with
    distinct rows: every answer equals Program.run on that request alone, none lost."""
    program = kiln.load(MLP)
    cfg = config(max_batch_size=12, preferred_batch_size=[6], instances=2, max_queue_delay_ms=1)
    inner = ThreadExecutor(MLP, cfg)
    seen_sizes = []
    run = inner.run

    async def recording_run(inputs):
        seen_sizes.append(inputs["x"].shape[0])
        return await run(inputs)

    inner.run = recording_run
    ex = BucketedExecutor(inner, cfg)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((int(rng.integers(1, 5)), 16)).astype(np.float32) for _ in range(300)]

    async def main():
        await ex.start()
        b = DynamicBatcher(ex, cfg, None, "mlp", "1")
        results = await asyncio.gather(*(b.submit({"x": x}) for x in xs))
        await b.close()
        return results

    results = arun(main())
    assert len(results) == len(xs)
    for x, got in zip(xs, results):
        want = program.run({"x": x})
        assert set(got) == {"logits", "probs"}
        for name in want:
            assert got[name].shape == want[name].shape
            # Batched GEMMs may round differently from a lone row; a leak or mix-up is off by far more.
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert set(seen_sizes) <= set(ex.buckets)
    served = sum(n * c for n, c in ex.batches.items())
    assert served > sum(x.shape[0] for x in xs), "some batches should have been padded"
    assert max(seen_sizes) > 1, "requests should have been stacked"


def test_one_bad_request_fails_alone_through_buckets():
    """The batcher's culprit isolation still works: a batch that fails is re-run request by request, each
    padded with copies of its own rows, so only the request with the bad row gets the error."""

    class NanFake(RowFake):
        async def run(self, inputs):
            if np.isnan(inputs["x"]).any():
                raise ExecutionError("NaN in the input")
            return await super().run(inputs)

    fake = NanFake()
    ex = BucketedExecutor(fake, config(max_batch_size=8))
    xs = [np.full((2, 4), i, np.float32) for i in range(6)]
    xs[3][1, 2] = np.nan

    async def main():
        await ex.start()
        fake.gate = asyncio.Event()
        b = DynamicBatcher(ex, config(max_batch_size=8), None, "fake", "1")
        first = asyncio.ensure_future(b.submit({"x": np.zeros((1, 4), np.float32)}))  # holds the executor
        while not fake.gate or not b.running:
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(b.submit({"x": x})) for x in xs]
        await asyncio.sleep(0.01)
        fake.gate.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        await b.close()
        return results[1:]

    results = arun(main())
    for i, (x, got) in enumerate(zip(xs, results)):
        if i == 3:
            assert isinstance(got, ExecutionError)
        else:
            np.testing.assert_array_equal(got["y"], x * 2 + 1)


def test_buckets_around_worker_processes():
    """make_executor's ProcessExecutor inside buckets: warm-up through the worker, answers equal
    Program.run alone."""
    program = kiln.load(MLP)
    cfg = ModelConfig(workers=1, max_batch_size=6, preferred_batch_size=[3])
    ex = make_executor(MLP, cfg)
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(40)]

    async def main():
        await ex.start()
        try:
            b = DynamicBatcher(ex, cfg, None, "mlp", "1")
            results = await asyncio.gather(*(b.submit({"x": x}) for x in xs))
            await b.close()
        finally:
            await ex.close()
        return results

    results = arun(main())
    assert ex.buckets == (1, 2, 3, 4, 6) and ex.warm_up_runs == {b: 1 for b in ex.buckets}
    for x, got in zip(xs, results):
        want = program.run({"x": x})
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_outputs_that_alias_the_staging_buffer_are_copied():
    fake = RowFake(identity=True)
    ex = BucketedExecutor(fake, config(max_batch_size=4))

    async def main():
        await ex.start()
        a = await ex.run_parts([{"x": np.full((3, 4), 1, np.float32)}])
        b = await ex.run_parts([{"x": np.full((3, 4), 2, np.float32)}])  # same bucket, same buffer
        return a, b

    a, b = arun(main())
    np.testing.assert_array_equal(a["y"], np.full((3, 4), 1))  # not overwritten by the second batch
    np.testing.assert_array_equal(b["y"], np.full((3, 4), 2))
    assert a["y"].shape == (3, 4)


def test_a_cancelled_batch_never_gives_its_buffers_to_the_next_one():
    """The inner run of a cancelled batch may still be reading its staging buffers (a thread, an async
    copy): they must not be handed to the next batch."""
    fake = RowFake()
    ex = BucketedExecutor(fake, config(max_batch_size=4))

    async def main():
        await ex.start()
        fake.gate = asyncio.Event()
        task = asyncio.ensure_future(ex.run_parts([{"x": np.ones((3, 4), np.float32)}]))
        while fake.runs[-1] != (4, 4) or fake.last is None or fake.last[0, 0] != 1:
            await asyncio.sleep(0.001)
        held = fake.last
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        fake.gate = None
        (free,) = ex.staging.free_sets(4)
        assert free["x"] is not held
        await ex.run_parts([{"x": np.full((2, 4), 5, np.float32)}])
        assert fake.last is not held
        np.testing.assert_array_equal(held, np.ones((4, 4)))  # untouched by the later batch

    fake.last = None
    arun(main())


def test_readiness_waits_for_warm_up_through_the_app():
    """/v2/health/ready is 503 while the buckets warm up, 200 after; then requests are answered."""
    import threading
    import time
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from kiln.server.app import create_app

    gate = threading.Event()

    class GatedFake(RowFake):
        async def run(self, inputs):
            if not gate.is_set():
                await asyncio.to_thread(gate.wait, 30)
            return await super().run(inputs)

    fake = GatedFake()
    entry = ModelEntry("m", "1", MLP, ModelConfig(workers=0, max_batch_size=4, buckets=True))
    app = create_app([entry], executor_factory=lambda e: BucketedExecutor(fake, e.config))
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not fake.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.ready  # the inner executor started; warm-up is held at the gate
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get("/v2/models/m/ready").status_code == 503
        gate.set()
        while client.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline + 10, "never became ready"
            time.sleep(0.01)
        assert [n for n, _ in fake.runs[:3]] == [1, 2, 4]
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        body = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.ravel().tolist()}]}
        r = client.post("/v2/models/m/infer", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        assert out["shape"] == [3, 4]
        np.testing.assert_array_equal(np.array(out["data"]).reshape(3, 4), x * 2 + 1)
        assert fake.runs[-1] == (4, 4)  # padded to the bucket


def test_model_without_a_batch_dim_runs_unbatched():
    fake = RowFake(shape=(4,))
    ex = BucketedExecutor(fake, config(max_batch_size=8))
    x = np.arange(4, dtype=np.float32)

    async def main():
        await ex.start()
        b = DynamicBatcher(ex, config(max_batch_size=8), None, "static", "1")
        got = await asyncio.gather(*(b.submit({"x": x + i}) for i in range(5)))
        await b.close()
        return got

    got = arun(main())
    assert not ex.padded and ex.buckets == ()
    assert ex.warm_up_runs == {0: 1}  # one warm-up run, at the model's own shape
    assert fake.runs == [(4,)] * 6  # warm-up, then each request as it came
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g["y"], (x + i) * 2 + 1)


def test_model_not_proven_row_independent_is_never_padded():
    fake = RowFake()
    fake.batch_analysis = BatchAnalysis(False, None, "ReduceMean over the batch dim")
    ex = BucketedExecutor(fake, config(max_batch_size=8))

    async def main():
        await ex.start()
        return await ex.run_parts([{"x": np.ones((3, 4), np.float32)}])

    got = arun(main())
    assert not ex.padded and "not proven row-independent" in ex.reason
    assert fake.runs[-1] == (3, 4)  # the request's own rows, no pad rows mixed in
    assert got["y"].shape == (3, 4)


def test_warm_up_is_skipped_for_dynamic_non_batch_dims_and_model_still_serves():
    fake = RowFake(shape=("batch", "seq"))
    ex = BucketedExecutor(fake, config(max_batch_size=4))

    async def main():
        await ex.start()
        return await ex.run_parts([{"x": np.ones((3, 5), np.float32)}])

    got = arun(main())
    assert ex.ready and ex.warm_up_runs == {}
    assert fake.runs == [(4, 5)]
    np.testing.assert_array_equal(got["y"], np.full((3, 5), 3))


def test_batcher_never_sends_more_than_the_largest_bucket():
    fake = RowFake()
    ex = BucketedExecutor(fake, config(max_batch_size=4))

    async def main():
        await ex.start()
        b = DynamicBatcher(ex, config(max_batch_size=4), None, "fake", "1")
        fake.runs.clear()
        await asyncio.gather(*(b.submit({"x": np.ones((3, 4), np.float32)}) for _ in range(10)))
        await b.close()

    arun(main())
    assert max(n for n, _ in fake.runs) <= 4 == ex.max_batch_rows


# ------------------------------------------------------------------------------------------------ config

def test_config_keys_are_validated():
    c = ModelConfig.from_json({"max_batch_size": 16, "preferred_batch_size": [8, 4, 8]})
    assert c.preferred_batch_size == [4, 8] and c.uses_buckets
    assert not ModelConfig().uses_buckets
    assert ModelConfig.from_json({"buckets": True}).uses_buckets
    assert not ModelConfig.from_json({"buckets": False}).uses_buckets
    groups = ModelConfig.from_json({"instance_group": [{"kind": "KIND_CPU", "count": 2}, {"kind": "cpu"}]})
    assert groups.instance_group == [{"kind": "cpu", "count": 2}, {"kind": "cpu", "count": 1}]
    assert groups.instances == 3
    gpu = ModelConfig.from_json({"instance_group": [{"kind": "gpu", "count": 2, "gpus": [0, 1]}]})
    assert gpu.gpu_groups == [{"kind": "gpu", "count": 2, "gpus": [0, 1]}]
    json.dumps(gpu.to_json())
    hash(gpu)


@pytest.mark.parametrize("data, message", [
    ({"preferred_batch_size": [64]}, "above max_batch_size 32"),
    ({"max_batch_size": 4, "preferred_batch_size": [2, 8]}, r"size\(s\) \[8\] above max_batch_size 4"),
    ({"preferred_batch_size": [0]}, ">= 1"),
    ({"preferred_batch_size": "8"}, "list of integers"),
    ({"preferred_batch_size": [True]}, "integer"),
    ({"preferred_batch_size": [2], "buckets": False}, "'buckets' is false"),
    ({"buckets": "yes"}, "true, false or null"),
    ({"instance_group": {"kind": "cpu"}}, "non-empty list"),
    ({"instance_group": []}, "non-empty list"),
    ({"instance_group": [{"count": 1}]}, "needs a 'kind'"),
    ({"instance_group": [{"kind": "tpu"}]}, "'kind' must be"),
    ({"instance_group": [{"kind": "gpu", "count": 0}]}, "'count' must be >= 1"),
    ({"instance_group": [{"kind": "gpu", "gpus": [-1]}]}, "'gpus' entry must be >= 0"),
    ({"instance_group": [{"kind": "gpu", "gpus": [0, 0]}]}, "twice"),
    ({"instance_group": [{"kind": "gpu", "gpus": "0"}]}, "list of GPU indices"),
    ({"instance_group": [{"kind": "cpu", "gpus": [0]}]}, "only applies to kind"),
    ({"instance_group": [{"kind": "cpu", "profile": []}]}, "unknown key"),
    ({"instance_group": [{"kind": "cpu"}], "instances": 2}, "not both"),
])
def test_config_errors_name_the_key(data, message):
    with pytest.raises(KilnError, match=message):
        ModelConfig.from_json(data, "repo/m/config.json")


def test_cli_max_batch_size_below_a_preferred_size_is_refused():
    c = ModelConfig.from_json({"preferred_batch_size": [16]})
    with pytest.raises(KilnError, match="command-line options: preferred_batch_size"):
        c.with_overrides({"max_batch_size": 8})


def test_make_executor_wraps_in_buckets_when_the_config_asks():
    assert isinstance(make_executor(MLP, ModelConfig(workers=0)), ThreadExecutor)
    ex = make_executor(MLP, ModelConfig(workers=0, preferred_batch_size=[4]))
    assert isinstance(ex, BucketedExecutor) and isinstance(ex.inner, ThreadExecutor)
    ex = make_executor(MLP, ModelConfig(workers=1, buckets=True))
    assert isinstance(ex, BucketedExecutor) and isinstance(ex.inner, ProcessExecutor)
    assert uses_buckets(ModelConfig(buckets=True)) and not uses_buckets(ModelConfig())


def test_gpu_instance_group_is_refused_on_this_cpu_server(tmp_path):
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.kiln").write_bytes(MLP.read_bytes())
    (model / "config.json").write_text(json.dumps({"instance_group": [{"kind": "gpu", "gpus": [0]}]}))
    entries = discover(tmp_path / "repo")
    with pytest.raises(KilnError, match=r"m \(version 1\): instance_group asks for kind \"gpu\".*CPU only"):
        check_cpu_only(entries)
    with pytest.raises(KilnError, match="CPU only"):
        make_executor(entries[0].path, entries[0].config)
    check_cpu_only([ModelEntry("ok", "1", MLP, ModelConfig.from_json({"instance_group": [{"kind": "cpu"}]}))])


def test_big_batches_are_staged_on_a_thread_and_a_cancelled_one_gives_its_buffers_back(monkeypatch):
    import threading

    import kiln.server.buckets as buckets
    fake = RowFake(shape=("batch", 1 << 16))  # 256 KiB a row: a batch of 4 is over the thread threshold
    ex = BucketedExecutor(fake, config(max_batch_size=4))
    staged_on = []
    stage = buckets.Staging.stage

    def spy(self, parts, bucket):
        staged_on.append(threading.current_thread() is threading.main_thread())
        return stage(self, parts, bucket)

    monkeypatch.setattr(buckets.Staging, "stage", spy)
    monkeypatch.setattr(buckets, "_STAGE_IN_THREAD_BYTES", 1 << 20)  # off by default; this tests the path

    async def main():
        await ex.start()
        rows = [np.full((1, 1 << 16), i, np.float32) for i in range(4)]
        staged_on.clear()
        out = await ex.run_parts([{"x": r} for r in rows])
        np.testing.assert_array_equal(out["y"][:, 0], [1, 3, 5, 7])
        assert staged_on == [False]  # on a worker thread
        one = await ex.run_parts([{"x": rows[1]}])  # small: on the loop
        assert one["y"][0, 0] == 3 and staged_on[-1] is True
        # Cancelled while its rows are copied on the thread: the set comes back once the copy is done.
        (pre,) = ex.staging.free_sets(4)
        task = asyncio.ensure_future(ex.run_parts([{"x": r} for r in rows]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if ex.staging.free_sets(4):
                break
            await asyncio.sleep(0.01)
        assert ex.staging.free_sets(4) and ex.staging.free_sets(4)[0] is pre

    asyncio.run(main())
