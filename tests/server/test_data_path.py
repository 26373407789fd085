"""The server's data path (issue 17): the shared staging arena between the HTTP process and its workers
(server/arena.py), output buffers in Staging, the infer fast path of KilnApp and the protocol's body sink
(server/connections.py). CPU only: the GPU half (page-locking arena blocks, copies on the worker's stream)
runs in tests/server/test_gpu_serve.py on the GPU machine."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

import kiln  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.arena import PAGE, Arena, ArenaFull, ArenaRef  # noqa: E402
from kiln.server.buckets import BucketedExecutor, Staging  # noqa: E402
from kiln.server.connections import ConnectionLimits, ConnectionTracker, make_protocol_class  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402
from kiln.server.workers import ProcessExecutor, fill_out  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def spec(name, dtype, shape):
    return SimpleNamespace(name=name, dtype=dtype, shape=shape)


# ------------------------------------------------------------------------------------------------ arena

def test_arena_blocks_are_page_aligned_reused_by_size_and_bounded():
    arena = Arena(4 * PAGE)
    a = arena.alloc((10,), np.float32)
    b = arena.alloc((PAGE // 4 + 1,), np.float32)  # just over a page: two pages
    assert a.ctypes.data % PAGE == 0 and b.ctypes.data % PAGE == 0
    assert arena.in_use == 3 * PAGE
    with pytest.raises(ArenaFull, match="no free block"):
        arena.alloc((2 * PAGE,), np.uint8)
    fallback = arena.allocator((2 * PAGE,), np.uint8)  # Staging's allocator: ordinary memory instead
    assert arena.ref(fallback) is None
    arena.free(a)
    c = arena.alloc((3,), np.int64)  # the freed one-page block comes back
    assert c.ctypes.data == a.ctypes.data
    arena.close()


def test_arena_refs_name_arrays_inside_it_only():
    arena = Arena(1 << 20)
    x = arena.alloc((4, 3), np.float32)
    x[:] = np.arange(12).reshape(4, 3)
    ref = arena.ref(x)
    assert isinstance(ref, ArenaRef) and ref.shape == (4, 3) and ref.dtype == "<f4"
    np.testing.assert_array_equal(arena.view(ref), x)
    assert arena.ref(x[:, 1]) is None            # not contiguous
    assert arena.ref(np.zeros(3)) is None         # elsewhere
    enc = arena.encode({"a": x, "b": np.ones(2)})
    assert isinstance(enc["a"], ArenaRef) and isinstance(enc["b"], np.ndarray)
    np.testing.assert_array_equal(arena.decode(enc)["a"], x)
    with pytest.raises(ValueError, match="outside the arena"):
        arena.view(ArenaRef(arena.size - 4, (2,), "<f4"))
    arena.close()


def test_a_second_mapping_of_the_same_memfd_sees_the_same_bytes():
    arena = Arena(1 << 16)
    other = Arena(arena.size, fd=arena.fd)  # what a worker does with the inherited descriptor
    x = arena.alloc((8,), np.int64)
    x[:] = np.arange(8)
    np.testing.assert_array_equal(other.view(arena.ref(x)), np.arange(8))
    other.view(arena.ref(x))[0] = 42
    assert x[0] == 42
    arena.close()


# ---------------------------------------------------------------------------------------------- staging

def test_staging_holds_output_buffers_and_frees_one_off_buffers():
    arena = Arena(1 << 20)
    freed = []

    def free(a):
        freed.append(a)
        arena.free(a)

    staging = Staging([spec("x", "float32", ("batch", 4))], (2, 4), arena.allocator, copies=1,
                      outputs=[spec("y", "float32", ("batch", 3)), spec("z", "float32", ("batch", "n"))], free=free)
    first = staging.acquire(4)
    assert set(first.outputs) == {"y"} and first.outputs["y"].shape == (4, 3)  # z has no static row shape
    assert arena.ref(first.outputs["y"]) is not None
    second = staging.acquire(4)  # the pool is busy: buffers for this batch alone
    assert second.arrays["x"] is not first.arrays["x"]
    second.release()
    assert len(freed) == 2  # its input and output buffers went back to the arena
    first.release()
    assert freed[2:] == []  # pooled buffers are kept
    (again,) = staging.free_sets(4)
    assert again.outputs["y"] is first.outputs["y"]
    arena.close()


def test_fill_out_copies_what_fits():
    out = {"y": np.zeros((2, 3), np.float32), "z": np.zeros((2,), np.float32)}
    got = fill_out({"y": np.ones((2, 3), np.float32), "z": np.ones((3,), np.float32)}, out)
    assert got["y"] is out["y"] and out["y"].sum() == 6
    assert got["z"] is not out["z"] and out["z"].sum() == 0  # wrong shape: returned as it is


# ------------------------------------------------------------------- worker processes through the arena

def test_bucketed_worker_batches_cross_through_the_arena():
    program = kiln.load(MLP)
    config = ModelConfig(max_batch_size=8, workers=1, buckets=True)

    async def main():
        inner = ProcessExecutor(MLP, config, 1)
        ex = BucketedExecutor(inner, config)
        await ex.start()
        try:
            assert inner.arena is not None and ex.staging.allocator == inner.arena.allocator
            rng = np.random.default_rng(0)
            for n in (1, 3, 8):
                parts = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(n)]
                outs = await ex.run_parts(parts)
                want = program.run({"x": np.concatenate([p["x"] for p in parts])})
                for name in ("logits", "probs"):
                    np.testing.assert_allclose(outs[name], want[name], rtol=1e-5, atol=1e-6)
                    assert inner.arena.ref(outs[name]) is None  # copied out of the reused output buffer
            # Every bucket's inputs and outputs are arena blocks: the pipe carried references only.
            assert inner.arena.in_use >= sum(b * (16 + 4 + 4) * 4 for b in ex.buckets)
        finally:
            await ex.close()
        assert inner.arena._buf is None  # closed with the executor

    asyncio.run(main())


# --------------------------------------------------------------------------- the fast path and the sink

class GuardedServer:
    """uvicorn with kiln's protocol class (the body sink) serving ``app`` on 127.0.0.1 in a thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        tracker = ConnectionTracker(ConnectionLimits().resolve())
        config = uvicorn.Config(app, lifespan="on", log_level="warning", http=make_protocol_class(tracker))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("not ready")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@pytest.fixture(scope="module")
def guarded():
    app = create_app([ModelEntry("mlp", "1", MLP, ModelConfig(max_batch_size=8, workers=0))])
    server = GuardedServer(app)
    yield server
    server.stop()


def binary_request(x: np.ndarray) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    return head + x.tobytes(), {"Content-Type": "application/octet-stream",
                                "Inference-Header-Content-Length": str(len(head))}


def raw_exchange(port: int, data: bytes, shutdown: bool = False, timeout: float = 20.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shutdown:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while b"\r\n\r\n" not in out or len(out) < out.index(b"\r\n\r\n") + 4 + _length(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


def test_binary_infer_through_the_sink_equals_the_program(guarded):
    program = kiln.load(MLP)
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    body, headers = binary_request(x)
    r = httpx.post(f"http://127.0.0.1:{guarded.port}/v2/models/mlp/infer", content=body, headers=headers)
    assert r.status_code == 200
    n = int(r.headers["inference-header-content-length"])
    got = np.frombuffer(r.content[n:], np.float32).reshape(3, 4)
    np.testing.assert_allclose(got, program.run({"x": x})["logits"], rtol=1e-5, atol=1e-6)
    # The same through the versioned path and as JSON (no sink for versions? the same fast path).
    r = httpx.post(f"http://127.0.0.1:{guarded.port}/v2/models/mlp/versions/1/infer",
                   json={"inputs": [{"name": "x", "shape": [3, 16], "datatype": "FP32", "data": x.ravel().tolist()}]})
    assert r.status_code == 200
    logits = next(o for o in r.json()["outputs"] if o["name"] == "logits")
    np.testing.assert_allclose(np.array(logits["data"]).reshape(3, 4), program.run({"x": x})["logits"], rtol=1e-5,
                               atol=1e-6)


def test_chunked_and_gzip_bodies_take_uvicorns_path(guarded):
    import gzip
    x = np.ones((1, 16), np.float32)
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}).encode()
    r = httpx.post(f"http://127.0.0.1:{guarded.port}/v2/models/mlp/infer", content=iter([body[:10], body[10:]]),
                   headers={"Content-Type": "application/json"})  # an iterator: chunked transfer encoding
    assert r.status_code == 200, r.text
    r = httpx.post(f"http://127.0.0.1:{guarded.port}/v2/models/mlp/infer", content=gzip.compress(body),
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_fast_path_errors_are_json_with_their_status(guarded):
    base = f"http://127.0.0.1:{guarded.port}/v2/models"
    r = httpx.post(f"{base}/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(f"{base}/mlp/infer", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = httpx.post(f"{base}/mlp/versions/7/infer", json={"inputs": []})
    assert r.status_code == 404
    r = httpx.get(f"{base}/mlp/infer")  # not a POST: FastAPI answers as before
    assert r.status_code == 405 and "error" in r.json()


def test_a_body_shorter_than_declared_is_not_served(guarded):
    x = np.ones((1, 16), np.float32)
    body, headers = binary_request(x)
    head = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {headers['Inference-Header-Content-Length']}\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n").encode()
    out = raw_exchange(guarded.port, head + body, shutdown=True)
    assert not out.startswith(b"HTTP/1.1 200")  # no answer, or an error: never a model run on a short body
    # The server still serves.
    body, headers = binary_request(x)
    assert httpx.post(f"http://127.0.0.1:{guarded.port}/v2/models/mlp/infer", content=body,
                      headers=headers).status_code == 200


def test_the_protocol_hands_an_inference_body_over_in_one_buffer():
    seen = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/v2/health/ready":
            body = b"{}"
        else:
            m = await receive()
            seen.append((scope["path"], "kiln.declared" in m, bytes(m["body"]), m["more_body"]))
            body = b"{}"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": body})

    server = GuardedServer(app)
    try:
        payload = bytes(range(256)) * 4000  # ~1 MB: many socket reads
        httpx.post(f"http://127.0.0.1:{server.port}/v2/models/m/infer", content=payload)
        httpx.post(f"http://127.0.0.1:{server.port}/v2/other", content=b"abc")
    finally:
        server.stop()
    assert seen[0] == ("/v2/models/m/infer", True, payload, False)  # one message, the whole body
    assert seen[1][:2] == ("/v2/other", False)  # elsewhere: uvicorn's own messages


def test_a_cancelled_batch_gives_its_arena_blocks_back_once_its_run_is_over():
    from kiln.ir.batch_independence import BatchAnalysis
    from kiln.runtime.program import TensorSpec, TensorType

    class Gated:
        batch_analysis = BatchAnalysis(True, "batch", "row by row")

        def __init__(self):
            self.inputs = [TensorSpec("x", TensorType("float32", ("batch", 1024)))]
            self.outputs = [TensorSpec("y", TensorType("float32", ("batch", 1024)))]
            self.capacity, self.ready, self.gate = 1, False, None
            self.arena = Arena(1 << 22)

        def start(self):
            self.ready = True

        async def run(self, inputs):
            if self.gate is not None:
                await self.gate.wait()
            return {"y": inputs["x"] + 1}

        async def close(self):
            self.arena.close()

    fake = Gated()
    cfg = SimpleNamespace(max_batch_size=4, max_queue_delay_ms=0, queue_size=100, timeout_ms=10000, workers=0,
                          instances=1, backend="kiln", batching="auto", preferred_batch_size=None, buckets=True)
    ex = BucketedExecutor(fake, cfg)

    async def main():
        await ex.start()
        baseline = fake.arena.in_use
        fake.gate = asyncio.Event()
        task = asyncio.ensure_future(ex.run_parts([{"x": np.ones((3, 1024), np.float32)}]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fake.arena.in_use > baseline  # the pool got a fresh set; the old one is still being read
        fake.gate.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if fake.arena.in_use == baseline:
                break
        assert fake.arena.in_use == baseline  # the old set went back to the arena
        out = await ex.run_parts([{"x": np.zeros((2, 1024), np.float32)}])
        np.testing.assert_array_equal(out["y"], np.ones((2, 1024)))

    asyncio.run(main())


def test_staging_mib_is_a_checked_config_key_and_zero_turns_the_arena_off(tmp_path):
    from kiln.errors import KilnError
    assert ModelConfig().staging_mib == 1024.0
    assert ModelConfig.from_json({"staging_mib": 64}).staging_mib == 64.0
    with pytest.raises(KilnError, match="'staging_mib' must be >= 0"):
        ModelConfig.from_json({"staging_mib": -1})
    with pytest.raises(KilnError, match="'staging_mib' must be a number"):
        ModelConfig.from_json({"staging_mib": "big"})
    program = kiln.load(MLP)
    config = ModelConfig(max_batch_size=4, workers=1, buckets=True, staging_mib=0)

    async def main():
        inner = ProcessExecutor(MLP, config, 1)
        ex = BucketedExecutor(inner, config)
        await ex.start()
        try:
            assert inner.arena is None  # batches are pickled through the pipe, as before the arena
            x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
            out = await ex.run_parts([{"x": x[i:i + 1]} for i in range(3)])
            np.testing.assert_allclose(out["logits"], program.run({"x": x})["logits"], rtol=1e-5, atol=1e-6)
        finally:
            await ex.close()

    asyncio.run(main())


def test_pipelined_inference_requests_each_get_their_own_body(guarded):
    """Two requests written at once on one connection (HTTP/1.1 pipelining): the second one's head arrives
    while the first is still being answered; each must be served from its own body buffer."""
    program = kiln.load(MLP)
    xs = [np.full((1, 16), v, np.float32) for v in (1.0, -2.0, 3.0)]
    raw = b""
    for x in xs:
        body, headers = binary_request(x)
        raw += (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                f"Inference-Header-Content-Length: {headers['Inference-Header-Content-Length']}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        s.sendall(raw)
        data = b""
        answers = []
        while len(answers) < len(xs):
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(answers)} answers"
            data += chunk
            while b"\r\n\r\n" in data:
                head, rest = data.split(b"\r\n\r\n", 1)
                n = _length(head + b"\r\n\r\n")
                if len(rest) < n:
                    break
                hl = int(next(l.split(b":")[1] for l in head.split(b"\r\n")
                              if l.lower().startswith(b"inference-header-content-length")))
                answers.append((head.split(b" ")[1], np.frombuffer(rest[hl:n], np.float32)))
                data = rest[n:]
    for x, (status, y) in zip(xs, answers):
        assert status == b"200"
        np.testing.assert_allclose(y, program.run({"x": x})["logits"].ravel(), rtol=1e-5, atol=1e-6)


def test_the_sink_aligns_the_binary_part_so_tensors_are_views_not_copies():
    from kiln.server import protocol
    from kiln.server.connections import aligned_sink
    for length, header in [(1, 0), (100, 37), (4096, 4095), (10, 50), (602_200, 131)]:
        buf = aligned_sink(length, header)
        assert len(buf) == length and buf.readonly is False
        addr = np.frombuffer(buf, np.uint8).ctypes.data
        assert (addr + min(header, length)) % 64 == 0, (length, header)
    x = np.random.default_rng(2).standard_normal((2, 3, 5)).astype(np.float32)
    body, headers = binary_request(x)
    hl = int(headers["Inference-Header-Content-Length"])
    assert hl % 4, "the test wants a JSON header that would misalign the data"
    sink = aligned_sink(len(body), hl)
    sink[:] = body
    req = protocol.parse_infer_request(sink, hl, max_elements=1 << 20)
    got = req.inputs["x"]
    np.testing.assert_array_equal(got, x)
    assert got.flags.aligned and np.shares_memory(got, np.frombuffer(sink, np.uint8))  # decoded in place
