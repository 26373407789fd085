"""``kiln serve`` as users run it: a real uvicorn process on 127.0.0.1 (a free port, ``--port 0``), real
worker processes, the real ``tritonclient[http]`` client.

Covers the issue's acceptance checks that need a process: the Triton client end to end (JSON and binary
data both ways), 64 concurrent clients x 2,000 requests with distinct random inputs all answered
correctly (none lost, none mixed up across a batch), SIGTERM with requests in flight (all answered, exit
0), a killed worker (its request gets 500 promptly, later ones succeed), a repository with two models and
two versions, and the CLI's clear errors. Loads are bounded in count and time. No torch.
"""
from __future__ import annotations

import json
import os
import signal
import socket
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
httpx = pytest.importorskip("httpx")

import kiln  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.server.attacks import ServeProcess  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
KILN = [sys.executable, "-m", "kiln"]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


# --------------------------------------------------------------------------------------------- models
def mlp_model(path: Path, seed: int) -> Path:
    """x: float32[batch, 16] -> 8 -> 3, weights from ``seed`` (distinct versions give distinct outputs)."""
    rng = np.random.default_rng(seed)
    g = Graph(f"mlp{seed}")
    h = g.add_input("x", "float32", ("batch", 16))
    h = g.op("Relu", g.op("Gemm", h, g.add_initializer("w0", rng.standard_normal((8, 16)).astype(np.float32)),
                          g.add_initializer("b0", rng.standard_normal(8).astype(np.float32)), transB=1))
    y = g.op("Gemm", h, g.add_initializer("w1", rng.standard_normal((3, 8)).astype(np.float32)),
             g.add_initializer("b1", np.zeros(3, np.float32)), transB=1, name="y")
    g.outputs = [y]
    path.parent.mkdir(parents=True, exist_ok=True)
    kiln.save(g, path)
    return path


def int_model(path: Path) -> Path:
    """y = x * 3 on int32[2, 2]: no batch dim, so it runs request by request."""
    g = Graph("ints")
    x = g.add_input("x", "int32", (2, 2))
    g.outputs = [g.op("Mul", x, g.add_initializer("k", np.array(3, np.int32)), name="y")]
    path.parent.mkdir(parents=True, exist_ok=True)
    kiln.save(g, path)
    return path


def slow_model(path: Path, layers: int = 96, width: int = 1024) -> Path:
    """``layers`` x Tanh(MatMul(h, W)) with one shared W: about a second or more per 1024-row request."""
    rng = np.random.default_rng(0)
    g = Graph("slow")
    h = g.add_input("x", "float32", ("batch", width))
    w = g.add_initializer("w", (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
    for _ in range(layers):
        h = g.op("Tanh", g.op("MatMul", h, w))
    g.outputs = [g.op("Identity", h, name="y")]
    kiln.save(g, path)
    return path


# --------------------------------------------------------------------------------------------- server
class Served(ServeProcess):
    """A ``kiln serve`` process (kiln.server.attacks.ServeProcess: its URL from the ready line, its
    output, metric(), stop()), plus the worker processes it started."""

    def __init__(self, args: list[str], ready_timeout: float = 120.0):
        super().__init__(args, ready_timeout=ready_timeout)

    def worker_pids(self) -> list[int]:
        """The server's worker processes: its child processes, less a multiprocessing resource tracker."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the thread exited
                continue
            for pid in children:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:  # the child exited
                    continue
                if b"resource_tracker" not in cmdline:
                    pids.append(int(pid))
        return pids


@pytest.fixture(scope="module")
def mlp_server():
    server = Served([str(MLP), "--name", "mlp", "--workers", "1", "--max-batch-size", "32"])
    yield server
    assert server.stop() == 0, "".join(server.output)


@pytest.fixture(scope="module")
def program():
    return kiln.load(MLP)


def post_json(client, url: str, x: np.ndarray, name: str = "x", datatype: str = "FP32", **kw):
    body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}]}
    return client.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"}, **kw)


def outputs_of(r) -> dict:
    assert r.status_code == 200, r.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}


# ---------------------------------------------------------------------------------------------- tests
def test_tritonclient_end_to_end(mlp_server, program):
    tc = pytest.importorskip("tritonclient.http")
    client = tc.InferenceServerClient(mlp_server.url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
        assert not client.is_model_ready("nope")
        meta = client.get_model_metadata("mlp")
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}]
        assert [o["name"] for o in meta["outputs"]] == ["logits", "probs"]
        assert client.get_server_metadata()["name"] == "kiln"
        rng = np.random.default_rng(0)
        for binary in (False, True):
            x = rng.standard_normal((4, 16)).astype(np.float32)
            inp = tc.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            outs = [tc.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "probs")]
            result = client.infer("mlp", [inp], outputs=outs, request_id=f"r{binary}")
            want = program.run({"x": x})
            for name in ("logits", "probs"):
                np.testing.assert_array_equal(result.as_numpy(name).astype(np.float32), want[name])
            assert result.get_response()["id"] == f"r{binary}"
        # Default outputs, binary (tritonclient sends binary_data_output), and Triton's timeout parameter.
        result = client.infer("mlp", [inp], model_version="1", timeout=10_000_000)
        np.testing.assert_array_equal(result.as_numpy("probs"), program.run({"x": x})["probs"])
        # A server error surfaces in the client with the server's message.
        bad = tc.InferInput("x", [1, 15], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 15), np.float32))
        with pytest.raises(Exception, match="expected float32"):
            client.infer("mlp", [bad])
    finally:
        client.close()


def test_64_clients_2000_requests_all_correct(mlp_server, program):
    """Distinct random inputs of 1-3 rows from 64 concurrent clients: every response is Program.run on that
    request alone (batching must not mix rows up), none is lost, and requests were really batched."""
    n_clients, n_requests = 64, 2000
    rng = np.random.default_rng(42)
    inputs = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32) for _ in range(n_requests)]
    url = mlp_server.url + "/v2/models/mlp/infer"
    success0 = mlp_server.metric('nv_inference_request_success{model="mlp",version="1"}')
    execs0 = mlp_server.metric('nv_inference_exec_count{model="mlp",version="1"}')
    results: list = [None] * n_requests
    local = threading.local()

    def send(i: int) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=60)
        results[i] = post_json(client, url, inputs[i])

    start = time.monotonic()
    with ThreadPoolExecutor(n_clients) as pool:
        list(pool.map(send, range(n_requests)))
    elapsed = time.monotonic() - start
    for x, r in zip(inputs, results):
        got, want = outputs_of(r), program.run({"x": x})
        # allclose, not equal: a row's GEMM inside a larger batch may round differently in the last bit;
        # a mix-up between requests would be off by far more.
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["probs"], want["probs"], rtol=1e-5, atol=1e-6)
    assert mlp_server.metric('nv_inference_request_success{model="mlp",version="1"}') - success0 == n_requests
    execs = mlp_server.metric('nv_inference_exec_count{model="mlp",version="1"}') - execs0
    assert 0 < execs < n_requests, f"{execs} batches for {n_requests} requests: nothing was batched"
    print(f"{n_requests} requests from {n_clients} clients in {elapsed:.1f} s, {execs:.0f} batches")


def test_sigterm_with_requests_in_flight_answers_all_and_exits_0(tmp_path):
    # A big request keeps the one worker busy for a second or more; small ones queue behind it (the batcher
    # holds them while every slot is busy): SIGTERM arrives with one batch running and the rest queued.
    model = slow_model(tmp_path / "slow.kiln")
    server = Served([str(model), "--workers", "1", "--max-batch-size", "1024", "--max-queue-delay-ms", "5000"])
    try:
        program = kiln.load(model)
        rng = np.random.default_rng(1)
        big = np.full((1024, 1024), 0.01, np.float32)
        header = json.dumps({"inputs": [{"name": "x", "shape": [1024, 1024], "datatype": "FP32",
                                         "parameters": {"binary_data_size": big.nbytes}}]}).encode()
        inputs = [rng.standard_normal((1, 1024)).astype(np.float32) for _ in range(16)]
        url = server.url + "/v2/models/slow/infer"
        pending = 'nv_inference_pending_request_count{model="slow",version="1"}'
        with ThreadPoolExecutor(1 + len(inputs)) as pool:
            first = pool.submit(httpx.post, url, content=header + big.tobytes(), timeout=120,
                                headers={"Inference-Header-Content-Length": str(len(header))})
            time.sleep(0.5)  # uploaded and computing (the pending count below confirms the small ones queue)
            deadline = time.monotonic() + 30
            # They wait behind the big one, which takes several seconds on a loaded 2-core box: more
            # than httpx's default 5 s timeout.
            futures = [pool.submit(lambda x: post_json(httpx, url, x, timeout=120), x) for x in inputs]
            while server.metric(pending) < len(inputs):
                assert time.monotonic() < deadline and not first.done(), "requests never queued"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            responses = [f.result(timeout=120) for f in futures]
            first_response = first.result(timeout=120)
        assert first_response.status_code == 200, first_response.text
        for x, r in zip(inputs, responses):
            # 96 layers deep: batched GEMMs round differently from a lone row by more than in the MLP;
            # a mix-up between requests (random inputs) would be off by far more.
            np.testing.assert_allclose(outputs_of(r)["y"], program.run({"x": x})["y"], rtol=1e-3, atol=1e-5)
        assert server.proc.wait(60) == 0, "".join(server.output)
        assert "Traceback" not in "".join(server.output)
    finally:
        server.stop()


def test_killed_worker_fails_its_request_with_500_and_is_replaced(tmp_path):
    model = slow_model(tmp_path / "slow.kiln")
    server = Served([str(model), "--workers", "1", "--max-batch-size", "0", "--log-level", "error"])
    try:
        url = server.url + "/v2/models/slow/infer"
        [worker] = server.worker_pids()
        x = np.full((1024, 1024), 0.01, np.float32)
        header = json.dumps({"inputs": [{"name": "x", "shape": [1024, 1024], "datatype": "FP32",
                                         "parameters": {"binary_data_size": x.nbytes}}]}).encode()
        body = header + x.tobytes()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url, content=body, timeout=60,
                                  headers={"Inference-Header-Content-Length": str(len(header))})
            time.sleep(0.5)  # uploaded and computing: the request takes seconds
            assert not pending.done(), pending.result().text
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            r = pending.result(timeout=30)
            answered_s = time.monotonic() - killed
        assert r.status_code == 500 and "died" in r.json()["error"], r.text
        assert answered_s < 10, f"the request was answered {answered_s:.1f} s after its worker died"
        # A replacement worker comes up and serves later requests.
        deadline = time.monotonic() + 60
        while True:
            small = np.full((2, 1024), 0.01, np.float32)
            r = post_json(httpx, url, small)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        np.testing.assert_allclose(outputs_of(r)["y"], kiln.load(model).run({"x": small})["y"], rtol=1e-5, atol=1e-6)
        assert worker not in server.worker_pids() and len(server.worker_pids()) == 1
    finally:
        assert server.stop() == 0, "".join(server.output)


def test_repository_with_two_models_and_two_versions(tmp_path):
    repo = tmp_path / "repo"
    mlp_model(repo / "mlp" / "1" / "model.kiln", seed=1)
    mlp_model(repo / "mlp" / "2" / "model.kiln", seed=2)
    (repo / "mlp" / "config.json").write_text(json.dumps({"version_policy": "all", "max_batch_size": 4}))
    int_model(repo / "ints" / "1" / "model.kiln")
    (repo / "ints" / "config.json").write_text(json.dumps({"workers": 0}))
    server = Served([str(repo), "--max-body-mb", "1"])
    try:
        out = "".join(server.output)
        assert "mlp version 1" in out and "mlp version 2" in out and "ints version 1" in out
        x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
        with httpx.Client(base_url=server.url) as client:
            assert client.get("/v2/models/mlp").json()["versions"] == ["1", "2"]
            for version in ("1", "2"):
                assert client.get(f"/v2/models/mlp/versions/{version}/ready").status_code == 200
                got = outputs_of(post_json(client, f"/v2/models/mlp/versions/{version}/infer", x))["y"]
                want = kiln.load(repo / "mlp" / version / "model.kiln").run({"x": x})["y"]
                np.testing.assert_allclose(got, want, rtol=1e-6)
            latest = post_json(client, "/v2/models/mlp/infer", x)
            assert latest.json()["model_version"] == "2"
            assert post_json(client, "/v2/models/mlp/infer", np.zeros((5, 16), np.float32)).status_code == 400
            ints = np.array([[1, -2], [3, 4]], np.int32)
            got = outputs_of(post_json(client, "/v2/models/ints/infer", ints, datatype="INT32"))["y"]
            np.testing.assert_array_equal(got, ints * 3)
            # Over --max-body-mb: a 413 answer, not a connection reset, though the body is still arriving.
            r = client.post("/v2/models/mlp/infer", content=b"x" * (8 << 20))
            assert r.status_code == 413 and "1,048,576" in r.json()["error"]
    finally:
        assert server.stop() == 0, "".join(server.output)


# ---------------------------------------------------------------------------------------------- CLI errors
def _serve_fails(args: list[str]) -> str:
    r = subprocess.run(KILN + ["serve", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("kiln serve: error: ")
    return r.stderr


def test_missing_path_is_a_clear_error(tmp_path):
    assert "no such file" in _serve_fails([str(tmp_path / "missing.kiln")])


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert "already in use" in _serve_fails([str(MLP), "--host", "127.0.0.1", "--port", str(port)])


def test_model_that_fails_to_load_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(b"KILN but not really a model file")
    assert "loading models failed" in _serve_fails([str(bad), "--host", "127.0.0.1", "--port", "0"])
