"""A first throughput probe of ``kiln serve --device cuda`` (issue 17): a smoke measurement, no peer.

Traces tests/zoo.py's ResNet-50 (width 64, 224x224, 1000 classes: torchvision's layout, random weights),
times ``CudaProgram.run`` alone at batch 1 and at the largest bucket (the compute ceiling), then starts
``kiln serve MODEL --device cuda --max-batch-size 32`` and drives it from separate client processes
(each a few threads, one keep-alive ``http.client`` connection per client, binary tensor data in and out,
Triton's binary extension) at each client count: requests/s, p50/p99 latency, mean batch size (from
/metrics), CPU seconds per request of the client processes and of the server (HTTP process + workers).

    python bench/gpu_serve_smoke.py --clients 1,64 --seconds 10 --json out.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def request_body(x: np.ndarray) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + x.tobytes(), {"Content-Type": "application/octet-stream",
                                "Inference-Header-Content-Length": str(len(head))}


def client_main(url: str, threads: int, seconds: float, warm_s: float, shape: list, seed: int) -> None:
    """One client process: ``threads`` closed-loop clients; prints a JSON summary on stdout."""
    host, port = url.removeprefix("http://").split(":")
    rng = np.random.default_rng(seed)
    bodies = [request_body(rng.standard_normal(shape).astype(np.float32)) for _ in range(8)]
    lat: list = []
    errors = [0]
    t0 = time.monotonic()
    start, end = t0 + warm_s, t0 + warm_s + seconds

    def loop(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        i = k
        while True:
            now = time.monotonic()
            if now >= end:
                break
            body, headers = bodies[i % len(bodies)]
            i += 1
            try:
                conn.request("POST", "/v2/models/m/infer", body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                ok = r.status == 200 and len(data) > 0
            except OSError:
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
            done = time.monotonic()
            if now >= start and done <= end:
                if ok:
                    lat.append(done - now)
                else:
                    errors[0] += 1
        conn.close()

    cpu0 = time.process_time()
    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"lat": lat, "errors": errors[0], "cpu_s": time.process_time() - cpu0}))


def _tree(pid: int) -> list:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out += _tree(int(k))
    return out


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the server process and its workers (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def batch_stats(url: str) -> tuple[float, float]:
    import httpx
    text = httpx.get(url + "/metrics").text
    s = sum(float(v) for v in re.findall(r'^kiln_batch_size_sum\{[^}]*\} (\S+)$', text, re.M))
    n = sum(float(v) for v in re.findall(r'^kiln_batch_size_count\{[^}]*\} (\S+)$', text, re.M))
    return s, n


def drive(url: str, server_pid: int, clients: int, seconds: float, shape: list) -> dict:
    procs_n = min(clients, 8)
    per = [clients // procs_n + (1 if i < clients % procs_n else 0) for i in range(procs_n)]
    warm_s = 2.0
    s0, n0 = batch_stats(url)
    cpu0 = server_cpu(server_pid)
    procs = [subprocess.Popen([sys.executable, __file__, "--client", url, str(t), str(seconds), str(warm_s),
                               json.dumps(shape), str(i)], stdout=subprocess.PIPE, text=True)
             for i, t in enumerate(per)]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    cpu1 = server_cpu(server_pid)
    s1, n1 = batch_stats(url)
    lat = np.array(sorted(x for o in outs for x in o["lat"]))
    n = len(lat)
    return {"clients": clients, "client_processes": procs_n, "requests": n,
            "errors": sum(o["errors"] for o in outs), "req_per_s": n / seconds,
            "p50_ms": float(np.percentile(lat, 50) * 1e3) if n else None,
            "p99_ms": float(np.percentile(lat, 99) * 1e3) if n else None,
            "mean_batch": (s1 - s0) / (n1 - n0) if n1 > n0 else None,
            "client_cpu_s": sum(o["cpu_s"] for o in outs),
            "client_cpu_us_per_req": sum(o["cpu_s"] for o in outs) / max(1, n) * 1e6,
            "server_cpu_us_per_req": (cpu1 - cpu0) / max(1, n) * 1e6, "seconds": seconds}


def compute_ceiling(path: Path, shape: list, buckets: list) -> dict:
    import cupy as cp

    import kiln
    prog = kiln.load(path, device="cuda", output="numpy")
    out = {}
    for b in buckets:
        x = np.random.default_rng(0).standard_normal([b] + shape[1:]).astype(np.float32)
        for _ in range(3):
            prog.run({"x": x})
        cp.cuda.runtime.deviceSynchronize()
        n = 20
        t = time.perf_counter()
        for _ in range(n):
            prog.run({"x": x})
        dt = (time.perf_counter() - t) / n
        out[b] = {"ms_per_run": dt * 1e3, "rows_per_s": b / dt}
    del prog
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        url, threads, seconds, warm_s, shape, seed = sys.argv[2:]
        client_main(url, int(threads), float(seconds), float(warm_s), json.loads(shape), int(seed))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50", choices=("resnet50", "resnet18"))
    ap.add_argument("--clients", default="1,64")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to check this script")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--workdir", default="/tmp/gpu_serve_smoke")
    args = ap.parse_args()
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    import zoo

    import kiln
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    factory = zoo.resnet50 if args.model == "resnet50" else zoo.resnet18
    model, inputs, spec = factory(batch=1, width=args.width, image=args.image, num_classes=1000)
    t = time.perf_counter()
    with torch.inference_mode():
        path = kiln.save(kiln.trace(model, inputs, dynamic=spec), work / f"{args.model}.kiln")
    shape = [1, 3, args.image, args.image]
    report = {"model": f"zoo {args.model} (width {args.width}, 3x{args.image}x{args.image} fp32, random weights)",
              "trace_s": time.perf_counter() - t}
    dev = "" if args.device == "cpu" else subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    report["device"] = dev if args.device != "cpu" else "cpu"
    if args.device != "cpu":
        report["ceiling"] = compute_ceiling(path, shape, [1, args.max_batch_size])
    print(json.dumps(report, indent=1), flush=True)
    t = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(path), "--name", "m", "--device", args.device,
                               "--max-batch-size", str(args.max_batch_size), "--port", "0", "--max-queue-delay-ms", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    lines = []
    for line in server.stdout:
        lines.append(line)
        m = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        print("".join(lines))
        return 1
    threading.Thread(target=lambda: [lines.append(x) for x in server.stdout], daemon=True).start()
    report["ready_s"] = time.perf_counter() - t
    report["runs"] = []
    try:
        for c in [int(x) for x in args.clients.split(",")]:
            r = drive(url, server.pid, c, args.seconds, shape)
            print(json.dumps(r), flush=True)
            report["runs"].append(r)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    report["server_output"] = "".join(lines)[-3000:]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(report["server_output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
