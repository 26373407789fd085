"""kiln on Ray Serve (issue 19): requests/s against 1, 2 (and 4) replicas on this machine with the CPU
runtime, and the cold start of a replica with a ResNet-50 file (from ``serve.run``'s call to the replica
answering: Ray's actor start, kiln's load, which maps the file, and warm-up).

    python bench/ray_serve_bench.py --model mlp.kiln --resnet resnet50.kiln --replicas 1,2 --seconds 10

Closed-loop clients (threads of this process, keep-alive httpx clients) against Ray's HTTP proxy; each answer's
status is checked. Prints a table; ``--json`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_clients(url: str, model: str, x: np.ndarray, clients: int, seconds: float) -> dict:
    import httpx
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    lat, errors = [], [0]
    end = time.monotonic() + seconds

    def loop():
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < end:
                t = time.perf_counter()
                r = c.post(f"{url}/v2/models/{model}/infer", json=body)
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t)
                else:
                    errors[0] += 1
    ts = [threading.Thread(target=loop) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    a = np.array(lat)
    return {"requests": len(a), "errors": errors[0], "req_per_s": len(a) / seconds,
            "p50_ms": float(np.percentile(a, 50) * 1e3) if len(a) else None}


def serve_batch_deployment(path: str, replicas: int, max_batch: int, wait_s: float):
    """The alternative the issue asks to measure: no kiln server inside the replica, Ray Serve's own
    ``@serve.batch`` collecting requests into a batch for ``Program.run``, answering the same V2 JSON route."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    # As kiln's deployment: 128 requests a replica at a time (Ray's default 5 starves a batcher: ray_serve.py).
    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=128)
    class ServeBatch:
        def __init__(self, model_path: str):
            import kiln
            self.program = kiln.load(model_path)
            self.output = self.program.outputs[0].name

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait_s)
        async def infer(self, xs: list) -> list:
            batch = np.concatenate(xs, axis=0)
            y = self.program.run({"x": batch})[self.output]
            out, k = [], 0
            for x in xs:
                out.append(y[k:k + x.shape[0]])
                k += x.shape[0]
            return out

        async def __call__(self, request: Request):
            body = await request.json()
            t = body["inputs"][0]
            x = np.asarray(t["data"], np.float32).reshape(t["shape"])
            y = await self.infer(x)
            return JSONResponse({"model_name": "m", "outputs": [
                {"name": self.output, "shape": list(y.shape), "datatype": "FP32", "data": y.ravel().tolist()}]})

    return ServeBatch.bind(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a small .kiln file for the throughput rows (input 'x')")
    ap.add_argument("--resnet", help="a ResNet-50 .kiln file for the cold-start row")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--serve-batch", action="store_true",
                    help="also Ray Serve's @serve.batch around Program.run (no kiln server in the replica), same replicas")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    import kiln
    from kiln.server.ray_serve import deployment
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    prog = kiln.load(args.model)
    shape = [1 if not isinstance(d, int) else d for d in prog.inputs[0].shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    rows = []
    for n in [int(r) for r in args.replicas.split(",")]:
        t = time.perf_counter()
        serve.run(deployment(args.model, name="m", replicas=n, num_cpus=0.5, overrides={"workers": 0}),
                  name="bench", route_prefix="/")
        ready = time.perf_counter() - t
        load_clients(url, "m", x, args.clients, 2.0)  # warm
        row = {"replicas": n, "batching": "kiln", "deploy_s": ready,
               **load_clients(url, "m", x, args.clients, args.seconds)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        serve.delete("bench")
        if args.serve_batch:  # the same replicas, Ray Serve's batching instead of kiln's server and batcher
            t = time.perf_counter()
            serve.run(serve_batch_deployment(args.model, n, 32, 0.002), name="bench",
                      route_prefix="/v2/models/m/infer")
            ready = time.perf_counter() - t
            load_clients(url, "m", x, args.clients, 2.0)
            row = {"replicas": n, "batching": "@serve.batch", "deploy_s": ready,
                   **load_clients(url, "m", x, args.clients, args.seconds)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            serve.delete("bench")
    cold = None
    if args.resnet:
        t = time.perf_counter()
        serve.run(deployment(args.resnet, name="resnet", replicas=1, num_cpus=0.5, overrides={"workers": 0}),
                  name="cold", route_prefix="/")
        cold = {"serve_run_s": time.perf_counter() - t}  # the new replica placed, started, loaded, ready
        import httpx
        assert httpx.get(url + "/v2/models/resnet/ready").status_code == 200
        t = time.perf_counter()
        kiln.load(args.resnet)  # kiln's own part of it: the load (the file mapped, not read)
        cold["kiln_load_s"] = time.perf_counter() - t
        # A second replica added to the running application: the time until Serve reports 2 running.
        t = time.perf_counter()
        serve.run(deployment(args.resnet, name="resnet", replicas=2, num_cpus=0.5, overrides={"workers": 0}),
                  name="cold", route_prefix="/")
        cold["scale_to_2_s"] = time.perf_counter() - t
        cold["file_mb"] = Path(args.resnet).stat().st_size / 1e6
        print(json.dumps({"cold_start": cold}), flush=True)
        serve.delete("cold")
    print(f"\nRay Serve on {os.cpu_count()} cores, {args.clients} clients, CPU runtime (workers 0, 0.5 CPU a replica)")
    print("| replicas | batching | requests/s | p50 ms | errors | deploy s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['replicas']} | {r['batching']} | {r['req_per_s']:.0f} | {r['p50_ms']:.2f} | {r['errors']} | "
              f"{r['deploy_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cold_start": cold, "cpus": os.cpu_count()}, indent=1))
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
