"""Triton's other endpoints, through the real ``tritonclient[http]`` against a real uvicorn on 127.0.0.1
(in a thread): model configuration, statistics, the repository index, and the system shared memory
extension end to end with ``tritonclient.utils.shared_memory`` (every answer equal to ``Program.run``;
bounds, unknown regions, use after unregister and a shrunk object are 400 with a JSON body; regions are
released on unregister and at shutdown). CUDA shared memory answers but registers nothing yet.
No torch: models are built with kiln.ir.Graph.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
tc = pytest.importorskip("tritonclient.http")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from fastapi.testclient import TestClient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import kiln  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or sys.platform != "linux",
                                reason="POSIX shared memory in /dev/shm")

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
TAG = f"kiln_test_{os.getpid()}"
MAX_REGIONS = 6
MAX_BYTES = 1 << 20


def int_model(path: Path) -> Path:
    """y = x * 3 on int64[batch, 3], batching off in the fixture (so its config has max_batch_size 0)."""
    g = Graph("ints")
    x = g.add_input("x", "int64", ("batch", 3))
    g.outputs = [g.op("Mul", x, g.add_initializer("k", np.array(3, np.int64)), name="y")]
    kiln.save(g, path)
    return path


def entry(path: Path, name: str, version: str = "1", **config) -> ModelEntry:
    config.setdefault("workers", 0)
    return ModelEntry(name, version, Path(path), ModelConfig(**config))


class ThreadServer:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{self.url}/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ints = int_model(tmp_path_factory.mktemp("models") / "ints.kiln")
    # mlp runs in a worker process (shared memory inputs cross to it), the others on threads.
    app = create_app([entry(MLP, "mlp", max_batch_size=8, workers=1), entry(MLP, "counted", max_batch_size=8),
                      entry(ints, "ints", batching="off")],
                     allow_client_shm=True, shm_max_regions=MAX_REGIONS, shm_max_bytes=MAX_BYTES)
    server = ThreadServer(app)
    client = tc.InferenceServerClient(server.url)
    yield server, client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def program():
    return kiln.load(MLP)


@pytest.fixture
def regions(served):
    """Create shared memory objects (``make(name, size)``); every region is unregistered and every object
    destroyed afterwards."""
    _, client = served
    made = []

    def make(name: str, size: int):
        handle = shm.create_shared_memory_region(name, f"/{TAG}_{name}", size, create_only=True)
        made.append(handle)
        return handle

    yield make
    client.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def raw_post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"http://{server.url}{path}", content=json.dumps(body),
                      headers={"Content-Type": "application/json"})


def shm_infer_body(x_params: dict, shape=(2, 16), datatype="FP32", outputs=None) -> dict:
    body = {"inputs": [{"name": "x", "shape": list(shape), "datatype": datatype, "parameters": x_params}]}
    if outputs is not None:
        body["outputs"] = outputs
    return body


def mapped(key_part: str) -> bool:
    """Whether this process maps a /dev/shm object whose name contains ``key_part``."""
    return key_part in Path("/proc/self/maps").read_text()


# ------------------------------------------------------------------------------------------ model config
def test_model_config_is_triton_shaped(served):
    _, client = served
    for version in ("", "1"):
        cfg = client.get_model_config("mlp", model_version=version)
        assert cfg["name"] == "mlp" and cfg["platform"] == "kiln" and cfg["backend"] == "kiln"
        assert cfg["max_batch_size"] == 8  # the batcher stacks this model: dims leave the batch dim out
        assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [16],
                                 "optional": False}]
        assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [
            ("logits", "TYPE_FP32", [4]), ("probs", "TYPE_FP32", [4])]
        assert cfg["dynamic_batching"] == {"preferred_batch_size": [], "max_queue_delay_microseconds": 500,
                                           "preserve_ordering": False}
        assert cfg["instance_group"] == [{"name": "mlp", "kind": "KIND_CPU", "count": 1, "gpus": []}]
        assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
        kiln_part = cfg["kiln"]
        assert kiln_part["version"] == "1" and kiln_part["config"]["max_batch_size"] == 8
        assert kiln_part["batching"]["stacks_requests"] is True
    # Not stacked: max_batch_size 0, full dims with -1 for the symbolic one, no dynamic_batching, and why.
    cfg = client.get_model_config("ints")
    assert cfg["max_batch_size"] == 0 and "dynamic_batching" not in cfg
    assert cfg["input"][0]["data_type"] == "TYPE_INT64" and cfg["input"][0]["dims"] == [-1, 3]
    assert cfg["output"][0]["dims"] == [-1, 3]
    assert cfg["kiln"]["batching"]["stacks_requests"] is False and '"off"' in cfg["kiln"]["batching"]["reason"]
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_config("nope")


def test_server_metadata_lists_the_extensions(served):
    _, client = served
    extensions = client.get_server_metadata()["extensions"]
    for name in ("binary_tensor_data", "model_configuration", "statistics", "model_repository",
                 "system_shared_memory"):
        assert name in extensions
    assert "cuda_shared_memory" not in extensions


# ------------------------------------------------------------------------------------------- statistics
def test_statistics_count_requests_batches_and_failures(served, program):
    _, client = served
    before = client.get_inference_statistics("counted")["model_stats"]
    assert len(before) == 1 and before[0]["inference_count"] == 0 and before[0]["batch_stats"] == []
    rng = np.random.default_rng(3)
    rows = [1, 2, 3, 2]
    started_ms = time.time() * 1000
    for n in rows:  # one at a time: each request is one batch of its own rows
        x = rng.standard_normal((n, 16)).astype(np.float32)
        inp = tc.InferInput("x", [n, 16], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("counted", [inp])
        np.testing.assert_array_equal(result.as_numpy("logits"), program.run({"x": x})["logits"])
    bad = tc.InferInput("x", [1, 15], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 15), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("counted", [bad])

    for version in ("", "1"):
        stats = client.get_inference_statistics("counted", model_version=version)["model_stats"]
        assert len(stats) == 1
        s = stats[0]
        assert s["name"] == "counted" and s["version"] == "1"
        assert s["inference_count"] == sum(rows) and s["execution_count"] == len(rows)
        assert started_ms - 1 <= s["last_inference"] <= time.time() * 1000 + 1
        inf = s["inference_stats"]
        assert inf["success"]["count"] == len(rows) and inf["success"]["ns"] > 0
        assert inf["fail"]["count"] == 1 and inf["fail"]["ns"] > 0
        for key in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert inf[key]["count"] == len(rows), key
            assert inf[key]["ns"] >= 0, key
        assert inf["compute_infer"]["ns"] > 0 and inf["compute_input"]["ns"] > 0
        # Requests succeed only after their compute, decode and encode: each part is under the total.
        assert inf["compute_infer"]["ns"] < inf["success"]["ns"]
        assert {b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]} == {1: 1, 2: 2, 3: 1}
        assert all(b["compute_infer"]["ns"] > 0 for b in s["batch_stats"])
    everything = client.get_inference_statistics()["model_stats"]
    assert {(s["name"], s["version"]) for s in everything} == {("mlp", "1"), ("counted", "1"), ("ints", "1")}
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_inference_statistics("nope")
    with pytest.raises(InferenceServerException, match="no version '7'"):
        client.get_inference_statistics("counted", model_version="7")


# ----------------------------------------------------------------------------------- repository index
def test_repository_index(served):
    server, client = served
    index = client.get_model_repository_index()
    assert index == [{"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("counted", "ints", "mlp")]
    r = raw_post(server, "/v2/repository/index", {"ready": True})
    assert r.status_code == 200 and r.json() == index
    r = raw_post(server, "/v2/repository/index", {"ready": "yes"})
    assert r.status_code == 400 and "ready" in r.json()["error"]


def test_repository_index_reports_a_failed_load(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(b"not a kiln file")
    app = create_app([entry(MLP, "mlp"), entry(bad, "bad")])
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            index = client.post("/v2/repository/index").json()
            if all(e["state"] != "LOADING" for e in index):
                break
            time.sleep(0.05)
        states = {e["name"]: e for e in index}
        assert states["bad"]["state"] == "UNAVAILABLE" and "failed to load" in states["bad"]["reason"]
        assert states["mlp"]["state"] in ("READY", "LOADING")
        assert client.post("/v2/repository/index", json={"ready": True}).json() == [
            e for e in index if e["state"] == "READY"]


# ------------------------------------------------------------------------------- system shared memory
def test_shared_memory_inputs_and_outputs_equal_program_run(served, program, regions):
    server, client = served
    rng = np.random.default_rng(11)
    n = 3
    in_bytes, out_bytes = n * 16 * 4, n * 4 * 4
    ih, oh = regions("in", in_bytes), regions("out", 2 * out_bytes)
    client.register_system_shared_memory(f"{TAG}_in", f"/{TAG}_in", in_bytes)
    client.register_system_shared_memory(f"{TAG}_out", f"/{TAG}_out", 2 * out_bytes)
    status = client.get_system_shared_memory_status()
    assert {(s["name"], s["key"], int(s["offset"]), int(s["byte_size"])) for s in status} == {
        (f"{TAG}_in", f"/{TAG}_in", 0, in_bytes), (f"{TAG}_out", f"/{TAG}_out", 0, 2 * out_bytes)}
    assert client.get_system_shared_memory_status(f"{TAG}_in")[0]["byte_size"] == in_bytes
    for model in ("mlp", "counted"):  # a worker process and a thread executor
        for _ in range(5):  # distinct inputs each time, the same regions
            x = rng.standard_normal((n, 16)).astype(np.float32)
            shm.set_shared_memory_region(ih, [x])
            inp = tc.InferInput("x", [n, 16], "FP32")
            inp.set_shared_memory(f"{TAG}_in", in_bytes)
            logits = tc.InferRequestedOutput("logits", binary_data=True)
            logits.set_shared_memory(f"{TAG}_out", out_bytes)
            probs = tc.InferRequestedOutput("probs", binary_data=True)
            probs.set_shared_memory(f"{TAG}_out", out_bytes, offset=out_bytes)
            result = client.infer(model, [inp], outputs=[logits, probs])
            want = program.run({"x": x})
            for i, name in enumerate(("logits", "probs")):
                out = result.get_output(name)
                assert "data" not in out and out["shape"] == [n, 4] and out["datatype"] == "FP32"
                assert out["parameters"]["shared_memory_region"] == f"{TAG}_out"
                assert out["parameters"]["shared_memory_byte_size"] == out_bytes
                got = shm.get_contents_as_numpy(oh, np.float32, [n, 4], offset=i * out_bytes)
                np.testing.assert_array_equal(got, want[name])
            # A shared memory input with an ordinary (binary) output.
            result = client.infer(model, [inp], outputs=[tc.InferRequestedOutput("probs", binary_data=True)])
            np.testing.assert_array_equal(result.as_numpy("probs"), want["probs"])


def test_shared_memory_region_at_an_offset_and_input_offset(served, program, regions):
    server, client = served
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    y = np.arange(6, dtype=np.int64).reshape(2, 3) - 2
    handle = regions("off", 8192 + 512)
    # The region starts 8192 + 40 bytes into the object (not page aligned); x at 8 bytes into the region,
    # y (int64, misaligned by 4 for its dtype) at 8 + 128 + 4.
    shm.set_shared_memory_region(handle, [x], offset=8192 + 48)
    shm.set_shared_memory_region(handle, [y], offset=8192 + 40 + 140)
    client.register_system_shared_memory(f"{TAG}_off", f"/{TAG}_off", 400, offset=8192 + 40)
    inp = tc.InferInput("x", [2, 16], "FP32").set_shared_memory(f"{TAG}_off", 128, offset=8)
    result = client.infer("counted", [inp])
    np.testing.assert_array_equal(result.as_numpy("logits"), program.run({"x": x})["logits"])
    inp = tc.InferInput("x", [2, 3], "INT64").set_shared_memory(f"{TAG}_off", 48, offset=140)
    out = tc.InferRequestedOutput("y")
    out.set_shared_memory(f"{TAG}_off", 48, offset=200)
    result = client.infer("ints", [inp], outputs=[out])
    assert "data" not in result.get_output("y")
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int64, [2, 3], offset=8192 + 40 + 200), y * 3)


def _error(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


def test_shared_memory_bounds_and_unknown_regions_are_400(served, regions):
    server, client = served
    regions("small", 256)
    name = f"{TAG}_small"
    assert raw_post(server, f"/v2/systemsharedmemory/region/{name}/register",
                    {"key": f"/{TAG}_small", "offset": 64, "byte_size": 128}).status_code == 200
    infer = "/v2/models/counted/infer"
    good = {"shared_memory_region": name, "shared_memory_byte_size": 128}
    assert raw_post(server, infer, shm_infer_body(good)).status_code == 200
    cases = [
        (shm_infer_body({**good, "shared_memory_byte_size": 124}), "needs 128"),  # size != dtype x shape
        (shm_infer_body({**good, "shared_memory_offset": 4}), "past the end of region"),
        (shm_infer_body({**good, "shared_memory_byte_size": 192}, shape=(3, 16)),
         "past the end of region"),  # 192 bytes in a 128-byte region
        (shm_infer_body({**good, "shared_memory_region": "nope"}), "no system shared memory region named 'nope'"),
        (shm_infer_body({"shared_memory_region": name}), "no shared_memory_byte_size"),
        (shm_infer_body({**good, "shared_memory_offset": -1}), "non-negative"),
        ({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": [0.0] * 32, "parameters": good}]},
         "also carries data"),
        (shm_infer_body(good, outputs=[{"name": "logits", "parameters": {"shared_memory_region": "nope",
                                                                          "shared_memory_byte_size": 32}}]),
         "no system shared memory region named 'nope'"),
        (shm_infer_body(good, outputs=[{"name": "logits", "parameters": {
            "shared_memory_region": name, "shared_memory_byte_size": 16}}]), "shared_memory_byte_size is 16"),
        (shm_infer_body(good, outputs=[{"name": "logits", "parameters": {
            "shared_memory_region": name, "shared_memory_byte_size": 32, "shared_memory_offset": 100}}]),
         "past the end of region"),
    ]
    for body, words in cases:
        assert words in _error(raw_post(server, infer, body)), words
    register = f"/v2/systemsharedmemory/region/{TAG}_r/register"
    for body, words in [
        ({"key": f"/{TAG}_small", "offset": 200, "byte_size": 100}, "past the end of shared memory key"),
        ({"key": f"/{TAG}_missing", "offset": 0, "byte_size": 8}, "no shared memory object"),
        ({"key": "../etc/passwd", "offset": 0, "byte_size": 8}, "invalid shared memory key"),
        ({"key": "/a/b", "offset": 0, "byte_size": 8}, "invalid shared memory key"),
        ({"key": f"/{TAG}_small", "offset": 0, "byte_size": 0}, "must be positive"),
        ({"key": f"/{TAG}_small", "byte_size": True}, "non-negative integer"),
        ({"key": f"/{TAG}_small", "offset": 0, "byte_size": 8, "extra": 1}, "unknown key"),
        ({"key": f"/{TAG}_small", "offset": 0, "byte_size": MAX_BYTES}, "limit is"),  # total bytes cap
    ]:
        assert words in _error(raw_post(server, register, body)), words
    assert "already registered" in _error(raw_post(server, f"/v2/systemsharedmemory/region/{name}/register",
                                                   {"key": f"/{TAG}_small", "offset": 0, "byte_size": 8}))
    # The region count cap.
    for i in range(MAX_REGIONS - 1):
        client.register_system_shared_memory(f"{TAG}_c{i}", f"/{TAG}_small", 8)
    with pytest.raises(InferenceServerException, match=f"limit is {MAX_REGIONS}"):
        client.register_system_shared_memory(f"{TAG}_c9", f"/{TAG}_small", 8)
    assert "no system shared memory region named 'nope'" in _error(
        httpx.get(f"http://{server.url}/v2/systemsharedmemory/region/nope/status"))
    assert raw_post(server, infer, shm_infer_body(good)).status_code == 200  # still serving


def test_unregister_then_use_is_400_and_releases_the_mapping(served, regions):
    server, client = served
    regions("gone", 128)
    name = f"{TAG}_gone"
    client.register_system_shared_memory(name, f"/{TAG}_gone", 128)
    body = shm_infer_body({"shared_memory_region": name, "shared_memory_byte_size": 128})
    assert raw_post(server, "/v2/models/counted/infer", body).status_code == 200
    assert mapped(f"{TAG}_gone")
    client.unregister_system_shared_memory(name)
    assert "no system shared memory region named" in _error(raw_post(server, "/v2/models/counted/infer", body))
    assert client.get_system_shared_memory_status() == []
    client.unregister_system_shared_memory(name)  # unknown: not an error
    # The server's mapping goes (the client's own handle maps the object too: count the server's) at once,
    # or, while the runtime still holds the last run's input view, when its next run drops it.
    json_body = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    assert raw_post(server, "/v2/models/counted/infer", json_body).status_code == 200
    assert Path("/proc/self/maps").read_text().count(f"{TAG}_gone") == 1
    client.register_system_shared_memory(name, f"/{TAG}_gone", 64)  # the name is free again
    assert client.get_system_shared_memory_status(name)[0]["byte_size"] == 64


def test_a_shrunk_object_is_400_not_a_crash(served, regions):
    server, client = served
    regions("shrink", 8192)
    name = f"{TAG}_shrink"
    client.register_system_shared_memory(name, f"/{TAG}_shrink", 8192)
    os.truncate(f"/dev/shm/{TAG}_shrink", 4096)
    body = shm_infer_body({"shared_memory_region": name, "shared_memory_byte_size": 128,
                           "shared_memory_offset": 6000})
    assert "shrank" in _error(raw_post(server, "/v2/models/counted/infer", body))
    assert client.is_server_live()


def test_cuda_shared_memory_on_a_cpu_only_server_registers_nothing(served):
    server, client = served
    assert client.get_cuda_shared_memory_status() == []
    r = raw_post(server, "/v2/cudasharedmemory/region/g/register", {"raw_handle": {"b64": ""}, "device_id": 0,
                                                                   "byte_size": 8})
    assert "CUDA shared memory needs a model served on a GPU (kiln serve --device cuda)" in _error(r)
    assert raw_post(server, "/v2/cudasharedmemory/unregister", {}).status_code == 200


def test_shared_memory_is_off_by_default_and_released_at_shutdown(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_ALLOW_CLIENT_SHM", raising=False)
    key = f"{TAG}_default"
    handle = shm.create_shared_memory_region(key, "/" + key, 128, create_only=True)
    try:
        with TestClient(create_app([entry(MLP, "mlp")])) as client:
            r = client.post(f"/v2/systemsharedmemory/region/{key}/register",
                            json={"key": "/" + key, "offset": 0, "byte_size": 128})
            assert "KILN_ALLOW_CLIENT_SHM" in _error(r)
            assert client.get("/v2/systemsharedmemory/status").json() == []
            assert "system_shared_memory" not in client.get("/v2").json()["extensions"]
        monkeypatch.setenv("KILN_ALLOW_CLIENT_SHM", "1")
        app = create_app([entry(MLP, "mlp")])
        with TestClient(app) as client:
            r = client.post(f"/v2/systemsharedmemory/region/{key}/register",
                            json={"key": "/" + key, "offset": 0, "byte_size": 128})
            assert r.status_code == 200, r.text
            assert Path("/proc/self/maps").read_text().count(key) == 2  # the client's mapping and the server's
        assert app.state.kiln.shm.status() == []  # the lifespan's shutdown released it
        assert Path("/proc/self/maps").read_text().count(key) == 1
    finally:
        shm.destroy_shared_memory_region(handle)


def test_kiln_serve_process_with_shared_memory(program):
    """The real ``kiln serve`` in its own process (--allow-client-shm, a worker process): inputs and
    outputs through shared memory equal Program.run, the extensions answer, and SIGTERM exits 0."""
    import re
    import signal
    import subprocess
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("KILN_ALLOW_CLIENT_SHM", None)
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(MLP), "--name", "mlp", "--workers", "1",
                             "--host", "127.0.0.1", "--port", "0", "--allow-client-shm"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    key = f"{TAG}_proc"
    handles = []
    try:
        url = None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"ready at http://(127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
            if url and "docs at" in line:
                break
        assert url, "".join(lines)
        client = tc.InferenceServerClient(url)
        n = 4
        ih = shm.create_shared_memory_region(key + "_in", f"/{key}_in", n * 16 * 4, create_only=True)
        oh = shm.create_shared_memory_region(key + "_out", f"/{key}_out", n * 4 * 4, create_only=True)
        handles = [ih, oh]
        client.register_system_shared_memory(key + "_in", f"/{key}_in", n * 16 * 4)
        client.register_system_shared_memory(key + "_out", f"/{key}_out", n * 4 * 4)
        rng = np.random.default_rng(21)
        for _ in range(3):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            shm.set_shared_memory_region(ih, [x])
            inp = tc.InferInput("x", [n, 16], "FP32").set_shared_memory(key + "_in", n * 16 * 4)
            out = tc.InferRequestedOutput("probs")
            out.set_shared_memory(key + "_out", n * 4 * 4)
            client.infer("mlp", [inp], outputs=[out])
            np.testing.assert_array_equal(shm.get_contents_as_numpy(oh, np.float32, [n, 4]),
                                          program.run({"x": x})["probs"])
        assert client.get_model_config("mlp")["max_batch_size"] == 32
        stats = client.get_inference_statistics("mlp")["model_stats"][0]
        assert stats["inference_count"] == 3 * n and stats["inference_stats"]["success"]["count"] == 3
        assert [e["state"] for e in client.get_model_repository_index()] == ["READY"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
