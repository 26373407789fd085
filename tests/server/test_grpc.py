"""``kiln serve``'s gRPC endpoint (server/grpc_server.py) against a real process on 127.0.0.1, through the
real ``tritonclient.grpc``: every RPC served, answers equal to ``Program.run``, the bad-input cases mapped to
gRPC status codes with the message HTTP gives, a stream of 1,000 distinct requests (none lost, each right),
and SIGTERM with a stream open (what the server read is answered, then exit 0)."""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
tc = pytest.importorskip("tritonclient.grpc")
httpx = pytest.importorskip("httpx")

import kiln  # noqa: E402
from kiln.server.attacks import ServeProcess  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' own helpers, under --import-mode=importlib
from test_serve_process import slow_model  # noqa: E402  (layers x Tanh(MatMul): about 1.5 s for 16,384 rows of 256)

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def grpc_address(server: ServeProcess) -> str:
    m = re.search(r"gRPC at (127\.0\.0\.1:\d+)", "".join(server.output))
    assert m, "".join(server.output)
    return m.group(1)


@pytest.fixture(scope="module")
def server():
    s = ServeProcess([str(MLP), "--name", "mlp", "--workers", "1", "--max-batch-size", "32", "--allow-client-shm"])
    yield s
    assert s.stop() == 0, "".join(s.output)


@pytest.fixture(scope="module")
def client(server):
    c = tc.InferenceServerClient(grpc_address(server))
    yield c
    c.close()


@pytest.fixture(scope="module")
def program():
    return kiln.load(MLP)


def infer_input(x: np.ndarray, name: str = "x", datatype: str = "FP32"):
    i = tc.InferInput(name, list(x.shape), datatype)
    i.set_data_from_numpy(x)
    return i


def status_of(call) -> tuple:
    with pytest.raises(tc.InferenceServerException) as e:
        call()
    return e.value.status(), e.value.message()


# ------------------------------------------------------------------------------------------------ calls
def test_health_metadata_config_stats_index(client, server):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "kiln" and "binary_tensor_data" in meta["extensions"]
    http = httpx.get(f"{server.url}/v2/models/mlp").json()
    model = client.get_model_metadata("mlp", as_json=True)
    assert model["name"] == "mlp" and model["versions"] == ["1"]
    for kind in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model[kind]] == \
            [(t["name"], t["datatype"], t["shape"]) for t in http[kind]]
    config = client.get_model_config("mlp").config
    http_config = httpx.get(f"{server.url}/v2/models/mlp/config").json()
    assert config.name == "mlp" and config.max_batch_size == http_config["max_batch_size"] == 32
    assert [i.name for i in config.input] == ["x"] and list(config.input[0].dims) == [16]
    assert json.loads(config.parameters["kiln"].string_value)["version"] == "1"
    stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("mlp", "1")]
    assert client.get_model_repository_index(as_json=True)["models"] == [
        {"name": "mlp", "version": "1", "state": "READY"}]


def test_infer_equals_program_run(client, program):
    rng = np.random.default_rng(1)
    for rows in (1, 3, 32):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        r = client.infer("mlp", [infer_input(x)], request_id=f"r{rows}")
        want = program.run({"x": x})
        assert r.get_response().id == f"r{rows}"
        for name, value in want.items():
            np.testing.assert_allclose(r.as_numpy(name), value, rtol=1e-5, atol=1e-6)
    # one output asked for: only it comes back
    r = client.infer("mlp", [infer_input(x)], outputs=[tc.InferRequestedOutput("probs")])
    assert [o.name for o in r.get_response().outputs] == ["probs"]
    np.testing.assert_allclose(r.as_numpy("probs"), program.run({"x": x})["probs"], rtol=1e-5, atol=1e-6)


def test_typed_contents(server, program):
    """contents.fp32_contents instead of raw_input_contents (what KServe's own clients may send)."""
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 32
    with grpc.insecure_channel(grpc_address(server)) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        req = pb.ModelInferRequest(model_name="mlp", id="typed")
        t = req.inputs.add(name="x", datatype="FP32", shape=[2, 16])
        t.contents.fp32_contents.extend(x.ravel().tolist())
        resp = stub.ModelInfer(req)
        assert resp.id == "typed" and [o.name for o in resp.outputs] == ["logits", "probs"]
        logits = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(resp.outputs[0].shape)
        np.testing.assert_allclose(logits, program.run({"x": x})["logits"], rtol=1e-5, atol=1e-6)
        # contents in the field of another datatype
        t.contents.Clear()
        t.contents.int_contents.extend([1] * 32)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fp32_contents" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.TraceSetting(pb.TraceSettingRequest())
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "TraceSetting" in e.value.details()


# ------------------------------------------------------------------------------------------------ errors
def test_bad_inputs_map_to_status_codes_with_http_messages(client, server):
    def http_error(x, datatype="FP32", name="x"):
        body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}]}
        r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=json.dumps(body))
        assert r.status_code == 400, r.text
        return r.json()["error"]

    cases = [(np.zeros((2, 15), np.float32), "FP32", "x"),  # a fixed dim wrong
             (np.zeros((2, 16), np.int32), "INT32", "x"),  # the wrong datatype
             (np.zeros((2, 16), np.float32), "FP32", "z")]  # an unknown input
    for x, datatype, name in cases:
        code, message = status_of(lambda: client.infer("mlp", [infer_input(x, name, datatype)]))
        assert code == "StatusCode.INVALID_ARGUMENT"
        assert message == http_error(x, datatype, name)
    code, message = status_of(lambda: client.infer("nope", [infer_input(np.zeros((1, 16), np.float32))]))
    assert code == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in message
    code, _ = status_of(lambda: client.is_model_ready("nope"))
    assert code == "StatusCode.NOT_FOUND"
    code, message = status_of(lambda: client.get_model_metadata("mlp", "7"))
    assert code == "StatusCode.NOT_FOUND" and "no version '7'" in message
    # a declared shape over the element limit (from the shape alone), and a message over --max-body-mb
    i = tc.InferInput("x", [1, 16], "FP32")
    i.set_data_from_numpy(np.zeros((1, 16), np.float32))
    i._input.ClearField("shape")
    i._input.shape.extend([1 << 27, 16])
    code, message = status_of(lambda: client.infer("mlp", [i]))
    assert code == "StatusCode.RESOURCE_EXHAUSTED" and "limit" in message
    big = np.zeros(((65 << 20) // 64, 16), np.float32)
    code, _ = status_of(lambda: client.infer("mlp", [infer_input(big)]))
    assert code == "StatusCode.RESOURCE_EXHAUSTED"
    assert client.is_server_ready()


def test_error_codes_of_http_statuses():
    from kiln.server.grpc_server import code_of
    assert code_of(400) == grpc.StatusCode.INVALID_ARGUMENT and code_of(404) == grpc.StatusCode.NOT_FOUND
    assert code_of(413) == grpc.StatusCode.RESOURCE_EXHAUSTED and code_of(503) == grpc.StatusCode.UNAVAILABLE
    assert code_of(504) == grpc.StatusCode.DEADLINE_EXCEEDED and code_of(500) == grpc.StatusCode.INTERNAL


# ------------------------------------------------------------------------------------------------ streams
class Collector:
    def __init__(self):
        self.results, self.errors, self.done = [], [], threading.Condition()

    def __call__(self, result, error):
        with self.done:
            (self.errors if error is not None else self.results).append(result if error is None else error)
            self.done.notify_all()

    def wait(self, n: int, timeout: float = 30.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) + len(self.errors) >= n, timeout), \
                (len(self.results), len(self.errors))


def test_stream_of_1000_distinct_requests(client, program):
    n = 1000
    x = np.random.default_rng(7).standard_normal((n, 1, 16)).astype(np.float32)
    got = Collector()
    client.start_stream(callback=got)
    try:
        for k in range(n):
            client.async_stream_infer("mlp", [infer_input(x[k])], request_id=str(k))
            if k == 500:  # a bad request in the stream: an error for it alone, and the stream goes on
                client.async_stream_infer("mlp", [infer_input(np.zeros((1, 15), np.float32))], request_id="bad")
        got.wait(n + 1)
    finally:
        client.stop_stream()
    assert len(got.errors) == 1 and "15" in got.errors[0].message(), got.errors
    ids = [r.get_response().id for r in got.results]
    assert sorted(ids, key=int) == [str(k) for k in range(n)]
    assert ids == [str(k) for k in range(n)]  # in request order
    want = program.run({"x": x.reshape(n, 16)})["logits"]
    out = np.stack([r.as_numpy("logits")[0] for r in got.results])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_sigterm_with_a_stream_open(program):
    s = ServeProcess([str(MLP), "--name", "mlp", "--workers", "1"])
    try:
        c = tc.InferenceServerClient(grpc_address(s))
        got = Collector()
        c.start_stream(callback=got)
        x = np.random.default_rng(3).standard_normal((200, 1, 16)).astype(np.float32)
        for k in range(100):
            c.async_stream_infer("mlp", [infer_input(x[k])], request_id=str(k))
        got.wait(1)
        s.proc.send_signal(15)
        for k in range(100, 200):
            c.async_stream_infer("mlp", [infer_input(x[k])], request_id=str(k))
        assert s.proc.wait(timeout=20) == 0, "".join(s.output)
        got.wait(1)
        c.stop_stream()
        ids = [int(r.get_response().id) for r in got.results]
        assert ids == list(range(len(ids))) and len(ids) >= 1  # answered in order, none skipped
        for k, r in zip(ids, got.results):
            np.testing.assert_allclose(r.as_numpy("logits"), program.run({"x": x[k]})["logits"], rtol=1e-4, atol=1e-5)
        assert all("shutting down" in e.message() or "unavailable" in e.message().lower() for e in got.errors)
        c.close()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_cli_grpc_flags():
    r = subprocess.run([sys.executable, "-m", "kiln", "serve", str(MLP), "--grpc-port", "5", "--no-grpc"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--no-grpc" in r.stderr


# ------------------------------------------------------------------------------------------------ shared memory
def test_system_shared_memory_over_grpc(client, server, program):
    """tritonclient's shared memory utilities end to end: regions registered over gRPC (the HTTP app's one
    registry: HTTP lists them and serves requests naming them), an input read from one and both outputs
    written into another at offsets, HTTP's messages on refusals, unregister one and all."""
    import tritonclient.utils.shared_memory as shm
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    want = program.run({"x": x})
    out_bytes = want["logits"].nbytes
    key = f"/kiln_test_grpc_{os.getpid()}"
    h_in = shm.create_shared_memory_region("in", key + "_in", x.nbytes)
    h_out = shm.create_shared_memory_region("out", key + "_out", 2 * out_bytes)
    try:
        shm.set_shared_memory_region(h_in, [x])
        client.register_system_shared_memory("g_in", key + "_in", x.nbytes)
        client.register_system_shared_memory("g_out", key + "_out", 2 * out_bytes)
        status = client.get_system_shared_memory_status()
        assert sorted(status.regions) == ["g_in", "g_out"]
        assert (status.regions["g_in"].key, status.regions["g_in"].byte_size) == (key + "_in", x.nbytes)
        assert [r["name"] for r in httpx.get(f"{server.url}/v2/systemsharedmemory/status").json()] == ["g_in", "g_out"]
        assert list(client.get_system_shared_memory_status("g_out").regions) == ["g_out"]
        assert "system_shared_memory" in client.get_server_metadata(as_json=True)["extensions"]

        i = tc.InferInput("x", [4, 16], "FP32")
        i.set_shared_memory("g_in", x.nbytes)
        outs = [tc.InferRequestedOutput("logits"), tc.InferRequestedOutput("probs")]
        outs[0].set_shared_memory("g_out", out_bytes)
        outs[1].set_shared_memory("g_out", out_bytes, offset=out_bytes)
        r = client.infer("mlp", [i], outputs=outs, request_id="shm")
        resp = r.get_response()
        assert resp.id == "shm" and list(resp.raw_output_contents) == [b"", b""]
        probs = r.get_output("probs")
        assert probs.parameters["shared_memory_region"].string_param == "g_out"
        assert probs.parameters["shared_memory_offset"].int64_param == out_bytes
        assert probs.parameters["shared_memory_byte_size"].int64_param == out_bytes
        for k, name in enumerate(("logits", "probs")):
            got = shm.get_contents_as_numpy(h_out, np.float32, list(want[name].shape), offset=k * out_bytes)
            np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6)
        # the input from shared memory, the outputs in the response
        r = client.infer("mlp", [i])
        np.testing.assert_allclose(r.as_numpy("logits"), want["logits"], rtol=1e-5, atol=1e-6)
        # HTTP serves a request naming a region registered over gRPC
        body = {"inputs": [{"name": "x", "shape": [4, 16], "datatype": "FP32", "parameters": {
            "shared_memory_region": "g_in", "shared_memory_byte_size": x.nbytes}}]}
        http = httpx.post(f"{server.url}/v2/models/mlp/infer", content=json.dumps(body))
        assert http.status_code == 200, http.text
        np.testing.assert_allclose(np.array(http.json()["outputs"][0]["data"]).reshape(4, 4), want["logits"],
                                   rtol=1e-5, atol=1e-6)

        # refusals: the HTTP side's messages, INVALID_ARGUMENT
        def same_as_http(grpc_call, http_path, http_body=None):
            code, message = status_of(grpc_call)
            r = httpx.post(f"{server.url}{http_path}", content=json.dumps(http_body)) if http_body is not None \
                else httpx.get(f"{server.url}{http_path}")
            assert code == "StatusCode.INVALID_ARGUMENT" and r.status_code == 400, (code, r.text)
            assert message == r.json()["error"]
            return message

        bad = tc.InferInput("x", [4, 16], "FP32")
        bad.set_shared_memory("g_in", x.nbytes - 4)  # the wrong byte size for the shape
        body["inputs"][0]["parameters"]["shared_memory_byte_size"] = x.nbytes - 4
        assert "needs 256" in same_as_http(lambda: client.infer("mlp", [bad]), "/v2/models/mlp/infer", body)
        assert "already registered" in same_as_http(
            lambda: client.register_system_shared_memory("g_in", key + "_in", x.nbytes),
            "/v2/systemsharedmemory/region/g_in/register", {"key": key + "_in", "byte_size": x.nbytes})
        assert "past the end" in same_as_http(
            lambda: client.register_system_shared_memory("g_big", key + "_in", x.nbytes + 1),
            "/v2/systemsharedmemory/region/g_big/register", {"key": key + "_in", "byte_size": x.nbytes + 1})
        assert "no system shared memory region named 'nope'" in same_as_http(
            lambda: client.get_system_shared_memory_status("nope"), "/v2/systemsharedmemory/region/nope/status")
        # a CUDA region on this CPU-only server: refused as over HTTP; none listed
        handle = base64.b64encode(bytes(64))
        assert "GPU" in same_as_http(
            lambda: client.register_cuda_shared_memory("g_cuda", handle, 0, 64),
            "/v2/cudasharedmemory/region/g_cuda/register",
            {"raw_handle": {"b64": handle.decode()}, "device_id": 0, "byte_size": 64})
        assert not client.get_cuda_shared_memory_status().regions
        client.unregister_cuda_shared_memory()

        client.unregister_system_shared_memory("g_in")
        client.unregister_system_shared_memory("g_in")  # an unknown name is not an error
        assert list(client.get_system_shared_memory_status().regions) == ["g_out"]
        code, message = status_of(lambda: client.infer("mlp", [i]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "no system shared memory region named 'g_in'" in message
    finally:
        client.unregister_system_shared_memory()  # every region
        assert not client.get_system_shared_memory_status().regions
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)


# ------------------------------------------------------------------------------------------------ queue, deadline
def busy_model(path: Path, rows: int, seconds: float) -> Path:
    """slow_model, deep enough that a ``rows`` x 256 request keeps a worker busy at least ``seconds`` on
    this machine (timed here with every core: a worker has no more); 48 layers take ~1.5 s on 2 cores but
    ~0.1 s on 16, where the queue this test builds would drain before it is looked at."""
    probe = kiln.load(slow_model(path, layers=8, width=256))
    x = np.full((2048, 256), 0.01, np.float32)
    probe.run({"x": x})
    t0 = time.perf_counter()
    probe.run({"x": x})
    per_layer = (time.perf_counter() - t0) / 8 * (rows / 2048)
    return slow_model(path, layers=max(48, int(np.ceil(seconds / per_layer))), width=256)


def test_full_queue_is_unavailable_and_deadlines_are_deadline_exceeded(tmp_path):
    """One worker busy with a big request, a queue of 2: a queued request past its deadline (Triton's
    ``timeout`` parameter: the server's) gets DEADLINE_EXCEEDED with HTTP's 504 message, the request past a
    full queue UNAVAILABLE with HTTP's 503 message, a client deadline shorter than the wait
    DEADLINE_EXCEEDED; the metrics count them under protocol="grpc". Also: this server does not allow client
    shared memory, and says so over gRPC as over HTTP."""
    s = ServeProcess([str(busy_model(tmp_path / "slow.kiln", rows=16384, seconds=2.5)), "--workers", "1",
                      "--max-batch-size", "0", "--queue-size", "2"])
    try:
        c = tc.InferenceServerClient(grpc_address(s))
        small = np.full((1, 256), 0.01, np.float32)
        done = Collector()
        pending = 'nv_inference_pending_request_count{model="slow",version="1"}'

        def wait_pending(n: int) -> None:
            deadline = time.monotonic() + 20
            while s.metric(pending) != n:
                assert time.monotonic() < deadline, f"{s.metric(pending)} queued, waited for {n}"
                time.sleep(0.01)

        c.async_infer("slow", [infer_input(np.full((16384, 256), 0.01, np.float32))], done, request_id="big")
        time.sleep(0.3)  # sent and running (the worker is free): what follows queues behind it
        c.async_infer("slow", [infer_input(small)], done, request_id="queued")
        c.async_infer("slow", [infer_input(small)], done, request_id="short", timeout=150_000)  # 150 ms
        wait_pending(2)
        code, message = status_of(lambda: c.infer("slow", [infer_input(small)]))
        http = httpx.post(f"{s.url}/v2/models/slow/infer", content=json.dumps(
            {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": small.ravel().tolist()}]}))
        assert code == "StatusCode.UNAVAILABLE" and http.status_code == 503, (code, message, http.text)
        assert message == http.json()["error"] and "queue" in message
        done.wait(1)  # "short" expires in the queue while "big" runs
        assert not done.results and len(done.errors) == 1, done.errors
        assert done.errors[0].status() == "StatusCode.DEADLINE_EXCEEDED"
        assert re.fullmatch(r"model 'slow': no answer within the request's timeout of 150 ms \(.*\)",
                            done.errors[0].message()), done.errors[0].message()
        wait_pending(1)
        code, _ = status_of(lambda: c.infer("slow", [infer_input(small)], client_timeout=0.2))
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        done.wait(3)
        assert sorted(r.get_response().id for r in done.results) == ["big", "queued"]
        count = 'kiln_request_duration_seconds_count{model="slow",version="1",outcome="%s",protocol="%s"}'
        assert s.metric(count % ("rejected", "grpc")) == 1 and s.metric(count % ("rejected", "http")) == 1
        assert s.metric(count % ("timeout", "grpc")) >= 1 and s.metric(count % ("success", "grpc")) == 2
        assert s.metric('nv_inference_request_failure{model="slow",version="1",reason="rejected"}') == 2

        # client shared memory is off here: register refused with HTTP's message, status empty
        code, message = status_of(lambda: c.register_system_shared_memory("r", "/nope", 64))
        r = httpx.post(f"{s.url}/v2/systemsharedmemory/region/r/register", content=b'{"key": "/nope", "byte_size": 64}')
        assert code == "StatusCode.INVALID_ARGUMENT" and message == r.json()["error"] and "KILN_ALLOW_CLIENT_SHM" in message
        assert not c.get_system_shared_memory_status().regions
        assert "system_shared_memory" not in c.get_server_metadata(as_json=True)["extensions"]
        c.close()
    finally:
        assert s.stop() == 0, "".join(s.output)
