"""Where one request's time goes on the GPU server (issue 17's one-client goal: request latency <= model
latency + 0.5 ms). One model, batch 1, one request at a time, p50 of N runs at each layer of the stack,
each layer adding one piece to the one before:

  L0 model         CudaProgram.run, device input and output (the ceiling's own measure)
  L1 host io       + host input, host output: the worker's program (output="numpy", wait="block")
  L2 runner        + GpuRunner.run with arena blocks in and out (page-locked; in this process)
  L3 worker        + a GPU worker process: GpuBucketedExecutor.run_parts from an asyncio loop (staging, the
                     pipe both ways, the worker's thread hand-off, the reader thread, call_soon_threadsafe)
  L4 app           + the V2 app in process, called as uvicorn calls it (no socket): parse, batcher, encode
  L5 http          + a real ``kiln serve`` over one keep-alive HTTP connection (binary tensors), from a
                     Python http.client client (whose own CPU time per request is printed too)

    python bench/gpu_latency_probe.py --model resnet50 --n 300 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def p50(ts) -> float:
    return float(np.percentile(np.array(ts) * 1e3, 50))


def timed(fn, n: int, warm: int = 20) -> list:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


async def atimed(fn, n: int, warm: int = 20) -> list:
    for _ in range(warm):
        await fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import cupy as cp

    import gpu_serve_bench as gsb
    import kiln
    from kiln.server.arena import Arena
    from kiln.server.gpu import GpuRunner
    work = Path(tempfile.mkdtemp(prefix="kiln_latency_"))
    repo, _, out_name = gsb.export_kiln(args.model, work)
    path = repo / "m" / "1" / "model.kiln"
    x = gsb.make_input(args.model, 1, 3)
    rows = {}

    prog = kiln.load(path, device="cuda")
    name = prog.inputs[0].name
    xd = cp.asarray(x)

    def l0():
        prog.run({name: xd})
        cp.cuda.runtime.deviceSynchronize()
    rows["L0 model"] = p50(timed(l0, args.n))
    prog = None

    wprog = kiln.load(path, device="cuda", output="numpy", wait="block")
    rows["L1 host io"] = p50(timed(lambda: wprog.run({name: x}), args.n))
    arena = Arena(64 << 20)
    runner = GpuRunner(wprog, arena)
    xa = arena.alloc(x.shape, x.dtype)
    xa[:] = x
    want = wprog.run({name: x})
    outs = {k: arena.alloc(v.shape, v.dtype) for k, v in want.items()}
    rows["L2 runner"] = p50(timed(lambda: runner.run({name: xa}, outs), args.n))
    runner = wprog = None

    from kiln.server.gpu import make_gpu_executor
    from kiln.server.repository import ModelConfig
    config = ModelConfig.from_json({"device": "cuda", "max_batch_size": gsb.MAX_BATCH, "buckets": True})

    async def l3():
        ex = make_gpu_executor(path, config)
        await ex.start()
        try:
            return p50(await atimed(lambda: ex.run_parts([{name: x}]), args.n))
        finally:
            await ex.close()
    rows["L3 worker"] = asyncio.run(l3())

    from kiln.server.app import create_app
    from kiln.server.repository import discover

    head = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32" if x.dtype == np.float32
                                   else "INT64", "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": out_name, "parameters": {"binary_data": True}}]}).encode()
    body = head + x.tobytes()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}

    async def l4():
        ready = asyncio.Event()
        app = create_app(discover(repo), on_ready=lambda s: ready.set())
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v2/models/m/infer", "raw_path": b"/v2/models/m/infer",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
                 + [(b"content-length", str(len(body)).encode())]}

        async def one():  # the app called as uvicorn calls it, the body in one message
            sent, status = [False], []

            async def receive():
                if not sent[0]:
                    sent[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.sleep(3600)

            async def send(msg):
                if msg["type"] == "http.response.start":
                    status.append(msg["status"])
            await app(dict(scope, state={}), receive, send)
            assert status == [200], status
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(ready.wait(), 300)
            return p50(await atimed(one, args.n))
    rows["L4 app"] = asyncio.run(l4())

    port = gsb.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(repo), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        assert gsb.wait_ready(port, proc, 300), "kiln serve did not become ready"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def l5():
            conn.request("POST", "/v2/models/m/infer", body=body, headers=headers)
            r = conn.getresponse()
            r.read()
            assert r.status == 200
        c0 = time.process_time()
        rows["L5 http"] = p50(timed(l5, args.n))
        client_cpu_ms = (time.process_time() - c0) / (args.n + 20) * 1e3
        conn.close()
    finally:
        gsb.stop(proc)

    prev = None
    print(f"{args.model} batch 1, p50 of {args.n} (ms); each layer adds one piece to the one above")
    for k, v in rows.items():
        print(f"  {k:12s} {v:7.3f}" + (f"   (+{v - prev:.3f})" if prev is not None else ""))
        prev = v
    print(f"  request - model: +{rows['L5 http'] - rows['L0 model']:.3f} ms; the client's own CPU per request "
          f"(http.client, in L5): {client_cpu_ms:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "n": args.n, "p50_ms": rows, "client_cpu_ms": client_cpu_ms,
                                               "device": os.popen("nvidia-smi --query-gpu=name --format=csv,noheader")
                                               .read().strip()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
