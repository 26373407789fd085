"""End-to-end tests of the V2 app in process: every route, every class of bad input, and the hard edges
(413, 503 + Retry-After, 504, 500, readiness while loading and draining, metrics).

Requests go through the real ASGI app (FastAPI's TestClient, or httpx.ASGITransport where requests must be
concurrent) with its real lifespan, batcher and executors; models run on threads (``workers=0``) so no
process is spawned here (tests/server/test_serve_process.py covers worker processes and the real
server). Fakes replace the executor only where a test needs a model that is slow, blocked or failing.
No torch: models are built with kiln.ir.Graph.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

import kiln  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.errors import WorkerError  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def int_model(path: Path) -> Path:
    """y = x + [1, 2, 3] on int64[batch, 3]: an integer model for the NaN/non-integer cases."""
    g = Graph("ints")
    x = g.add_input("x", "int64", ("batch", 3))
    y = g.op("Add", x, g.add_initializer("offset", np.array([1, 2, 3], np.int64)), name="y")
    g.outputs = [y]
    kiln.save(g, path)
    return path


def entry(path: Path, name: str = "mlp", version: str = "1", **config) -> ModelEntry:
    config.setdefault("workers", 0)
    return ModelEntry(name, version, Path(path), ModelConfig(**config))


def wait_ready(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/v2/health/ready").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError("the app did not become ready: " + client.get("/v2/health/ready").text)


def infer_body(x: np.ndarray, name: str = "x", **extra) -> dict:
    datatype = {"float32": "FP32", "float64": "FP64", "int64": "INT64", "int32": "INT32"}[str(x.dtype)]
    return {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}],
            **extra}


def outputs_of(response) -> dict:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in response.json()["outputs"]}


@pytest.fixture(scope="module")
def program():
    return kiln.load(MLP)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One app serving the MLP (batches up to 8) and the int model, for the tests that need no fakes."""
    ints = int_model(tmp_path_factory.mktemp("models") / "ints.kiln")
    app = create_app([entry(MLP, max_batch_size=8), entry(ints, "ints")])
    with TestClient(app) as client:
        wait_ready(client)
        yield client


def good_request_works(client, program, rng=np.random.default_rng(7)) -> None:
    x = rng.standard_normal((2, 16)).astype(np.float32)
    got = outputs_of(client.post("/v2/models/mlp/infer", json=infer_body(x)))
    want = program.run({"x": x})
    for name in ("logits", "probs"):
        np.testing.assert_array_equal(got[name].astype(np.float32), want[name])


# ------------------------------------------------------------------------------------------------ routes
def test_health_and_server_metadata(served):
    assert served.get("/v2/health/live").json() == {"live": True}
    assert served.get("/v2/health/ready").status_code == 200
    meta = served.get("/v2").json()
    assert meta["name"] == "kiln" and meta["version"] == kiln.__version__
    assert "binary_tensor_data" in meta["extensions"]


@pytest.mark.parametrize("prefix", ["/v2/models/mlp", "/v2/models/mlp/versions/1"])
def test_model_metadata_and_ready(served, prefix):
    meta = served.get(prefix).json()
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 4]},
                               {"name": "probs", "datatype": "FP32", "shape": [-1, 4]}]
    r = served.get(prefix + "/ready")
    assert r.status_code == 200 and r.json()["ready"] is True


@pytest.mark.parametrize("prefix", ["/v2/models/mlp", "/v2/models/mlp/versions/1"])
def test_infer_json_equals_program_run(served, program, prefix):
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    r = served.post(prefix + "/infer", json=infer_body(x, id="req-1"))
    body = r.json()
    assert body["model_name"] == "mlp" and body["model_version"] == "1" and body["id"] == "req-1"
    got, want = outputs_of(r), program.run({"x": x})
    for o in body["outputs"]:
        assert o["datatype"] == "FP32" and o["shape"] == [3, 4]
        np.testing.assert_array_equal(got[o["name"]].astype(np.float32), want[o["name"]])


def test_infer_nested_json_data_and_one_requested_output(served, program):
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x.tolist()}],
            "outputs": [{"name": "probs"}]}
    got = outputs_of(served.post("/v2/models/mlp/infer", json=body))
    assert list(got) == ["probs"]
    np.testing.assert_array_equal(got["probs"].astype(np.float32), program.run({"x": x})["probs"])


def test_infer_binary_inputs_and_outputs(served, program):
    """The binary tensor extension both ways, with bodies built and parsed by tritonclient itself."""
    tc = pytest.importorskip("tritonclient.http")
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    inp = tc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    outs = [tc.InferRequestedOutput("logits", binary_data=True), tc.InferRequestedOutput("probs", binary_data=False)]
    body, json_size = tc.InferenceServerClient.generate_request_body([inp], outputs=outs)
    r = served.post("/v2/models/mlp/infer", content=body,
                    headers={"Inference-Header-Content-Length": str(json_size)})
    assert r.status_code == 200, r.text
    result = tc.InferenceServerClient.parse_response_body(
        r.content, header_length=int(r.headers["Inference-Header-Content-Length"]))
    want = program.run({"x": x})
    np.testing.assert_array_equal(result.as_numpy("logits"), want["logits"])
    np.testing.assert_array_equal(result.as_numpy("probs").astype(np.float32), want["probs"])


def test_gzip_request_body(served, program):
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    body = gzip.compress(json.dumps(infer_body(x)).encode())
    got = outputs_of(served.post("/v2/models/mlp/infer", content=body,
                                 headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}))
    np.testing.assert_array_equal(got["logits"].astype(np.float32), program.run({"x": x})["logits"])


def test_int_model(served):
    x = np.array([[1, 2, 3], [-4, 5, 2**40]], np.int64)
    got = outputs_of(served.post("/v2/models/ints/infer", json=infer_body(x)))
    np.testing.assert_array_equal(got["y"], x + [1, 2, 3])


def test_docs_and_openapi(served):
    assert served.get("/docs").status_code == 200
    spec = served.get("/openapi.json").json()
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/{model_name}",
                 "/v2/models/{model_name}/ready", "/v2/models/{model_name}/infer",
                 "/v2/models/{model_name}/versions/{model_version}/infer", "/metrics"):
        assert path in spec["paths"], path
    infer = spec["paths"]["/v2/models/{model_name}/infer"]["post"]
    assert "application/json" in infer["requestBody"]["content"]
    assert {"400", "404", "413", "503", "504"} <= set(infer["responses"])


# ------------------------------------------------------------------------------------------- bad input
def _x_input(shape, data=None, datatype="FP32", **extra):
    n = int(np.prod(shape)) if data is None else None
    return {"name": "x", "shape": shape, "datatype": datatype, "data": [0.5] * n if data is None else data, **extra}


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


_BINARY_HEADER = _json({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                    "parameters": {"binary_data_size": 128}}]})

# (id, model path, body bytes, extra headers, expected status, a fragment the error must contain)
BAD_REQUESTS = [
    ("malformed-json", "mlp", b'{"inputs": [', {}, 400, "json"),
    ("empty-body", "mlp", b"", {}, 400, ""),
    ("not-an-object", "mlp", b"[1, 2]", {}, 400, ""),
    ("no-inputs-key", "mlp", _json({"outputs": []}), {}, 400, "inputs"),
    ("wrong-content-type", "mlp", _json({"inputs": [_x_input([1, 16])]}), {"Content-Type": "application/xml"}, 415,
     "content type"),
    ("form-body-as-form", "mlp", b"x=0.5", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "application/json"),
    ("multipart", "mlp", b"--x\r\n\r\n--x--", {"Content-Type": "multipart/form-data; boundary=x"}, 415, ""),
    ("unknown-model", "nope", _json({"inputs": [_x_input([1, 16])]}), {}, 404, "nope"),
    ("unknown-version", "mlp/versions/7", _json({"inputs": [_x_input([1, 16])]}), {}, 404, "7"),
    ("missing-input", "mlp", _json({"inputs": []}), {}, 400, "x"),
    ("extra-input", "mlp", _json({"inputs": [_x_input([1, 16]), dict(_x_input([1, 16]), name="y")]}), {}, 400, "y"),
    ("duplicate-input", "mlp", _json({"inputs": [_x_input([1, 16]), _x_input([1, 16])]}), {}, 400, "x"),
    ("wrong-shape", "mlp", _json({"inputs": [_x_input([2, 15])]}), {}, 400, "x"),
    ("wrong-rank", "mlp", _json({"inputs": [_x_input([32])]}), {}, 400, "x"),
    ("negative-dim", "mlp", _json({"inputs": [_x_input([-1, 16], data=[0.0] * 16)]}), {}, 400, ""),
    ("wrong-datatype", "mlp", _json({"inputs": [_x_input([1, 16], datatype="FP64")]}), {}, 400, "x"),
    ("unknown-datatype", "mlp", _json({"inputs": [_x_input([1, 16], datatype="FLOAT")]}), {}, 400, "FLOAT"),
    ("bytes-datatype", "mlp", _json({"inputs": [_x_input([1, 16], datatype="BYTES")]}), {}, 400, "BYTES"),
    ("data-too-short", "mlp", _json({"inputs": [_x_input([2, 16], data=[0.5] * 31)]}), {}, 400, "x"),
    ("data-too-long", "mlp", _json({"inputs": [_x_input([1, 16], data=[0.5] * 17)]}), {}, 400, "x"),
    ("ragged-nested-data", "mlp", _json({"inputs": [_x_input([2, 2], data=[[1.0, 2.0], [3.0]])]}), {}, 400, "x"),
    ("string-data", "mlp", _json({"inputs": [_x_input([1, 2], data=["a", "b"])]}), {}, 400, "x"),
    ("binary-too-short", "mlp", _BINARY_HEADER + bytes(100),
     {"Inference-Header-Content-Length": str(len(_BINARY_HEADER))}, 400, ""),
    ("binary-too-long", "mlp", _BINARY_HEADER + bytes(200),
     {"Inference-Header-Content-Length": str(len(_BINARY_HEADER))}, 400, ""),
    ("header-length-past-body", "mlp", _BINARY_HEADER, {"Inference-Header-Content-Length": "99999"}, 400, ""),
    ("header-length-not-int", "mlp", _BINARY_HEADER, {"Inference-Header-Content-Length": "ten"}, 400,
     "Inference-Header-Content-Length"),
    ("nan-in-int", "ints", b'{"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT64", "data": [1, NaN, 3]}]}',
     {}, 400, "x"),
    ("inf-in-int", "ints", b'{"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT64", '
                           b'"data": [1, Infinity, 3]}]}', {}, 400, "x"),
    ("fraction-in-int", "ints", _json({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT64",
                                                   "data": [1, 2.5, 3]}]}), {}, 400, "x"),
    ("int-out-of-range", "ints", _json({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT64",
                                                    "data": [1, 2**70, 3]}]}), {}, 400, "x"),
    ("batch-too-large", "mlp", _json({"inputs": [_x_input([9, 16])]}), {}, 400, ""),
    ("huge-declared-shape", "mlp", _json({"inputs": [_x_input([1 << 40, 16], data=[])]}), {}, 413, ""),
    ("overflowing-shape", "mlp", _json({"inputs": [_x_input([1 << 62, 1 << 62], data=[])]}), {}, 413, ""),
    ("unknown-output", "mlp", _json({"inputs": [_x_input([1, 16])], "outputs": [{"name": "nope"}]}), {}, 400,
     "nope"),
    ("bad-timeout", "mlp", _json({"inputs": [_x_input([1, 16])], "parameters": {"timeout_ms": -5}}), {}, 400,
     "timeout"),
    ("bad-gzip", "mlp", b"not gzip at all", {"Content-Encoding": "gzip"}, 400, "gzip"),
    ("unknown-encoding", "mlp", b"{}", {"Content-Encoding": "br"}, 415, "br"),
]


@pytest.mark.parametrize("model,body,headers,status,fragment",
                         [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_gets_clear_error_and_server_keeps_serving(served, program, model, body, headers, status,
                                                             fragment):
    r = served.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and error
    assert fragment.lower() in error.lower()
    good_request_works(served, program)


@pytest.mark.parametrize("path", ["/v2/models/nope", "/v2/models/nope/ready", "/v2/models/mlp/versions/2",
                                  "/v2/models/mlp/versions/2/ready", "/v2/nowhere"])
def test_unknown_model_version_and_route_are_404_with_error(served, path):
    r = served.get(path)
    assert r.status_code == 404 and r.json()["error"]


def test_wrong_method_is_405_with_error(served):
    r = served.get("/v2/models/mlp/infer")
    assert r.status_code == 405 and r.json()["error"]
    r = served.post("/v2/health/live")
    assert r.status_code == 405 and r.json()["error"]


# --------------------------------------------------------------------------------------------- metrics
def test_metrics_after_requests(tmp_path, program):
    app = create_app([entry(MLP, max_batch_size=8)])
    with TestClient(app) as client:
        wait_ready(client)
        for _ in range(3):
            good_request_works(client, program)
        assert client.post("/v2/models/mlp/infer", content=b"{").status_code == 400
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert _sample(text, 'nv_inference_request_success{model="mlp",version="1"}') == 3
    assert _sample(text, 'nv_inference_request_failure{model="mlp",version="1",reason="invalid_request"}') == 1
    assert _sample(text, 'nv_inference_count{model="mlp",version="1"}') == 6  # 3 requests x 2 rows
    assert _sample(text, 'kiln_batch_size_count{model="mlp",version="1"}') >= 1
    assert _sample(text, 'kiln_request_duration_seconds_count{model="mlp",version="1",outcome="success",protocol="http"}') == 3
    assert "# TYPE kiln_queue_duration_seconds histogram" in text
    assert "nv_inference_pending_request_count" in text


def _sample(text: str, series: str) -> float:
    m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.M)
    assert m, f"{series} not in metrics:\n{text}"
    return float(m.group(1))


# ---------------------------------------------------------------------------------------------- limits
def test_body_over_limit_is_413_before_parsing(program):
    app = create_app([entry(MLP)], max_body_bytes=4096)
    big = _json({"inputs": [_x_input([64, 16])]})
    assert len(big) > 4096
    with TestClient(app) as client:
        wait_ready(client)
        r = client.post("/v2/models/mlp/infer", content=big)
        assert r.status_code == 413 and "4,096" in r.json()["error"]
        # Streamed without a Content-Length: counted while it arrives.
        r = client.post("/v2/models/mlp/infer", content=iter([big[:3000], big[3000:]]))
        assert r.status_code == 413
        # Junk that is too big is refused as too big, not parsed as JSON.
        r = client.post("/v2/models/mlp/infer", content=b"x" * 5000)
        assert r.status_code == 413
        # A small gzip body that inflates past the limit.
        r = client.post("/v2/models/mlp/infer", content=gzip.compress(b" " * 100_000),
                        headers={"Content-Encoding": "gzip"})
        assert r.status_code == 413
        good_request_works(client, program)


@pytest.mark.parametrize("workers", [0, 1])
def test_request_over_the_memory_budget_is_413(tmp_path, program, workers):
    """memory_budget (config.json / --memory-budget): a batch whose shapes make the run need more
    buffers than the budget is refused with 413 before any kernel runs; smaller ones are answered."""
    app = create_app([entry(MLP, max_batch_size=0, workers=workers, memory_budget="256KiB")])
    with TestClient(app) as client:
        wait_ready(client)
        good_request_works(client, program)
        big = np.zeros((4096, 16), np.float32)
        r = client.post("/v2/models/mlp/infer", json=infer_body(big))
        assert r.status_code == 413, r.text
        assert "memory budget" in r.json()["error"]
        good_request_works(client, program)


def test_memory_budget_config_is_checked():
    with pytest.raises(kiln.KilnError, match="memory_budget"):
        ModelConfig.from_json({"memory_budget": "lots"})
    with pytest.raises(kiln.KilnError, match="memory_budget"):
        ModelConfig.from_json({"memory_budget": True})
    assert ModelConfig.from_json({"memory_budget": "4GiB"}).memory_budget == "4GiB"


class FakeExecutor:
    """A real program behind the Executor interface, with knobs: a delay per run, a start that waits for
    an event, a run that fails. ``capacity`` 1, so requests queue behind a slow run."""

    capacity = 1

    def __init__(self, path, delay: float = 0.0, start_gate: threading.Event | None = None,
                 fail: BaseException | None = None):
        self.path, self.delay, self.start_gate, self.fail = path, delay, start_gate, fail
        self.program, self.inputs, self.outputs, self.closed, self.runs = None, [], [], False, 0

    def start(self):
        if self.start_gate is not None:
            assert self.start_gate.wait(30)
        self.program = kiln.load(self.path)
        self.inputs, self.outputs = self.program.inputs, self.program.outputs

    @property
    def ready(self):
        return self.program is not None and not self.closed

    async def run(self, inputs):
        self.runs += 1
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            fail, self.fail = self.fail, None  # fail once
            raise fail
        return self.program.run(inputs)

    async def close(self):
        self.closed = True


def run_async(app, body):
    """Run ``body(client)`` against ``app`` with its lifespan, in a fresh event loop, once ready."""
    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
                for _ in range(1500):
                    if (await client.get("/v2/health/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                return await body(client)
    return asyncio.run(main())


def test_full_queue_is_503_with_retry_after_and_recovers(program):
    fakes = []

    def factory(e):
        fakes.append(FakeExecutor(e.path, delay=0.3))
        return fakes[-1]

    app = create_app([entry(MLP, max_batch_size=0, queue_size=1)], executor_factory=factory)
    x = np.random.default_rng(5).standard_normal((1, 16)).astype(np.float32)

    async def body(client):
        rs = await asyncio.gather(*(client.post("/v2/models/mlp/infer", json=infer_body(x)) for _ in range(6)))
        later = await client.post("/v2/models/mlp/infer", json=infer_body(x))
        metrics = (await client.get("/metrics")).text
        return rs, later, metrics

    rs, later, metrics = run_async(app, body)
    codes = sorted(r.status_code for r in rs)
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}, codes
    for r in rs:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]
    np.testing.assert_array_equal(outputs_of(later)["logits"].astype(np.float32), program.run({"x": x})["logits"])
    rejected = 'nv_inference_request_failure{model="mlp",version="1",reason="rejected"}'
    assert _sample(metrics, rejected) == codes.count(503)


def test_timeout_is_504_and_request_can_only_lower_it():
    app = create_app([entry(MLP, max_batch_size=0, timeout_ms=400)],
                     executor_factory=lambda e: FakeExecutor(e.path, delay=1.5))
    x = np.zeros((1, 16), np.float32)

    async def body(client):
        t0 = time.perf_counter()
        lowered = await client.post("/v2/models/mlp/infer", json=infer_body(x, parameters={"timeout_ms": 50}))
        t1 = time.perf_counter()
        raised = await client.post("/v2/models/mlp/infer", json=infer_body(x, parameters={"timeout_ms": 60000}))
        t2 = time.perf_counter()
        return lowered, t1 - t0, raised, t2 - t1

    lowered, lowered_s, raised, raised_s = run_async(app, body)
    assert lowered.status_code == 504 and lowered.json()["error"]
    assert raised.status_code == 504 and raised.json()["error"]
    # The request's 60 s did not raise the model's 400 ms (the fake's run takes 1.5 s).
    assert raised_s < 1.4 and lowered_s < raised_s


def test_worker_failure_is_500_and_next_request_succeeds(program):
    app = create_app([entry(MLP)], executor_factory=lambda e: FakeExecutor(
        e.path, fail=WorkerError("worker process 123 died while running this request")))
    x = np.ones((1, 16), np.float32)
    with TestClient(app) as client:
        wait_ready(client)
        r = client.post("/v2/models/mlp/infer", json=infer_body(x))
        assert r.status_code == 500 and "died" in r.json()["error"]
        np.testing.assert_array_equal(outputs_of(client.post("/v2/models/mlp/infer", json=infer_body(x)))["logits"]
                                      .astype(np.float32), program.run({"x": x})["logits"])
        text = client.get("/metrics").text
    assert _sample(text, 'nv_inference_request_failure{model="mlp",version="1",reason="backend"}') == 1


def test_not_ready_while_loading_then_ready(program):
    gate = threading.Event()
    app = create_app([entry(MLP)], executor_factory=lambda e: FakeExecutor(e.path, start_gate=gate))
    x = np.ones((1, 16), np.float32)
    with TestClient(app) as client:
        try:
            assert client.get("/v2/health/live").status_code == 200
            r = client.get("/v2/health/ready")
            assert r.status_code == 503 and "loading" in r.json()["error"]
            assert client.get("/v2/models/mlp/ready").status_code == 503
            assert client.get("/v2/models/mlp").status_code == 503
            r = client.post("/v2/models/mlp/infer", json=infer_body(x))
            assert r.status_code == 503 and r.headers["Retry-After"] and "loading" in r.json()["error"]
        finally:
            gate.set()
        wait_ready(client)
        assert client.get("/v2/models/mlp/ready").status_code == 200
        outputs_of(client.post("/v2/models/mlp/infer", json=infer_body(x)))


def test_load_failure_reported_by_readiness(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(b"not a kiln file")
    errors = []
    app = create_app([entry(bad, "bad")], on_load_error=errors.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert errors and isinstance(errors[0], kiln.KilnError)
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and "failed" in r.json()["error"]
        r = client.post("/v2/models/bad/infer", json=infer_body(np.ones((1, 16), np.float32)))
        assert r.status_code == 503 and "failed to load" in r.json()["error"]


def test_draining_reports_not_ready_and_finishes_running_requests(program):
    app = create_app([entry(MLP, max_batch_size=0)], executor_factory=lambda e: FakeExecutor(e.path, delay=0.3))
    x = np.random.default_rng(6).standard_normal((1, 16)).astype(np.float32)

    async def body(client):
        running = [asyncio.ensure_future(client.post("/v2/models/mlp/infer", json=infer_body(x))) for _ in range(3)]
        await asyncio.sleep(0.1)  # all three are queued or running
        drained = app.state.kiln.begin_drain()
        ready = await client.get("/v2/health/ready")
        model_ready = await client.get("/v2/models/mlp/ready")
        refused = await client.post("/v2/models/mlp/infer", json=infer_body(x))
        finished = await asyncio.gather(*running)
        await drained
        return ready, model_ready, refused, finished

    ready, model_ready, refused, finished = run_async(app, body)
    assert ready.status_code == 503 and "shutting down" in ready.json()["error"]
    assert model_ready.status_code == 503
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    for r in finished:
        np.testing.assert_array_equal(outputs_of(r)["logits"].astype(np.float32), program.run({"x": x})["logits"])


def test_two_models_and_versions(tmp_path, program):
    ints = int_model(tmp_path / "ints.kiln")
    app = create_app([entry(MLP, "mlp", "1"), entry(MLP, "mlp", "3"), entry(ints, "ints", "2")])
    x = np.random.default_rng(8).standard_normal((1, 16)).astype(np.float32)
    with TestClient(app) as client:
        wait_ready(client)
        assert client.get("/v2/models/mlp").json()["versions"] == ["1", "3"]
        assert client.get("/v2/models/mlp/versions/3/ready").status_code == 200
        assert client.post("/v2/models/mlp/infer", json=infer_body(x)).json()["model_version"] == "3"
        assert client.post("/v2/models/mlp/versions/1/infer", json=infer_body(x)).json()["model_version"] == "1"
        assert client.get("/v2/models/mlp/versions/2").status_code == 404
        got = outputs_of(client.post("/v2/models/ints/versions/2/infer", json=infer_body(np.ones((1, 3), np.int64))))
        np.testing.assert_array_equal(got["y"], [[2, 3, 4]])


def test_serving_imports_neither_torch_nor_onnx():
    """The server process stays light: serving a .kiln model imports no torch, onnx or onnxruntime."""
    import subprocess
    import sys
    code = ("import sys, time\n"
            "from fastapi.testclient import TestClient\n"
            "from kiln.server.app import create_app\n"
            "from kiln.server.repository import discover\n"
            f"app = create_app(discover({str(MLP)!r}, overrides={{'workers': 0}}))\n"
            "with TestClient(app) as c:\n"
            "    while c.get('/v2/health/ready').status_code != 200: time.sleep(0.02)\n"
            "    assert c.post('/v2/models/mlp_runtime/infer', json={'inputs': [{'name': 'x', 'shape': [1, 16], "
            "'datatype': 'FP32', 'data': [0.0] * 16}]}).status_code == 200\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnxruntime')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("workers", [0, 1])
def test_onnxruntime_backend_serves_the_same_results(program, workers):
    pytest.importorskip("onnxruntime")
    app = create_app([entry(MLP, backend="onnxruntime", workers=workers, max_batch_size=4)])
    with TestClient(app) as client:
        wait_ready(client)
        assert client.get("/v2/models/mlp").json()["platform"] == "onnxruntime"
        x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
        got = outputs_of(client.post("/v2/models/mlp/infer", json=infer_body(x)))
        want = program.run({"x": x})
        for name in ("logits", "probs"):
            np.testing.assert_allclose(got[name].astype(np.float32), want[name], rtol=1e-5, atol=1e-6)


def guarded_model(path: Path) -> Path:
    """y = x * 2 on float32[batch, 3], with a kiln.Guard (as a trace leaves one) requiring every
    element of x to be positive: the model refuses other inputs."""
    g = Graph("guarded")
    x = g.add_input("x", "float32", ("batch", 3))
    low = g.op("ReduceMin", x, keepdims=0)
    ok = g.op("Greater", low, g.add_constant(np.array(0, np.float32)))
    g.add_node("Guard", [ok], {"expected": np.array(True), "read": "bool", "what": "bool(tensor)",
                               "location": "model.py:12", "code": "if x.min() > 0:"}, domain="kiln", num_outputs=0)
    g.outputs = [g.op("Mul", x, g.add_constant(np.array(2, np.float32)), name="y")]
    kiln.save(g, path)
    return path


def test_refused_input_is_400_naming_the_guard_and_batch_mates_are_served(tmp_path):
    app = create_app([entry(guarded_model(tmp_path / "g.kiln"), "guarded", max_batch_size=8, max_queue_delay_ms=50)])
    good, bad = np.ones((1, 3), np.float32), -np.ones((1, 3), np.float32)

    async def body(client):
        alone = await client.post("/v2/models/guarded/infer", json=infer_body(bad))
        together = await asyncio.gather(*(client.post("/v2/models/guarded/infer", json=infer_body(a))
                                          for a in (good, bad, good)))
        return alone, together

    alone, together = run_async(app, body)
    assert alone.status_code == 400
    assert re.search(r"refuses this input: kiln.Guard failed at model.py:12 `if x.min\(\) > 0:`", alone.json()["error"])
    assert [r.status_code for r in together] == [200, 400, 200]
    np.testing.assert_array_equal(outputs_of(together[0])["y"], 2 * good)
