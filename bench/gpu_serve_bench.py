"""GPU serving, side by side (issue 17): ``kiln serve --device cuda`` against Triton Inference Server (through
PyTriton, torch inside), a hand-written FastAPI + torch server, and the same with torch.compile
(reduce-overhead) behind a simple batching queue, on one GPU, in one run.

Models: ResNet-50 (tests/zoo.py, torchvision's layout, random weights, 3x224x224 float32 in, 1000 logits out)
and BERT-base (transformers ``BertModel`` from ``BertConfig()``, random weights, 128 int64 ids in, the pooled
768-vector out). Every server runs the same torch module (kiln: traced from it) in float32 with TF32 off.

Servers, each its own process tree on 127.0.0.1, started one at a time:

- ``kiln``: ``kiln serve REPO --device cuda``, max_batch_size 32 (buckets 1..32, each a CUDA graph captured
  in warm-up), max queue delay 1 ms, system shared memory allowed.
- ``triton``: PyTriton 0.7 (a real ``tritonserver`` 2.51) with Triton's dynamic batcher (max batch 32, 1 ms
  queue delay), two model instances, the torch module under ``inference_mode`` in the bound function. Runs
  under ``--triton-python`` (a venv with numpy < 2, as PyTriton needs).
- ``torch``: FastAPI + uvicorn, the V2 binary protocol by hand, ``model(x)`` per request under
  ``inference_mode`` in FastAPI's thread pool: what a user writes first.
- ``torch-compile``: the same with ``torch.compile(mode="reduce-overhead", dynamic=False)`` per batch bucket
  (1, 2, 4, ..., 32, warmed up before ready) behind an asyncio batching queue (up to 32 rows or 1 ms).

Load: closed-loop clients (1, 8, 64, 256), each a keep-alive ``http.client`` connection in a thread of one of
up to 16 client processes, Triton's binary tensor extension in and out ("http"), or the system shared-memory
extension ("shm": each client registers its own input and output regions once and sends only the JSON
header; kiln and Triton), or the CUDA shared-memory extension ("cudashm": the client's input and output are
device buffers, cudaMalloc'd in the client process and registered as CUDA IPC handles; the output is read
back to the host after each answer, as the shm client reads its region; two client processes, since every
process with a CUDA context time-slices the GPU with the server). Per cell: requests/s, p50/p99 latency, mean batch size (kiln: /metrics; Triton:
its metrics port; torch-compile: its /stats), GPU utilization (NVML, sampled every 50 ms), CPU seconds per
request of the server's process tree and of the client processes. Every answer's status is checked and
its output length; the first answer of every client is compared to the model's own output on that input
(kiln: CudaProgram; the others: torch) to 1e-2 relative.

The ceiling: kiln's CudaProgram at each bucket (one graph replay, inputs and outputs on the device), best
rows/s over buckets; throughput goals are relative to it.

    python bench/gpu_serve_bench.py --models resnet50 --servers kiln,torch --clients 1,64 --json out.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MAX_BATCH = 32
BUCKETS = (1, 2, 4, 8, 16, 32)


# ------------------------------------------------------------------------------------------------ models

def build_model(name: str):
    """(torch module in eval mode on the CPU, input name, row shape, numpy dtype, output name)."""
    import torch
    torch.manual_seed(0)
    if name == "resnet50":
        sys.path.insert(0, str(ROOT / "tests"))
        import zoo
        model, _, _ = zoo.resnet50(batch=1, width=64, image=224, num_classes=1000)
        return model.eval(), "x", (3, 224, 224), np.float32, "y"
    if name == "bert":
        from transformers import BertConfig, BertModel

        class Pooled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = BertModel(BertConfig(), add_pooling_layer=True)

            def forward(self, input_ids):
                return self.bert(input_ids=input_ids).pooler_output

        return Pooled().eval(), "input_ids", (128,), np.int64, "y"
    raise SystemExit(f"unknown model {name}")


def make_input(name: str, rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "bert":
        return rng.integers(1000, 30000, size=(rows, 128), dtype=np.int64)
    return rng.standard_normal((rows, 3, 224, 224)).astype(np.float32)


def torch_settings() -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True


V2_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
NP_DTYPES = {"FP32": np.float32, "INT64": np.int64}


# ------------------------------------------------------------------------------------ hand-written peers

def torch_server_main(model_name: str, port: int, compiled: bool) -> None:
    """The hand-written peer: FastAPI + torch on the GPU (``compiled``: torch.compile per bucket behind a
    batching queue)."""
    import asyncio

    import torch
    import uvicorn
    from fastapi import FastAPI, Request, Response
    globals()["Request"] = Request  # FastAPI resolves the (string) annotations in this module's globals
    torch_settings()
    model, in_name, row, dtype, out_name = build_model(model_name)
    model = model.cuda()
    stats = {"rows": 0, "batches": 0}
    app = FastAPI()

    def parse(body: bytes, header_len: int) -> np.ndarray:
        head = json.loads(body[:header_len])
        t = head["inputs"][0]
        return np.frombuffer(body[header_len:], dtype=NP_DTYPES[t["datatype"]]).reshape(t["shape"])

    def answer(y: np.ndarray) -> Response:
        head = json.dumps({"model_name": "m", "outputs": [{"name": out_name, "datatype": "FP32", "shape": list(y.shape),
                                                          "parameters": {"binary_data_size": y.nbytes}}]}).encode()
        return Response(head + y.tobytes(), media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(head))})

    if not compiled:
        @app.post("/v2/models/m/infer")
        async def infer_plain(request: Request):
            body = await request.body()
            x = parse(body, int(request.headers["inference-header-content-length"]))

            def run():
                with torch.inference_mode():
                    return model(torch.from_numpy(x.copy()).cuda()).float().cpu().numpy()
            y = await asyncio.to_thread(run)
            stats["rows"] += 1
            stats["batches"] += 1
            return answer(y)
    else:
        fns = {}
        compiled_model = torch.compile(model, mode="reduce-overhead", dynamic=False)
        # CUDA-graph trees are per thread: warm up (compile + record) every bucket on the one thread that
        # will run the batches, before ready.
        pool = __import__("concurrent.futures").futures.ThreadPoolExecutor(1)

        def warm():
            torch_settings()
            for b in BUCKETS:
                x = torch.from_numpy(make_input(model_name, b, 0)).cuda()
                with torch.inference_mode():
                    for _ in range(3):
                        compiled_model(x)
                torch.cuda.synchronize()
                fns[b] = compiled_model
        pool.submit(warm).result()
        queue: asyncio.Queue = asyncio.Queue()

        def run_batch(xs: list) -> list:
            n = sum(len(x) for x in xs)
            b = next(k for k in BUCKETS if k >= n)
            xb = np.concatenate(xs + [np.repeat(xs[-1][-1:], b - n, axis=0)] if b > n else xs)
            with torch.inference_mode():
                y = fns[b](torch.from_numpy(xb).cuda()).float().cpu().numpy()
            out, i = [], 0
            for x in xs:
                out.append(y[i:i + len(x)].copy())
                i += len(x)
            return out

        async def batcher():
            loop = asyncio.get_running_loop()
            while True:
                items = [await queue.get()]
                deadline = loop.time() + 0.001
                while len(items) < MAX_BATCH:
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        items.append(await asyncio.wait_for(queue.get(), timeout))
                    except asyncio.TimeoutError:
                        break
                try:
                    ys = await loop.run_in_executor(pool, run_batch, [x for x, _ in items])
                    for (_, fut), y in zip(items, ys):
                        fut.set_result(y)
                except Exception as e:  # noqa: BLE001
                    for _, fut in items:
                        fut.set_exception(e)
                stats["rows"] += len(items)
                stats["batches"] += 1

        @app.on_event("startup")
        async def start():
            asyncio.get_running_loop().create_task(batcher())

        @app.post("/v2/models/m/infer")
        async def infer_batched(request: Request):
            body = await request.body()
            x = parse(body, int(request.headers["inference-header-content-length"]))
            fut = asyncio.get_running_loop().create_future()
            await queue.put((x, fut))
            return answer(await fut)

    @app.get("/stats")
    async def get_stats():
        return stats

    @app.get("/v2/health/ready")
    @app.get("/v2/models/m/ready")
    async def ready():
        return {}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def triton_server_main(model_name: str, port: int) -> None:
    """The Triton peer through PyTriton: the torch module bound with Triton's dynamic batcher."""
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig
    torch_settings()
    ts = Path(os.environ.get("KILN_BENCH_WORKDIR", "/tmp/gpu_serve_bench")) / f"{model_name}_ts.pt"
    if model_name == "bert":
        # transformers does not import beside PyTriton's numpy 1.26 in this venv: the same module, traced
        # to TorchScript by the main process (export_kiln), runs here instead (torch inside, as eager).
        _, in_name, row, dtype, out_name = "bert", "input_ids", (128,), np.int64, "y"
        model = torch.jit.load(str(ts)).eval()
    else:
        model, in_name, row, dtype, out_name = build_model(model_name)
    model = model.cuda()
    with torch.inference_mode():  # warm up every batch size's cuDNN choice
        for b in BUCKETS:
            model(torch.from_numpy(make_input(model_name, b, 0)).cuda())
    torch.cuda.synchronize()

    @batch
    def infer(**inputs):
        x = inputs[in_name]
        with torch.inference_mode():
            y = model(torch.from_numpy(x).cuda()).float().cpu().numpy()
        return {out_name: y}

    config = TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2)
    # PyTriton restricts shared memory (and statistics) to a generated token by default: open them, as a
    # tritonserver started by hand is.
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        triton.bind(model_name="m", infer_func=[infer, infer],
                    inputs=[Tensor(name=in_name, dtype=dtype, shape=row)],
                    outputs=[Tensor(name=out_name, dtype=np.float32, shape=(-1,))],
                    config=ModelConfig(max_batch_size=MAX_BATCH,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=1000)))
        triton.serve()


# --------------------------------------------------------------------------------------------- clients

def _register(conn, path: str, payload: dict):
    """POST a shared memory registration; the error text, or None when it took."""
    conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read()
    return None if r.status == 200 else f"register {r.status}: {text[:200]!r}"


def _shm_request(in_name, shape, dtype, in_region, in_bytes, out_name, out_region, out_bytes) -> bytes:
    """An inference request whose input and output are in shared memory regions (system or CUDA alike)."""
    return json.dumps({"inputs": [{"name": in_name, "shape": shape, "datatype": dtype,
                                   "parameters": {"shared_memory_region": in_region,
                                                  "shared_memory_byte_size": in_bytes}}],
                       "outputs": [{"name": out_name, "parameters": {"shared_memory_region": out_region,
                                                                     "shared_memory_byte_size": out_bytes}}]}).encode()


def client_main(spec: dict) -> None:
    """One client process: ``threads`` closed-loop clients; a JSON summary on stdout."""
    host, port = "127.0.0.1", spec["port"]
    model, mode = spec["model"], spec["mode"]
    in_name, out_name, row, out_bytes = spec["in_name"], spec["out_name"], spec["row"], spec["out_bytes"]
    lat: list = []
    errors: list = []
    firsts: dict = {}
    t0 = time.monotonic()
    start, end = t0 + spec["warm_s"], t0 + spec["warm_s"] + spec["seconds"]
    dtype = "INT64" if model == "bert" else "FP32"

    def loop(k: int) -> None:
        seed = spec["seed"] * 1000 + k
        x = make_input(model, 1, seed)
        conn = http.client.HTTPConnection(host, port, timeout=120)
        regions = []
        dev = []  # CUDA regions: (name, device pointer, size)
        try:
            if mode == "cudashm":  # the client's tensors live on the GPU (cudaMalloc + CUDA IPC handles)
                import base64

                import cupy as cp
                rt = cp.cuda.runtime
                tag = f"kc{os.getpid()}_{k}"
                for suffix, size in (("i", x.nbytes), ("o", out_bytes)):
                    ptr = rt.malloc(size)
                    dev.append((f"{tag}{suffix}", ptr, size))
                    handle = base64.b64encode(bytes(rt.ipcGetMemHandle(ptr))).decode()
                    failed = _register(conn, f"/v2/cudasharedmemory/region/{tag}{suffix}/register",
                                       {"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": size})
                    if failed:
                        errors.append(failed)
                        return
                xc = np.ascontiguousarray(x)
                rt.memcpy(dev[0][1], xc.ctypes.data, xc.nbytes, 1)
                body = _shm_request(in_name, [1, *row], dtype, dev[0][0], x.nbytes, out_name, dev[1][0], out_bytes)
                headers = {"Content-Type": "application/json"}
                y_host = np.empty(out_bytes // 4, np.float32)
            elif mode == "shm":
                tag = f"kb{os.getpid()}_{k}"
                for suffix, size in (("i", x.nbytes), ("o", out_bytes)):
                    fd = os.open(f"/dev/shm/{tag}{suffix}", os.O_CREAT | os.O_RDWR, 0o600)
                    os.ftruncate(fd, size)
                    mm = mmap.mmap(fd, size)
                    os.close(fd)
                    regions.append((f"{tag}{suffix}", mm, size))
                    failed = _register(conn, f"/v2/systemsharedmemory/region/{tag}{suffix}/register",
                                       {"key": f"/{tag}{suffix}", "offset": 0, "byte_size": size})
                    if failed:
                        errors.append(failed)
                        return
                regions[0][1][:] = x.tobytes()
                body = _shm_request(in_name, [1, *row], dtype, regions[0][0], x.nbytes, out_name, regions[1][0],
                                    out_bytes)
                headers = {"Content-Type": "application/json"}
            else:
                head = json.dumps({"inputs": [{"name": in_name, "shape": [1, *row], "datatype": dtype,
                                               "parameters": {"binary_data_size": x.nbytes}}],
                                   "outputs": [{"name": out_name, "parameters": {"binary_data": True}}]}).encode()
                body = head + x.tobytes()
                headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
            first = True
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                try:
                    conn.request("POST", "/v2/models/m/infer", body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                    ok = r.status == 200
                    if ok and mode == "http":
                        hl = int(r.getheader("Inference-Header-Content-Length", "0") or 0)
                        ok = len(data) - hl == out_bytes
                        y = np.frombuffer(data[hl:], np.float32) if ok else None
                    elif ok and mode == "cudashm":  # the answer read back, as the shm client reads its region
                        rt.memcpy(y_host.ctypes.data, dev[1][1], out_bytes, 2)
                        y = y_host.copy()
                    elif ok:
                        y = np.frombuffer(regions[1][1], np.float32).copy()
                    if not ok and len(errors) < 5:
                        errors.append(f"{r.status}: {data[:200]!r}")
                    if ok and first:
                        firsts[k] = (seed, y[:8].tolist(), float(np.abs(y).max()))
                        first = False
                except OSError as e:
                    ok = False
                    if len(errors) < 5:
                        errors.append(f"{type(e).__name__}: {e}")
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=120)
                done = time.monotonic()
                if now >= start and done <= end:
                    if ok:
                        lat.append(done - now)
                    else:
                        errors.append("") if len(errors) < 5 else None
        finally:
            for name, ptr, _ in dev:
                try:
                    conn.request("POST", f"/v2/cudasharedmemory/region/{name}/unregister", body=b"{}",
                                 headers={"Content-Type": "application/json"})
                    conn.getresponse().read()
                except OSError:
                    pass
                rt.free(ptr)
            for name, mm, _ in regions:
                try:
                    conn.request("POST", f"/v2/systemsharedmemory/region/{name}/unregister", body=b"{}",
                                 headers={"Content-Type": "application/json"})
                    conn.getresponse().read()
                except OSError:
                    pass
                mm.close()
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
            conn.close()

    cpu0 = time.process_time()
    ts = [threading.Thread(target=loop, args=(k,)) for k in range(spec["threads"])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"lat": lat, "errors": errors, "cpu_s": time.process_time() - cpu0, "firsts": firsts}))


# ----------------------------------------------------------------------------------------- measurement

def tree_cpu(pid: int) -> float:
    """CPU seconds of a server's whole process tree (from /proc): gpu_serve_smoke's."""
    from gpu_serve_smoke import server_cpu
    return server_cpu(pid)


class GpuSampler:
    """NVML utilization of GPU 0, sampled every 50 ms between start() and stop()."""

    def __init__(self):
        self.samples: list = []
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001
            self.nvml = None

    def start(self):
        self.samples, self._stop = [], threading.Event()
        if self.nvml is not None:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()

    def _run(self):
        while not self._stop.wait(0.05):
            try:
                self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            except Exception:  # noqa: BLE001
                return

    def stop(self) -> float | None:
        self._stop.set()
        if self.nvml is not None:
            self._t.join()
        return float(np.mean(self.samples)) if self.samples else None


def batch_counts(server: dict) -> tuple[float, float]:
    """(rows, batches) so far, as the server counts them."""
    try:
        if server["kind"] == "kiln":
            text = get(server["port"], "/metrics")
            s = sum(float(v) for v in re.findall(r'^kiln_batch_size_sum\{[^}]*\} (\S+)$', text, re.M))
            n = sum(float(v) for v in re.findall(r'^kiln_batch_size_count\{[^}]*\} (\S+)$', text, re.M))
            return s, n
        if server["kind"] == "triton":
            text = get(server["port"] + 2, "/metrics")
            s = sum(float(v) for v in re.findall(r'^nv_inference_count\{[^}]*model="m"[^}]*\} (\S+)$', text, re.M))
            n = sum(float(v) for v in re.findall(r'^nv_inference_exec_count\{[^}]*model="m"[^}]*\} (\S+)$', text, re.M))
            return s, n
        st = json.loads(get(server["port"], "/stats"))
        return float(st["rows"]), float(st["batches"])
    except Exception:  # noqa: BLE001
        return float("nan"), float("nan")


def get(port: int, path: str) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    return c.getresponse().read().decode()


def drive(server: dict, model: str, mode: str, clients: int, seconds: float, gpu: GpuSampler, meta: dict) -> dict:
    # CUDA clients: each client process holds a CUDA context, and contexts of several processes time-slice the
    # GPU (no MPS here), slowing the server's own kernels; two processes hold the threads.
    procs_n = min(clients, 2 if mode == "cudashm" else 16)
    per = [clients // procs_n + (1 if i < clients % procs_n else 0) for i in range(procs_n)]
    warm_s = 1.5
    r0, b0 = batch_counts(server)
    cpu0 = tree_cpu(server["proc"].pid)
    procs = []
    for i, t in enumerate(per):
        spec = {"port": server["port"], "model": model, "mode": mode, "threads": t, "seconds": seconds, "warm_s": warm_s,
                "seed": i, "in_name": meta["in_name"], "out_name": meta["out_name"], "row": meta["row"],
                "out_bytes": meta["out_bytes"]}
        procs.append(subprocess.Popen([sys.executable, __file__, "--client", json.dumps(spec)], stdout=subprocess.PIPE,
                                      text=True))
    time.sleep(warm_s)
    gpu.start()
    spy = None
    if os.environ.get("PYSPY") and server["kind"] == "kiln" and clients == int(os.environ["PYSPY"]) and mode == "http":
        out = Path(os.environ.get("OUT", "/tmp")) / f"pyspy_{model}_{mode}_{clients}.txt"
        spy = subprocess.Popen(["py-spy", "record", "-p", str(server["proc"].pid), "-d", str(int(seconds) - 1),
                                "-r", "250", "-s", "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    outs = [json.loads(p.communicate()[0] or "{}") for p in procs]
    util = gpu.stop()
    if spy is not None:
        spy.wait()
    cpu1 = tree_cpu(server["proc"].pid)
    r1, b1 = batch_counts(server)
    lat = np.array(sorted(x for o in outs for x in o.get("lat", [])))
    n = len(lat)
    errors = [e for o in outs for e in o.get("errors", [])]
    firsts = {}
    for i, o in enumerate(outs):
        for k, v in o.get("firsts", {}).items():
            firsts[v[0]] = v[1:]
    return {"clients": clients, "mode": mode, "requests": n, "errors": len(errors), "error_samples": errors[:3],
            "req_per_s": n / seconds, "p50_ms": float(np.percentile(lat, 50) * 1e3) if n else None,
            "p99_ms": float(np.percentile(lat, 99) * 1e3) if n else None,
            "mean_batch": (r1 - r0) / (b1 - b0) if b1 > b0 else None, "gpu_util_pct": util,
            "server_cpu_us_per_req": (cpu1 - cpu0) / max(1, n) * 1e6,
            "client_cpu_us_per_req": sum(o.get("cpu_s", 0) for o in outs) / max(1, n) * 1e6,
            "client_processes": procs_n, "firsts": firsts}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc, timeout: float, path: str = "/v2/health/ready", log: str = "") -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None or (log and "FAILED to load" in Path(log).read_text(errors="replace")):
            return False
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def stop(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ------------------------------------------------------------------------------------------------- main

def export_kiln(model_name: str, work: Path, device: str = "cuda", gpus: str = "") -> tuple[Path, dict, str]:
    import torch

    import kiln
    model, in_name, row, dtype, out_name = build_model(model_name)
    x = torch.from_numpy(make_input(model_name, 1, 0))
    repo = work / f"repo_{model_name}"
    (repo / "m" / "1").mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        g = kiln.trace(model, {in_name: x}, dynamic={in_name: {0: "batch"}})
    kiln.save(g, repo / "m" / "1" / "model.kiln")
    kiln_out = g.outputs[0].name
    config = {"max_batch_size": MAX_BATCH, "max_queue_delay_ms": 1, "device": device, "buckets": True}
    if gpus:  # kiln on several GPUs: one worker process on each
        config["instance_group"] = [{"kind": "gpu", "count": 1, "gpus": [int(g) for g in gpus.split(",")]}]
    (repo / "m" / "config.json").write_text(json.dumps(config))
    if model_name == "bert":  # the Triton peer's copy of the module (triton_server_main)
        with torch.inference_mode():
            import copy  # traced on the GPU: tensors the module makes while tracing are recorded on its device
            torch.jit.trace(copy.deepcopy(model).cuda(), (x.cuda(),), check_trace=False,
                            strict=False).save(str(work / f"{model_name}_ts.pt"))
    with torch.inference_mode():
        ref = {s: model(torch.from_numpy(make_input(model_name, 1, s))).float().numpy()[0]
               for s in range(0, 16)}
    return repo, ref, kiln_out


def ceiling(repo: Path, model_name: str) -> dict:
    import cupy as cp

    import kiln
    prog = kiln.load(repo / "m" / "1" / "model.kiln", device="cuda")
    name = prog.inputs[0].name
    out = {}
    for b in BUCKETS:
        x = cp.asarray(make_input(model_name, b, 1))
        for _ in range(3):
            prog.run({name: x})
        cp.cuda.runtime.deviceSynchronize()
        n = 30
        t = time.perf_counter()
        for _ in range(n):
            prog.run({name: x})
        cp.cuda.runtime.deviceSynchronize()
        dt = (time.perf_counter() - t) / n
        out[b] = {"ms": dt * 1e3, "rows_per_s": b / dt}
    del prog
    return out


def start_server(kind: str, model: str, repo: Path, args) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", KILN_BENCH_WORKDIR=str(args.workdir))
    log = open(Path(args.workdir) / f"server_{kind}_{model}.log", "w")
    if kind == "kiln":
        cmd = [sys.executable, "-m", "kiln", "serve", str(repo), "--port", str(port), "--allow-client-shm"]
        timeout = 300
    elif kind == "triton":
        cmd = [args.triton_python, __file__, "--triton-server", model, str(port)]
        timeout = 300
    else:
        cmd = [sys.executable, __file__, "--torch-server", model, str(port)] + (["--compile"] if kind == "torch-compile" else [])
        timeout = 300 if kind == "torch-compile" else 120
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    ok = wait_ready(port, proc, timeout, "/v2/models/m/ready", log.name)
    return {"kind": kind, "port": port, "proc": proc, "ready": ok, "ready_s": time.time() - t, "log": log.name}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(json.loads(sys.argv[2]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-server":
        torch_server_main(sys.argv[2], int(sys.argv[3]), "--compile" in sys.argv)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--triton-server":
        triton_server_main(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--servers", default="kiln,triton,torch,torch-compile")
    ap.add_argument("--clients", default="1,8,64,256")
    ap.add_argument("--modes", default="http,shm")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--triton-python", default="/tmp/vt/bin/python")
    ap.add_argument("--workdir", default="/tmp/gpu_serve_bench")
    ap.add_argument("--json", required=True)
    ap.add_argument("--gpus", default="", help="kiln's GPUs, e.g. 0,1 (an instance group, one worker on each)")
    ap.add_argument("--cpu-check", action="store_true", help="kiln on the CPU, no ceiling: checks this script only")
    args = ap.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        device = "no GPU"
    report = {"device": device,
              "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "models": {}}
    gpu = GpuSampler()

    def save():
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))

    for model in args.models.split(","):
        t = time.time()
        repo, ref, kiln_out = export_kiln(model, Path(args.workdir), "cpu" if args.cpu_check else "cuda",
                                              args.gpus)
        _, in_name, row, dtype, out_name = build_model(model)
        out_bytes = 4 * (1000 if model == "resnet50" else 768)
        meta = {"in_name": in_name, "out_name": out_name, "row": list(row), "out_bytes": out_bytes}
        entry = report["models"][model] = {"export_s": time.time() - t, "servers": {},
                                      "ceiling": {} if args.cpu_check else ceiling(repo, model)}
        print(model, "ceiling", json.dumps(entry["ceiling"]), flush=True)
        save()
        for kind in args.servers.split(","):
            server = start_server(kind, model, repo, args)
            s = entry["servers"][kind] = {"ready": server["ready"], "ready_s": server["ready_s"], "runs": []}
            print(model, kind, "ready" if server["ready"] else "NOT READY", f"{server['ready_s']:.1f} s", flush=True)
            try:
                if server["ready"]:
                    modes = [m for m in args.modes.split(",") if m == "http" or kind in ("kiln", "triton")]
                    for mode in modes:
                        for c in [int(x) for x in args.clients.split(",")]:
                            m = dict(meta, out_name=kiln_out) if kind == "kiln" else meta
                            r = drive(server, model, mode, c, args.seconds, gpu, m)
                            # The first answer of each client against the model in torch (CPU) on its input.
                            worst = 0.0
                            for seed, (head, scale) in r.pop("firsts").items():
                                if int(seed) in ref:
                                    want = ref[int(seed)][:8]
                                    worst = max(worst, float(np.max(np.abs(np.array(head) - want)) /
                                                         max(1e-6, float(np.abs(ref[int(seed)]).max()))))
                            r["max_rel_err_vs_torch_cpu"] = worst
                            s["runs"].append(r)
                            print(model, kind, mode, json.dumps(r), flush=True)
                            save()
            finally:
                stop(server["proc"])
                s["log_tail"] = Path(server["log"]).read_text()[-1500:]
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
