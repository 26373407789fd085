"""``kiln serve --device cuda`` (issue 17, server/gpu.py).

CPU (CI): the CLI's one-line error when CuPy or a GPU is missing, ``device`` and gpu instance groups in
config.json, the worker-per-GPU mapping and each worker's CUDA_VISIBLE_DEVICES, the executor wiring
(buckets on by default, warm-up twice per bucket), CUDA fault classification.

GPU (marked ``gpu``, skipped cleanly without CuPy or a device): the real ``kiln serve --device cuda`` on
a zoo ResNet-18 traced and saved, max_batch_size 16: 64 concurrent clients with distinct inputs, every
answer equal to ``CudaProgram.run`` on that input alone (within float32 tolerance: a batch of 16 may take
other cuBLAS/cuDNN algorithms than a batch of 1), none lost, mean batch size > 1 in /metrics; a worker
SIGKILLed under load is replaced and the server keeps answering.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kiln.errors import KilnError  # noqa: E402
from kiln.server import gpu  # noqa: E402
from kiln.server.errors import WorkerError  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry, check_cpu_only, discover  # noqa: E402
from kiln.server.workers import ProcessExecutor, make_executor  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
KILN = [sys.executable, "-m", "kiln"]


def _gpu_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return 0


HAVE_GPU = _gpu_count() > 0


# ------------------------------------------------------------------------------------------ CPU (CI)

@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU: --device cuda would start")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_gpu_is_one_clear_line(device):
    r = subprocess.run(KILN + ["serve", str(MLP), "--device", device, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("kiln serve: error: --device cuda"), lines
    assert re.search(r"CuPy|no (usable )?CUDA GPU", lines[0]), lines
    assert "ready at" not in r.stdout


def test_bad_device_is_refused_by_name():
    r = subprocess.run(KILN + ["serve", str(MLP), "--device", "gpu0", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "'device'" in r.stderr and "cuda:N" in r.stderr, r.stderr


@pytest.mark.parametrize("value, words", [
    ("cuda:x", "cuda:N"), ("tpu", "cuda:N"), (0, "got an integer"), (None, "null")])
def test_device_key_is_validated(value, words):
    with pytest.raises(KilnError, match=re.escape(words)):
        ModelConfig.from_json({"device": value}, "m/config.json")


def test_device_key_and_buckets_default():
    assert ModelConfig().device == "cpu" and not ModelConfig().uses_buckets
    c = ModelConfig.from_json({"device": "CUDA:1"})
    assert c.device == "cuda:1" and c.uses_buckets  # buckets on by default on a GPU
    assert not ModelConfig.from_json({"device": "cuda", "buckets": False}).uses_buckets
    assert ModelConfig().with_overrides({"device": "cuda"}).device == "cuda"
    assert ModelConfig.from_json({"device": "cuda"}).to_json()["device"] == "cuda"


def test_gpu_slots_from_instance_groups():
    def slots(**data):
        return gpu.gpu_slots(ModelConfig.from_json(data))
    assert slots(device="cuda") == [0]
    assert slots(device="cuda:1") == [1]
    assert slots(device="cuda:1", workers=2) == [1, 1]
    assert slots(device="cuda", instance_group=[{"kind": "gpu", "count": 2, "gpus": [0, 1]}]) == [0, 0, 1, 1]
    assert slots(device="cuda:3", instance_group=[{"kind": "KIND_GPU", "count": 2}]) == [3, 3]
    assert slots(device="cuda", instance_group=[{"kind": "gpu", "gpus": [2]},
                                                {"kind": "gpu", "count": 3, "gpus": [0]}]) == [2, 0, 0, 0]
    assert gpu.parse_device("cpu") is None and gpu.parse_device("cuda") == 0 and gpu.parse_device("cuda:7") == 7
    with pytest.raises(KilnError, match="cuda:N"):
        gpu.parse_device("cuda:-1")


def _entry(name="m", **data):
    return ModelEntry(name, "1", MLP, ModelConfig.from_json(data))


def test_check_gpus():
    # CPU models need no probe at all.
    gpu.check_gpus([_entry()], probe=lambda: pytest.fail("probed"))
    with pytest.raises(KilnError, match=r"no CUDA GPU is visible"):
        gpu.check_gpus([_entry(device="cuda")], probe=lambda: 0)
    gpu.check_gpus([_entry(device="cuda:1")], probe=lambda: 2)
    with pytest.raises(KilnError, match=r"m \(version 1\) asks for GPU\(s\) \[2\], but this machine has 2 GPU"):
        gpu.check_gpus([_entry(device="cuda", instance_group=[{"kind": "gpu", "gpus": [0, 2]}])], probe=lambda: 2)
    with pytest.raises(KilnError, match=r"m \(version 1\): instance_group asks for kind \"gpu\".*--device cuda"):
        gpu.check_gpus([_entry(instance_group=[{"kind": "gpu"}])], probe=lambda: 2)


def test_check_cpu_only_is_lifted_for_cuda_models():
    check_cpu_only([_entry(device="cuda", instance_group=[{"kind": "gpu", "count": 2, "gpus": [0, 1]}])])
    with pytest.raises(KilnError, match="CPU only.*--device cuda"):
        check_cpu_only([_entry(instance_group=[{"kind": "gpu"}])])


def test_gpu_instance_group_in_a_repository(tmp_path):
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.kiln").write_bytes(MLP.read_bytes())
    (model / "config.json").write_text(json.dumps({"max_batch_size": 16,
                                                   "instance_group": [{"kind": "gpu", "count": 2, "gpus": [1]}]}))
    [entry] = discover(tmp_path / "repo", overrides={"device": "cuda"})
    assert entry.config.device == "cuda" and gpu.gpu_slots(entry.config) == [1, 1]
    with pytest.raises(KilnError, match="CPU only"):
        check_cpu_only(discover(tmp_path / "repo"))


def test_make_executor_for_cuda_is_gpu_workers_in_buckets(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ex = make_executor(MLP, ModelConfig.from_json({"device": "cuda", "max_batch_size": 16,
                                                   "instance_group": [{"kind": "gpu", "count": 2, "gpus": [0, 3]}]}))
    assert isinstance(ex, gpu.GpuBucketedExecutor) and ex.warm_up_rounds == 2
    inner = ex.inner
    assert isinstance(inner, gpu.GpuExecutor) and isinstance(inner, ProcessExecutor)
    assert inner.device == "cuda" and inner.n_workers == 4 and inner.slots == [0, 0, 3, 3]
    assert inner.instances == 2 and ex.capacity == 8  # two batches in flight per worker
    assert [inner._worker_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0", "0", "3", "3"]
    assert ex.slots == [0, 0, 3, 3] and inner.gpus == [0, 3]
    bare = make_executor(MLP, ModelConfig.from_json({"device": "cuda:2", "buckets": False}))
    assert isinstance(bare, gpu.GpuExecutor) and bare.slots == [2]
    with pytest.raises(KilnError, match="onnxruntime"):
        make_executor(MLP, ModelConfig.from_json({"device": "cuda", "backend": "onnxruntime"}))
    with pytest.raises(KilnError, match="CPU only"):
        make_executor(MLP, ModelConfig.from_json({"instance_group": [{"kind": "gpu"}]}))


def test_worker_gpu_is_this_process_device_not_the_physical_index(monkeypatch):
    """A server that sees a subset of the cards (Ray gives a replica GPU 3 as CUDA_VISIBLE_DEVICES=3; a user's
    CUDA_VISIBLE_DEVICES=2,3) must pin each worker to the card its own device index names: device 0 of a
    process that sees "3" is physical 3, not physical 0 (another replica's card)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    ex = make_executor(MLP, ModelConfig.from_json({"device": "cuda", "buckets": False, "workers": 2}))
    assert [ex._worker_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["3", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa, 5")
    ex = make_executor(MLP, ModelConfig.from_json({"device": "cuda", "buckets": False, "instance_group": [
        {"kind": "gpu", "count": 1, "gpus": [1, 0]}]}))
    assert [ex._worker_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["5", "GPU-aaaa"]
    assert gpu.visible_device(1, {}) == "1" and gpu.visible_device(0, {"CUDA_VISIBLE_DEVICES": "MIG-x"}) == "MIG-x"
    for visible, index in (("3", 1), ("", 0), ("2,-1,4", 1)):  # CUDA stops reading at an invalid entry
        with pytest.raises(KilnError, match="not visible"):
            gpu.visible_device(index, {"CUDA_VISIBLE_DEVICES": visible})


class _CupyError(RuntimeError):
    pass


_CupyError.__module__ = "cupy_backends.cuda.api.runtime"


class _OOM(MemoryError):
    pass


_OOM.__name__ = "OutOfMemoryError"
_OOM.__module__ = "cupy.cuda.memory"


def test_cuda_faults_are_named_and_replace_the_worker():
    from kiln.errors import ExecutionError
    assert gpu.cuda_fault(ExecutionError("Gather: index 7 out of range")) is None
    f = gpu.cuda_fault(_CupyError("cudaErrorIllegalAddress: an illegal memory access was encountered"))
    assert isinstance(f, WorkerError) and f.status == 500
    assert "a CUDA error" in str(f) and "cudaErrorIllegalAddress" in str(f) and "being replaced" in str(f)
    try:  # wrapped by the runtime: found through the chain
        try:
            raise _OOM("Out of memory allocating 1,024 bytes")
        except _OOM as e:
            raise ExecutionError("Conv failed") from e
    except ExecutionError as e:
        f = gpu.cuda_fault(e)
    assert "out of GPU memory" in str(f)
    err = gpu.describe_load_failure("m.kiln", _OOM("Out of memory allocating 9 GiB"))
    assert isinstance(err, KilnError) and "out of GPU memory loading the model" in str(err)
    plain = KilnError("bad file")
    assert gpu.describe_load_failure("m.kiln", plain) is plain


# -------------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA GPU")
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo

    import kiln
    model, inputs, spec = zoo.resnet18(batch=1, width=8, image=32)
    path = kiln.save(kiln.trace(model, inputs, dynamic=spec), tmp_path_factory.mktemp("gpu_serve") / "r18.kiln")
    return path, kiln.load(path, device="cuda", output="numpy")


def _served_class():
    """tests/server/test_serve_process.py's ``kiln serve`` process harness (pytest runs with
    --import-mode=importlib and only tests/ on the path, so this folder is added for the import)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from test_serve_process import Served
    return Served


def _serve(args, timeout=300.0):
    return _served_class()(args, ready_timeout=timeout)


def test_the_serve_harness_imports():
    """The GPU tests' harness import works under this pytest configuration (checked in CI too: the first
    H100 run failed here, with ModuleNotFoundError)."""
    assert _served_class().__name__ == "Served"


def _infer(client, url, x):
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return client.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)


def _mean_batch(server) -> float:
    import httpx
    text = httpx.get(server.url + "/metrics").text
    s = float(re.search(r'^kiln_batch_size_sum\{[^}]*model="r18"[^}]*\} (\S+)$', text, re.M).group(1))
    n = float(re.search(r'^kiln_batch_size_count\{[^}]*model="r18"[^}]*\} (\S+)$', text, re.M).group(1))
    return s / n


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_64_clients_distinct_inputs_equal_cuda_program(resnet):
    import httpx
    path, program = resnet
    server = _serve([str(path), "--name", "r18", "--device", "cuda", "--max-batch-size", "16",
                     "--max-queue-delay-ms", "2"])
    try:
        assert any("batch buckets: [1, 2, 4, 8, 16]" in line for line in server.output), server.output
        assert any("GPU worker process on GPU(s) [0]" in line for line in server.output), server.output
        url = server.url + "/v2/models/r18/infer"
        rng = np.random.default_rng(17)
        per_client = 12
        xs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(64 * per_client)]

        def client(k):
            got = []
            with httpx.Client() as c:
                for i in range(k * per_client, (k + 1) * per_client):
                    r = _infer(c, url, xs[i])
                    assert r.status_code == 200, r.text
                    [out] = r.json()["outputs"]
                    got.append((i, np.array(out["data"], np.float32).reshape(out["shape"])))
            return got

        with ThreadPoolExecutor(64) as pool:
            answers = [a for part in pool.map(client, range(64)) for a in part]
        assert sorted(i for i, _ in answers) == list(range(len(xs)))  # none lost
        for i, y in answers:
            want = next(iter(program.run({"x": xs[i]}).values()))
            np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-4)
        assert _mean_batch(server) > 1.0
    finally:
        assert server.stop() == 0, "".join(server.output)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_killed_gpu_worker_is_replaced(resnet):
    import httpx
    path, program = resnet
    server = _serve([str(path), "--name", "r18", "--device", "cuda", "--max-batch-size", "16"])
    try:
        url = server.url + "/v2/models/r18/infer"
        [worker] = server.worker_pids()
        rng = np.random.default_rng(5)
        stop = time.monotonic() + 4.0
        statuses = []

        def load():
            with httpx.Client() as c:
                while time.monotonic() < stop:
                    r = _infer(c, url, rng.standard_normal((1, 3, 32, 32)).astype(np.float32))
                    statuses.append((r.status_code, r.text if r.status_code != 200 else ""))

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(load) for _ in range(16)]
            time.sleep(1.0)
            os.kill(worker, signal.SIGKILL)
            for f in futures:
                f.result()
        failed = [t for s, t in statuses if s != 200]
        assert all(s in (200, 500) for s, _ in statuses), statuses[:5]
        assert all("died" in t and "SIGKILL" in t for t in failed), failed[:3]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = server.worker_pids()
            if pids and worker not in pids:
                break
            time.sleep(0.2)
        x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        with httpx.Client() as c:
            r = _infer(c, url, x)
        assert r.status_code == 200, r.text
        [out] = r.json()["outputs"]
        want = next(iter(program.run({"x": x}).values()))
        np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(out["shape"]), want, rtol=1e-3, atol=1e-4)
        assert server.worker_pids() != [worker]
    finally:
        assert server.stop() == 0, "".join(server.output)


def test_triton_config_reports_gpu_instances():
    from kiln.server.app import _triton_instance_group
    assert _triton_instance_group("m", ModelConfig.from_json({"device": "cuda:1", "workers": 2})) == \
        [{"name": "m", "kind": "KIND_GPU", "count": 2, "gpus": [1]}]
    assert _triton_instance_group("m", ModelConfig.from_json(
        {"device": "cuda", "instance_group": [{"kind": "gpu", "count": 2, "gpus": [0, 1]}]})) == \
        [{"name": "m_0", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}]
    assert _triton_instance_group("m", ModelConfig())[0]["kind"] == "KIND_CPU"


def test_gpu_model_failing_to_load_fails_its_readiness_not_the_server():
    """Out of GPU memory at load: that model answers 503 with the reason, the others serve (CPU-testable
    through an executor factory that fails the way a GPU worker's load does)."""
    from fastapi.testclient import TestClient

    from kiln.server.app import create_app
    from kiln.server.workers import ThreadExecutor

    def factory(e):
        if e.config.device != "cpu":
            raise KilnError(f"{e.path}: out of GPU memory loading the model on GPU 0 (OutOfMemoryError: 80 GiB)")
        return ThreadExecutor(e.path, e.config)

    good = ModelEntry("good", "1", MLP, ModelConfig(workers=0))
    big = ModelEntry("big", "1", MLP, ModelConfig.from_json({"device": "cuda"}))
    load_errors, ready = [], []
    app = create_app([good, big], executor_factory=factory, on_load_error=load_errors.append,
                     on_ready=ready.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while not ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready and not load_errors
        r = client.get("/v2/models/big/ready")
        assert r.status_code == 503 and "out of GPU memory" in r.json()["error"], r.text
        assert client.get("/v2/health/ready").status_code == 503  # not every model is ready
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/models/good/ready").status_code == 200
        x = np.zeros((1, 16), np.float32)
        body = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
        assert client.post("/v2/models/good/infer", json=body).status_code == 200
        r = client.post("/v2/models/big/infer", json=body)
        assert r.status_code == 503 and "failed to load: " in r.json()["error"]
        index = {m["name"]: m for m in client.post("/v2/repository/index", json={}).json()}
        assert index["big"]["state"] == "UNAVAILABLE" and "out of GPU memory" in index["big"]["reason"]


def test_cpu_model_failing_to_load_still_stops_the_server():
    from fastapi.testclient import TestClient

    from kiln.server.app import create_app

    def factory(e):
        raise KilnError("bad file")

    load_errors = []
    app = create_app([ModelEntry("m", "1", MLP, ModelConfig(workers=0))], executor_factory=factory,
                     on_load_error=load_errors.append)
    with TestClient(app):
        deadline = time.monotonic() + 30
        while not load_errors and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [str(e) for e in load_errors] == ["bad file"]


# ------------------------------------------------------------------------- the data path on a GPU (issue 17)

@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_gpu_runner_reads_and_writes_page_locked_arena_blocks(resnet):
    """GpuRunner: inputs and outputs in the shared arena are page-locked once, copied on the runner's own
    stream, and the outputs land in the caller's blocks; answers equal CudaProgram.run; timings reported."""
    import kiln
    from kiln.server.arena import Arena
    from kiln.server.gpu import GpuRunner
    path, program = resnet
    worker_program = kiln.load(path, device="cuda", output="numpy", wait="block")
    arena = Arena(64 << 20)
    runner = GpuRunner(worker_program, arena)
    rng = np.random.default_rng(23)
    for batch in (1, 4, 4, 16):  # 4 twice: the second replays the graph, into the same blocks
        x = arena.alloc((batch, 3, 32, 32), np.float32)
        x[:] = rng.standard_normal(x.shape)
        want = program.run({"x": np.array(x)})
        name, ref = next(iter(want.items()))
        out = {name: arena.alloc(ref.shape, ref.dtype)}
        got = runner.run({"x": x}, out)
        assert got[name] is out[name]  # written in place, no copy handed back
        np.testing.assert_allclose(out[name], ref, rtol=1e-4, atol=1e-5)
        assert set(runner.timings) == {"h2d", "d2h", "gpu_wait", "run"} and runner.timings["h2d"] >= 0
        arena.free(x)
        arena.free(out[name])
    assert runner._registered and all(v > 0 for v in runner._registered.values())  # page-locked blocks


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_wait_block_answers_as_poll_does(resnet):
    import kiln
    path, program = resnet
    blocking = kiln.load(path, device="cuda", output="numpy", wait="block")
    assert blocking.options.wait == "block" and program.options.wait == "poll"
    x = np.random.default_rng(29).standard_normal((8, 3, 32, 32)).astype(np.float32)
    for _ in range(3):  # capture, then replays
        a, b = blocking.run({"x": x}), program.run({"x": x})
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_sigterm_with_gpu_batches_in_flight_answers_all_and_exits_0(resnet):
    """SIGTERM while 32 clients keep batches on the GPU: every request sent is answered (200 equal to the
    program, or 503 once draining refuses new ones), none is cut off, and the server exits 0."""
    import httpx
    path, program = resnet
    server = _serve([str(path), "--name", "r18", "--device", "cuda", "--max-batch-size", "16"])
    try:
        url = server.url + "/v2/models/r18/infer"
        rng = np.random.default_rng(31)
        xs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(32 * 40)]
        results, errors = [], []

        def client(k):
            with httpx.Client() as c:
                for i in range(k * 40, (k + 1) * 40):
                    try:
                        r = _infer(c, url, xs[i])
                    except httpx.ConnectError:  # the listener is closed: this request was never sent
                        return
                    except httpx.TransportError as e:  # sent and cut off: what draining must never do
                        errors.append((i, f"{type(e).__name__}: {e}"))
                        return
                    results.append((i, r.status_code, r.json() if r.status_code == 200 else r.text))
                    if r.status_code == 503:
                        return

        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(client, k) for k in range(32)]
            time.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            for f in futures:
                f.result(timeout=120)
        assert server.proc.wait(60) == 0, "".join(server.output)
        assert errors == [], errors[:3]
        ok = [(i, body) for i, status, body in results if status == 200]
        assert ok and all(status in (200, 503) for _, status, _ in results), results[:3]
        for i, body in ok:
            [out] = body["outputs"]
            want = next(iter(program.run({"x": xs[i]}).values()))
            np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(out["shape"]), want,
                                       rtol=1e-3, atol=1e-4)
        assert "Traceback" not in "".join(server.output)
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
def test_copy_histograms_and_nvml_gauges_on_a_real_gpu(resnet):
    import httpx
    path, _ = resnet
    server = _serve([str(path), "--name", "r18", "--device", "cuda", "--max-batch-size", "16"])
    try:
        url = server.url + "/v2/models/r18/infer"
        with httpx.Client() as c:
            for _ in range(5):
                assert _infer(c, url, np.ones((1, 3, 32, 32), np.float32)).status_code == 200
        text = httpx.get(server.url + "/metrics").text
        for direction in ("h2d", "d2h"):
            m = re.search(r'^kiln_copy_duration_seconds_count\{[^}]*direction="%s"[^}]*\} (\S+)$' % direction,
                          text, re.M)
            assert m and float(m.group(1)) >= 5, direction
        assert re.search(r'^kiln_gpu_wait_duration_seconds_count\{[^}]*\} (\S+)$', text, re.M)
        try:
            import pynvml  # noqa: F401
        except ImportError:
            return  # the NVML gauges are absent without nvidia-ml-py (tested with a fake in test_gpu_metrics)
        total = re.search(r'^nv_gpu_memory_total_bytes\{gpu_uuid="GPU-[^"]+"\} (\S+)$', text, re.M)
        assert total and float(total.group(1)) > 1e9, text[-2000:]
        util = re.search(r'^nv_gpu_utilization\{gpu_uuid="GPU-[^"]+"\} (\S+)$', text, re.M)
        assert util and 0.0 <= float(util.group(1)) <= 1.0
    finally:
        assert server.stop() == 0, "".join(server.output)


def _cudashm():
    try:
        import tritonclient.http  # noqa: F401
        from tritonclient.utils import cuda_shared_memory
    except (ImportError, RuntimeError) as e:  # RuntimeError: tritonclient's own "needs cuda-python"
        pytest.skip(f"tritonclient's CUDA shared memory utilities: {e}")
    return cuda_shared_memory


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_cuda_shared_memory_with_tritonclient(resnet, monkeypatch, transport):
    """16 clients, each with its own CUDA regions (tritonclient's cuda_shared_memory: cudaMalloc + IPC
    handle), 8 distinct inputs each: inputs from a region, outputs into a region (or in the response), every
    answer equal to CudaProgram.run on that input alone; device rows stack in batches (mean batch > 1);
    unregistered regions are refused afterwards. Over HTTP (tritonclient.http) and over gRPC
    (tritonclient.grpc, issue 25): one set of regions serves both protocols."""
    cudashm = _cudashm()
    if transport == "grpc":
        tc = pytest.importorskip("tritonclient.grpc")
    else:
        import tritonclient.http as tc
    path, program = resnet
    out_name = program.outputs[0].name
    monkeypatch.setenv("KILN_ALLOW_CLIENT_SHM", "1")
    server = _serve([str(path), "--name", "r18", "--device", "cuda", "--max-batch-size", "16",
                     "--max-queue-delay-ms", "2"])
    try:
        url = server.url.split("://", 1)[-1]
        if transport == "grpc":
            url = re.search(r"gRPC at (127\.0\.0\.1:\d+)", "".join(server.output)).group(1)
        rng = np.random.default_rng(31)
        per_client, n_clients = 8, 16
        xs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(per_client * n_clients)]
        wants = [program.run({"x": x})[out_name] for x in xs]
        y_bytes = wants[0].nbytes

        # tritonclient's CUDA utilities share one global stream per device, created by the first call and
        # destroyed with the last region: regions are made and destroyed here, and their calls serialized.
        regions = [(cudashm.create_shared_memory_region(f"in{k}", xs[0].nbytes, 0),
                    cudashm.create_shared_memory_region(f"out{k}", y_bytes, 0)) for k in range(n_clients)]
        cuda_lock = threading.Lock()

        def client(k):
            c = tc.InferenceServerClient(url)
            hin, hout = regions[k]
            got = []
            try:
                c.register_cuda_shared_memory(f"in{k}", cudashm.get_raw_handle(hin), 0, xs[0].nbytes)
                c.register_cuda_shared_memory(f"out{k}", cudashm.get_raw_handle(hout), 0, y_bytes)
                for i in range(k * per_client, (k + 1) * per_client):
                    with cuda_lock:
                        cudashm.set_shared_memory_region(hin, [xs[i]])
                    inp = tc.InferInput("x", list(xs[i].shape), "FP32")
                    inp.set_shared_memory(f"in{k}", xs[i].nbytes)
                    out = tc.InferRequestedOutput(out_name) if transport == "grpc" else \
                        tc.InferRequestedOutput(out_name, binary_data=True)
                    to_region = i % 2 == 0  # every other answer comes in the response instead
                    if to_region:
                        out.set_shared_memory(f"out{k}", y_bytes)
                    result = c.infer("r18", [inp], outputs=[out])
                    if to_region:
                        with cuda_lock:
                            y = cudashm.get_contents_as_numpy(hout, np.float32, list(wants[i].shape))
                    else:
                        y = result.as_numpy(out_name)
                    got.append((i, np.array(y)))
                c.unregister_cuda_shared_memory(f"in{k}")
                with pytest.raises(Exception, match=f"no system or CUDA shared memory region named 'in{k}'"):
                    c.infer("r18", [inp], outputs=[out])
                c.unregister_cuda_shared_memory(f"out{k}")
            finally:
                c.close()
            return got

        try:
            with ThreadPoolExecutor(n_clients) as pool:
                answers = [a for part in pool.map(client, range(n_clients)) for a in part]
        finally:
            for hin, hout in regions:
                cudashm.destroy_shared_memory_region(hin)
                cudashm.destroy_shared_memory_region(hout)
        assert sorted(i for i, _ in answers) == list(range(len(xs)))
        for i, y in answers:
            np.testing.assert_allclose(y, wants[i], rtol=1e-3, atol=1e-4)
        assert _mean_batch(server) > 1.0
        c = tc.InferenceServerClient(url)
        if transport == "grpc":
            assert not c.get_cuda_shared_memory_status().regions
            assert "cuda_shared_memory" in c.get_server_metadata().extensions
        else:
            assert c.get_cuda_shared_memory_status() == []
            assert "cuda_shared_memory" in c.get_server_metadata()["extensions"]
        c.close()
    finally:
        assert server.stop() == 0, "".join(server.output)
