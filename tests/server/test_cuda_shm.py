"""CUDA shared memory (server/cuda_shm.py) on the CPU: the registry's checks, device rows in the bucket
staging (patched, never copied), the batcher's grouping, and the whole HTTP path through tritonclient with a
stand-in GPU executor (its "device memory" is host bytes keyed by the IPC handle; it applies the patches
the way GpuRunner does). The real IPC open and device copies run in tests/server/test_gpu_serve.py."""
from __future__ import annotations

import asyncio
import base64
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
tc = pytest.importorskip("tritonclient.http")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' own helpers, under --import-mode=importlib
from test_triton_extensions import ThreadServer, raw_post  # noqa: E402

import kiln  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.batcher import DynamicBatcher  # noqa: E402
from kiln.server.buckets import BucketedExecutor, Staging  # noqa: E402
from kiln.server.errors import RegionTooSmall  # noqa: E402
from kiln.server.cuda_shm import CudaSharedMemory, CudaSpan, DeviceInput, device_input  # noqa: E402
from kiln.server.protocol import ProtocolError  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402
from kiln.server.workers import ThreadExecutor  # noqa: E402
from kiln.ir.types import TensorType  # noqa: E402
from kiln.runtime.program import TensorSpec  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def handle(i: int) -> bytes:
    return bytes([i]) * 64


def b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


def registry(**kw) -> CudaSharedMemory:
    kw.setdefault("enabled", True)
    kw.setdefault("devices", [0, 1])
    return CudaSharedMemory(kw.pop("enabled"), kw.pop("devices"), kw.pop("max_regions", 3),
                            kw.pop("max_bytes", 1 << 20), **kw)


def request(h: bytes = handle(1), device: int = 0, size: int = 1024) -> dict:
    return {"raw_handle": {"b64": b64(h)}, "device_id": device, "byte_size": size}


# ----------------------------------------------------------------------------------------------- registry

@pytest.mark.parametrize("make, name, body, message", [
    (dict(enabled=False), "r", request(), "CUDA shared memory is off in this server"),
    (dict(devices=[]), "r", request(), "needs a model served on a GPU"),
    ({}, "a/b", request(), "invalid region name"),
    ({}, "r", [], "must be a JSON object"),
    ({}, "r", {**request(), "key": "x"}, "unknown key(s) ['key']"),
    ({}, "r", {"device_id": 0, "byte_size": 8}, '"raw_handle": {"b64"'),
    ({}, "r", {**request(), "raw_handle": {"b64": "not base64!"}}, "not valid base64"),
    ({}, "r", {**request(), "raw_handle": {"b64": b64(b"x" * 63)}}, "63 bytes; a CUDA IPC memory handle is 64"),
    ({}, "r", request(device=2), "on GPU 2: this server's models run on GPU(s) [0, 1]"),
    ({}, "r", request(device=-1), "'device_id' must be a non-negative integer"),
    ({}, "r", request(size=0), "'byte_size' must be positive"),
    (dict(max_bytes=1000), "r", request(size=1001), "limit is 1,000"),
    (dict(taken=lambda name: name == "sys"), "sys", request(), "already registered"),
])
def test_register_refuses_with_the_reason(make, name, body, message):
    with pytest.raises(ProtocolError, match=None) as e:
        registry(**make).register(name, body)
    assert e.value.status == 400 and message in e.value.message, e.value.message


def test_registry_status_limits_unregister_and_spans():
    reg = registry()
    r1 = reg.register("a", request(handle(1), 0, 4096))
    reg.register("b", request(handle(2), 1, 64))
    assert reg.status() == [{"name": "a", "device_id": 0, "byte_size": 4096},
                            {"name": "b", "device_id": 1, "byte_size": 64}]
    with pytest.raises(ProtocolError, match="already registered"):
        reg.register("a", request())
    reg.register("c", request(handle(3)))
    with pytest.raises(ProtocolError, match="limit is 3"):
        reg.register("d", request())
    span = reg.span({"shared_memory_region": "a", "shared_memory_byte_size": 1024, "shared_memory_offset": 512}, "x")
    assert span == CudaSpan(handle(1), r1.reg_id, 0, 512, 1024)
    with pytest.raises(ProtocolError, match="past the end of region 'a' \\(4096 bytes\\)"):
        reg.span({"shared_memory_region": "a", "shared_memory_byte_size": 4000, "shared_memory_offset": 512}, "x")
    with pytest.raises(ProtocolError, match="gives no shared_memory_byte_size"):
        reg.span({"shared_memory_region": "a"}, "x")
    with pytest.raises(ProtocolError, match="needs 2048"):
        reg.read({"shared_memory_region": "a", "shared_memory_byte_size": 1024}, "input 'x'", np.dtype(np.float32),
                 (2, 256), 512)
    x = reg.read({"shared_memory_region": "a", "shared_memory_byte_size": 2048}, "input 'x'", np.dtype(np.float32),
                 (2, 256), 512)
    assert isinstance(x, DeviceInput) and x.shape == (2, 256) and x.strides == (0, 0) and x.span.nbytes == 2048
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(x)
    assert [r.name for r in reg.unregister("a")] == ["a"] and reg.unregister("a") == []
    with pytest.raises(ProtocolError, match="no CUDA shared memory region named 'a'"):
        reg.span({"shared_memory_region": "a", "shared_memory_byte_size": 4}, "x")
    again = reg.register("a", request(handle(1), 0, 4096))
    assert again.reg_id != r1.reg_id  # a worker reopens a handle registered afresh
    assert sorted(r.name for r in reg.unregister(None)) == ["a", "b", "c"] and reg.status() == []


# ------------------------------------------------------------------------------------------ bucket staging

def spec(name: str, dtype: str = "float32", row=(4,)) -> TensorSpec:
    return TensorSpec(name, TensorType(dtype, ("batch", *row)))


def dev(rows: int, h: int = 1, offset: int = 0) -> DeviceInput:
    return device_input(CudaSpan(handle(h), 1, 0, offset, rows * 16), np.dtype(np.float32), (rows, 4))


def test_device_rows_become_patches_and_are_never_copied():
    staging = Staging([spec("x")], (1, 2, 4, 8))
    host = np.arange(8, dtype=np.float32).reshape(2, 4)
    batch = staging.stage([{"x": host}, {"x": dev(3, 1)}, {"x": dev(1, 2, 64)}], 8)
    buf = batch.arrays["x"]
    np.testing.assert_array_equal(buf[:2], host)
    patches = batch.device_patches()
    assert patches == {"x": {"parts": [(2, CudaSpan(handle(1), 1, 0, 0, 48)), (5, CudaSpan(handle(2), 1, 0, 64, 16))],
                             "pad_from": 6}}  # the last real row is a device row: the worker pads from it
    batch.release()
    # A host request after the device rows: the host pad is right, no device pad.
    batch = staging.stage([{"x": dev(2)}, {"x": host[:1]}], 4)
    assert batch.device_patches()["x"]["pad_from"] is None
    np.testing.assert_array_equal(batch.arrays["x"][2:], np.repeat(host[:1], 2, axis=0))
    batch.release()
    # A full bucket: nothing to pad.
    batch = staging.stage([{"x": dev(4)}], 4)
    assert batch.device_patches() == {"x": {"parts": [(0, CudaSpan(handle(1), 1, 0, 0, 64))], "pad_from": None}}
    batch.release()


class Recorder:
    """An executor with run_parts that records how the batcher grouped requests."""

    inputs = [spec("x")]
    outputs = [spec("y")]
    capacity = 1
    ready = True
    batch_analysis = None
    max_batch_rows = 8

    def __init__(self):
        self.groups = []
        self.gate = asyncio.Event()

    async def run_parts(self, parts):
        await self.gate.wait()
        self.groups.append([f"dev{p['x'].span.device_id}" if isinstance(p["x"], DeviceInput) else "host"
                            for p in parts])
        return {"y": np.concatenate([np.asarray(p["x"]) for p in parts])}

    async def run(self, inputs):
        return await self.run_parts([inputs])

    async def close(self):
        pass


def test_the_batcher_stacks_device_rows_only_with_device_rows_of_the_same_gpu():
    ex = Recorder()
    b = DynamicBatcher(ex, ModelConfig(max_batch_size=8, batching="force"), None, "m", "1")
    assert b.batching

    def on(gpu):
        return device_input(CudaSpan(handle(gpu + 1), 1, gpu, 0, 16), np.dtype(np.float32), (1, 4))

    async def go():
        first = asyncio.ensure_future(b.submit({"x": np.zeros((1, 4), np.float32)}))  # occupies the one slot
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(b.submit({"x": x})) for x in
                (on(0), np.ones((1, 4), np.float32), on(1), on(0), np.ones((1, 4), np.float32))]
        await asyncio.sleep(0.05)
        ex.gate.set()
        await asyncio.gather(first, *rest)
        await b.close()

    asyncio.run(go())
    assert ex.groups[0] == ["host"]
    assert sorted(map(sorted, ex.groups[1:])) == sorted([["host", "host"], ["dev0", "dev0"], ["dev1"]])


# ------------------------------------------------------------------- the HTTP path, stand-in GPU executor

class StandInGpu(ThreadExecutor):
    """A ThreadExecutor playing a GPU worker for CUDA shared memory: device memory is ``memory[handle]``
    (a bytearray); device patches are applied as GpuRunner applies them."""

    def __init__(self, path, config, memory):
        super().__init__(path, config)
        self.memory = memory
        self.patches, self.closed, self.out_patches = [], [], []

    def _bytes(self, span):
        return np.frombuffer(self.memory[span.handle], np.uint8, span.nbytes, span.offset)

    async def run(self, inputs, out=None, device=None, device_out=None):
        if isinstance(device_out, list):  # the batcher's own form for a batch of one request
            from kiln.server.buckets import whole_outputs
            device_out = whole_outputs(device_out).get("device_out")
        inputs, device = dict(inputs), dict(device or {})
        for name, a in list(inputs.items()):
            if isinstance(a, DeviceInput):
                device[name] = {"parts": [(0, a.span)], "pad_from": None, "shape": a.shape, "dtype": a.dtype.str}
                del inputs[name]
        self.patches.append(device)
        for name, d in device.items():
            buf = np.array(inputs[name]) if name in inputs else np.full(d["shape"], np.nan, d["dtype"])
            flat, row_bytes = buf.reshape(-1).view(np.uint8), buf.nbytes // buf.shape[0]
            for row, span in d["parts"]:
                flat[row * row_bytes:row * row_bytes + span.nbytes] = self._bytes(span)
            if d["pad_from"]:
                buf[d["pad_from"]:] = buf[d["pad_from"] - 1]
            inputs[name] = buf
        outputs = await super().run(inputs)
        self.out_patches.append(device_out)
        for name, parts in (device_out or {}).items():
            a = np.ascontiguousarray(outputs[name])
            row_bytes = a.nbytes // a.shape[0]
            for row, rows, span in parts:
                data = a.tobytes() if rows is None else a[row:row + rows].tobytes()
                if len(data) > span.nbytes:
                    raise RegionTooSmall(f"output '{name}' is {len(data)} bytes but its shared_memory_byte_size "
                                         f"is {span.nbytes}")
                self.memory[span.handle][span.offset:span.offset + len(data)] = data
            assert row_bytes
        return outputs

    async def close_cuda(self, device_id, h):
        self.closed.append((device_id, h))


@pytest.fixture
def gpu_served(monkeypatch):
    memory, made = {}, []

    def factory(e):
        inner = StandInGpu(e.path, e.config, memory)
        made.append(inner)
        return BucketedExecutor(inner, e.config) if e.config.device != "cpu" else inner

    entries = [ModelEntry("gpu", "1", MLP, ModelConfig.from_json({"device": "cuda", "max_batch_size": 8,
                                                                   "buckets": True})),
               ModelEntry("cpu", "1", MLP, ModelConfig(workers=0, max_batch_size=8))]
    app = create_app(entries, executor_factory=factory, allow_client_shm=True)
    server = ThreadServer(app)
    client = tc.InferenceServerClient(server.url)
    yield server, client, memory, made
    client.close()
    server.stop()


def test_cuda_shared_memory_through_tritonclient_with_a_stand_in_gpu(gpu_served):
    server, client, memory, made = gpu_served
    program = kiln.load(MLP)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    want = program.run({"x": x})
    out_name, y = "probs", want["probs"]
    memory[handle(7)] = bytearray(4096)
    memory[handle(7)][128:128 + x.nbytes] = x.tobytes()
    memory[handle(8)] = bytearray(4096)
    assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
    client.register_cuda_shared_memory("in", b64(handle(7)), 0, 4096)
    client.register_cuda_shared_memory("out", b64(handle(8)), 0, 4096)
    assert client.get_cuda_shared_memory_status() == [{"name": "in", "device_id": 0, "byte_size": 4096},
                                                      {"name": "out", "device_id": 0, "byte_size": 4096}]
    inp = tc.InferInput("x", [3, 16], "FP32")
    inp.set_shared_memory("in", x.nbytes, offset=128)
    req_out = tc.InferRequestedOutput(out_name, binary_data=True)
    req_out.set_shared_memory("out", y.nbytes, offset=256)
    result = client.infer("gpu", [inp], outputs=[req_out])
    got = result.get_output(out_name)
    assert got["parameters"]["shared_memory_byte_size"] == y.nbytes and "data" not in got
    assert "binary_data_size" not in got["parameters"]  # nothing of it came in the response
    written = np.frombuffer(memory[handle(8)], np.float32, y.size, 256).reshape(y.shape)
    np.testing.assert_allclose(written, y, rtol=1e-5, atol=1e-6)
    # The batch was padded to bucket 4 on the "device" (from row 2), and its rows never came as bytes.
    gpu_inner = made[0]
    assert gpu_inner.patches[-1]["x"]["pad_from"] == 3 and gpu_inner.patches[-1]["x"]["parts"][0][0] == 0
    # The output went with the batch: rows 0..3 of 'probs' into region "out" at offset 256.
    [(row, rows, span)] = gpu_inner.out_patches[-1]["probs"]
    assert (row, rows, span.offset, span.nbytes) == (0, 3, 256, y.nbytes)
    # A region too small for the output: 400, said when the batch ran.
    small = tc.InferRequestedOutput(out_name, binary_data=True)
    small.set_shared_memory("out", y.nbytes - 4)
    with pytest.raises(Exception, match=f"output 'probs' is {y.nbytes} bytes but its shared_memory_byte_size is "
                                        f"{y.nbytes - 4}"):
        client.infer("gpu", [inp], outputs=[small])
    r = raw_post(server, "/v2/models/gpu/infer", {
        "inputs": [{"name": "x", "shape": [3, 16], "datatype": "FP32",
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes,
                                   "shared_memory_offset": 128}}],
        "outputs": [{"name": "probs", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 8}}]})
    assert r.status_code == 400 and "shared_memory_byte_size is 8" in r.json()["error"], r.text
    # A plain HTTP answer from the same model agrees (its output through the response).
    inp2 = tc.InferInput("x", [3, 16], "FP32")
    inp2.set_data_from_numpy(x)
    np.testing.assert_allclose(client.infer("gpu", [inp2]).as_numpy(out_name), y, rtol=1e-5, atol=1e-6)

    # Refusals: a CPU model, a size that does not match, past the region's end, an unknown region.
    r = raw_post(server, "/v2/models/cpu/infer", {"inputs": [
        {"name": "x", "shape": [3, 16], "datatype": "FP32",
         "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes}}]})
    assert r.status_code == 400 and "runs on the CPU: CUDA shared memory" in r.json()["error"]
    for params, message in [({"shared_memory_byte_size": 8}, "needs 192"),
                            ({"shared_memory_byte_size": x.nbytes, "shared_memory_offset": 4000}, "past the end"),
                            ({"shared_memory_region": "nope", "shared_memory_byte_size": 8}, "no system or CUDA shared")]:
        body = {"inputs": [{"name": "x", "shape": [3, 16], "datatype": "FP32",
                            "parameters": {"shared_memory_region": "in", **params}}]}
        r = raw_post(server, "/v2/models/gpu/infer", body)
        assert r.status_code == 400 and message in r.json()["error"], r.text
    # One namespace over both kinds of region.
    r = raw_post(server, "/v2/systemsharedmemory/region/in/register", {"key": "whatever", "byte_size": 8})
    assert r.status_code == 400 and "already registered" in r.json()["error"]

    # Unregister: the workers of that GPU are asked to close the handle; later use is 400.
    client.unregister_cuda_shared_memory("in")
    assert gpu_inner.closed == [(0, handle(7))]
    with pytest.raises(Exception, match="no system or CUDA shared memory region named 'in'"):
        client.infer("gpu", [inp])
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == [] and (0, handle(8)) in gpu_inner.closed


def test_cuda_regions_only_on_the_gpus_models_use(gpu_served):
    server, client, memory, _ = gpu_served
    r = raw_post(server, "/v2/cudasharedmemory/region/r/register", request(handle(9), device=1, size=64))
    assert r.status_code == 400 and "this server's models run on GPU(s) [0]" in r.json()["error"]
    assert os.environ.get("KILN_ALLOW_CLIENT_SHM") in (None, "", "0")  # the fixture allowed it by argument
