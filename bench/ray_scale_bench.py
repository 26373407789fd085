"""kiln on Ray Serve where the cores allow (issue 19): CPU replicas 1, 2, 4 on a 16-core machine, GPU
replicas (``num_gpus``), answers checked, against kiln serve itself without Ray, and a ResNet-50 replica's
cold start on the CPU and on the GPU.

    python bench/ray_scale_bench.py --work /tmp/rs --json out.json [--gpu] [--cpu-replicas 1,2,4]

- *Throughput rows*: closed-loop clients in ``--client-procs`` processes (``--threads`` each, keep-alive
  ``http.client`` connections, the V2 binary tensor extension: a JSON header and the raw float32 bytes, as
  tritonclient sends them) against Ray's HTTP proxy, ``--seconds`` per row after a warm-up. Each answer's
  status and output size are checked. CPU rows serve a compute-bound model (``zoo.resnet50`` at 64x64,
  ~0.33 GFLOP a request) with ``--replica-cpus`` CPUs a replica (Ray sets OMP_NUM_THREADS to it, which the
  BLAS follows), so replicas, not the proxy or the clients, are the bottleneck; linear scaling is the
  ideal. GPU rows serve ResNet-50 (224x224) on ``device: cuda`` replicas; the baseline is ``kiln serve
  --device cuda`` on the same GPU without Ray (the proxy's cost).
- *Answers*: ``--check`` distinct requests per deployment, each compared to ``Program.run`` on the CPU of
  the request alone (exactly equal for CPU replicas up to batch reassociation: 1e-4 of the output's scale;
  GPU: 1e-2 of it, TF32/cuDNN algorithms).
- *Cold start*: ``serve.run`` of a one-replica application of a 102 MB ResNet-50 file until it answers
  ready, and kiln's own part (``kiln.load``: the file is mapped).
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(work: Path, name: str, image: int, width: int, classes: int) -> Path:
    """A zoo ResNet-50 traced with a dynamic batch and saved as ``work/name.kiln`` (random weights, seeded)."""
    path = work / f"{name}.kiln"
    if path.exists():
        return path
    import torch

    import kiln
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo
    model, (x,), dynamic = zoo.resnet50(batch=1, width=width, image=image, num_classes=classes)
    with torch.inference_mode():
        g = kiln.trace(model.eval(), {"x": x}, dynamic=dynamic)
    kiln.save(g, path)
    return path


def request_body(x: np.ndarray, out_name: str) -> tuple[bytes, dict]:
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": out_name, "parameters": {"binary_data": True}}]}).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                  "Content-Type": "application/octet-stream"}


def parse_answer(resp: http.client.HTTPResponse, body: bytes) -> np.ndarray:
    n = int(resp.getheader("Inference-Header-Content-Length"))
    head = json.loads(body[:n])
    out = head["outputs"][0]
    return np.frombuffer(body[n:], np.float32).reshape(out["shape"])


def client_proc(spec: dict, queue) -> None:
    """``threads`` closed-loop clients, each its own connection and input; puts (count, errors, latencies)."""
    lat, errors = [], []
    start = time.monotonic() + spec["warm_s"]
    end = start + spec["seconds"]

    def loop(k: int) -> None:
        rng = np.random.default_rng(spec["seed"] * 1000 + k)
        x = rng.standard_normal([1, *spec["row"]]).astype(np.float32)
        body, headers = request_body(x, spec["out"])
        conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=120)
        while True:
            t = time.monotonic()
            if t >= end:
                break
            try:
                conn.request("POST", f"/v2/models/{spec['model']}/infer", body, headers)
                r = conn.getresponse()
                data = r.read()
                ok = r.status == 200 and parse_answer(r, data).size == spec["out_size"]
            except Exception as e:  # noqa: BLE001 - counted, connection renewed
                ok, data = False, repr(e).encode()
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=120)
            if t >= start:
                if ok:
                    lat.append(time.monotonic() - t)
                else:
                    errors.append(data[:200].decode("utf-8", "replace"))
        conn.close()

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(spec["threads"])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    queue.put((len(lat), errors[:5], len(errors), lat))


def drive(port: int, model: str, row, out: str, out_size: int, procs: int, threads: int, seconds: float,
          warm_s: float = 2.0) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=client_proc, args=({"port": port, "model": model, "row": list(row), "out": out,
                                                 "out_size": out_size, "threads": threads, "seconds": seconds,
                                                 "warm_s": warm_s, "seed": i}, q)) for i in range(procs)]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + warm_s + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = np.array([v for r in results for v in r[3]])
    n_err = sum(r[2] for r in results)
    return {"requests": int(lat.size), "req_per_s": lat.size / seconds, "errors": n_err,
            "error_samples": [e for r in results for e in r[1]][:3],
            "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
            "clients": procs * threads}


def check_answers(port: int, model: str, path: Path, row, out: str, n: int, tol: float) -> dict:
    """``n`` distinct requests (16 at a time), each compared with Program.run on the CPU of it alone."""
    import kiln
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(12345)
    xs = [rng.standard_normal([1, *row]).astype(np.float32) for _ in range(n)]
    local = threading.local()

    def ask(x):
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body, headers = request_body(x, out)
        local.conn.request("POST", f"/v2/models/{model}/infer", body, headers)
        r = local.conn.getresponse()
        data = r.read()
        return parse_answer(r, data) if r.status == 200 else data[:200].decode("utf-8", "replace")

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, xs))
    prog = kiln.load(path)
    out_name = prog.outputs[0].name
    worst, wrong, failed = 0.0, 0, [g for g in got if isinstance(g, str)]
    for x, y in zip(xs, got):
        if isinstance(y, str):
            continue
        ref = prog.run({"x": x})[out_name]
        err = float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-12))
        worst = max(worst, err)
        wrong += err > tol
    return {"requests": n, "failed": len(failed), "failed_samples": failed[:3], "wrong": int(wrong),
            "max_rel_err": worst, "tol": tol}


def wait_ready(port: int, model: str, timeout: float = 300) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", f"/v2/models/{model}/ready")
            if c.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/ray_scale")
    ap.add_argument("--cpu-replicas", default="1,2,4")
    ap.add_argument("--replica-cpus", type=float, default=2.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8, help="client threads per client process")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--check", type=int, default=300, help="distinct requests checked per deployment")
    ap.add_argument("--gpu", action="store_true", help="also GPU replicas and the kiln serve --device cuda baseline")
    ap.add_argument("--proxy", choices=("ray", "haproxy"), default="ray",
                    help="Ray Serve's ingress: its Python HTTP proxy (default) or HAProxy "
                         "(RAY_SERVE_ENABLE_HA_PROXY=1)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-start rows")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.proxy == "haproxy":  # read by Ray's processes at import: set before ray.init starts them
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    small = export(work, "resnet50_64", image=64, width=64, classes=1000)
    big = export(work, "resnet50_224", image=224, width=64, classes=1000)
    import ray
    from ray import serve

    import kiln
    from kiln.server.ray_serve import deployment
    info: dict = {"cpus": os.cpu_count(), "proxy": args.proxy, "ray": ray.__version__, "python": sys.version.split()[0],
                  "numpy": np.__version__, "rows": [], "checks": [], "cold_start": []}
    gpus = 1 if args.gpu else 0
    ray.init(num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", object_store_memory=2 * 2 ** 30)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    batching = {"max_batch_size": 8, "max_queue_delay_ms": 1}

    def row(label, model_path, n, procs, threads, **dep):
        t = time.perf_counter()
        serve.run(deployment(str(model_path), name="m", replicas=n, **dep), name="bench", route_prefix="/")
        ready = time.perf_counter() - t
        prog_rows = (3, 64, 64) if model_path == small else (3, 224, 224)
        r = {"label": label, "replicas": n, "deploy_s": ready,
             **drive(port, "m", prog_rows, OUT[model_path], 1000, procs, threads, args.seconds)}
        tol = 1e-4 if dep.get("num_gpus", 0) == 0 else 1e-2
        checks = args.check if model_path == small else min(args.check, 128)  # a CPU ResNet-50 224 reference each
        c = check_answers(port, "m", model_path, prog_rows, OUT[model_path], checks, tol)
        r["check"] = c
        info["rows"].append(r)
        print(json.dumps(r), flush=True)
        serve.delete("bench")
        return r

    OUT = {p: kiln.load(p).outputs[0].name for p in (small, big)}
    cpu_over = {"workers": 0, **batching}
    for n in [int(v) for v in args.cpu_replicas.split(",") if v]:
        row("cpu", small, n, args.client_procs, args.threads, num_cpus=args.replica_cpus, overrides=cpu_over)

    # Cold start of a ResNet-50 replica (102 MB file): CPU, then GPU.
    for dev in ([] if args.no_cold else ["cpu", "cuda"] if args.gpu else ["cpu"]):
        t = time.perf_counter()
        over = {"workers": 0, **batching} if dev == "cpu" else {"device": "cuda", **batching}
        serve.run(deployment(str(big), name="r", replicas=1, num_cpus=1, num_gpus=1 if dev == "cuda" else 0,
                             overrides=over), name="cold", route_prefix="/")
        took = time.perf_counter() - t
        assert wait_ready(port, "r", 5)
        t = time.perf_counter()
        kiln.load(big)
        info["cold_start"].append({"device": dev, "serve_run_s": took, "kiln_load_s": time.perf_counter() - t,
                                   "file_mb": big.stat().st_size / 1e6, "warm_up_buckets": dev == "cuda"})
        print(json.dumps(info["cold_start"][-1]), flush=True)
        serve.delete("cold")

    if args.gpu:
        gpu_over = {"device": "cuda", "max_batch_size": 32, "max_queue_delay_ms": 1}
        row("gpu", big, 1, args.client_procs, args.threads, num_cpus=2, num_gpus=1, overrides=gpu_over)
        row("gpu (2 replicas, 0.5 GPU each)", big, 2, args.client_procs, args.threads, num_cpus=2, num_gpus=0.5,
            overrides=gpu_over)
    serve.shutdown()
    ray.shutdown()

    if args.gpu:  # the baseline: kiln serve --device cuda on the same GPU, no Ray
        repo = work / "repo"
        (repo / "m" / "1").mkdir(parents=True, exist_ok=True)
        target = repo / "m" / "1" / "model.kiln"
        if not target.exists():
            os.symlink(big, target)
        (repo / "m" / "config.json").write_text(json.dumps(gpu_over_json := {
            "device": "cuda", "max_batch_size": 32, "max_queue_delay_ms": 1}))
        dport = free_port()
        log = open(work / "direct.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(repo), "--port", str(dport)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not wait_ready(dport, "m", 300):
                raise SystemExit("kiln serve did not become ready: " + (work / "direct.log").read_text()[-2000:])
            r = {"label": "gpu, kiln serve without Ray", "replicas": 1, "config": gpu_over_json,
                 **drive(dport, "m", (3, 224, 224), OUT[big], 1000, args.client_procs, args.threads, args.seconds)}
            r["check"] = check_answers(dport, "m", big, (3, 224, 224), OUT[big], min(args.check, 128), 1e-2)
            info["rows"].append(r)
            print(json.dumps(r), flush=True)
        finally:
            import signal
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)

    print(f"\nRay Serve {info['ray']} ({args.proxy} proxy) on {info['cpus']} cores; {args.client_procs}x{args.threads} "
          "clients")
    print("| rows | replicas | requests/s | of linear | p50 ms | p99 ms | errors | checked (wrong, max err) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    one = {}  # requests/s of the first row of a kind: "of linear" = requests/s / (replicas x that)
    for r in info["rows"]:
        key = r["label"].split(" ")[0].rstrip(",")
        one.setdefault(key, r["req_per_s"])
        c = r["check"]
        linear = r["req_per_s"] / (one[key] * r["replicas"])
        print(f"| {r['label']} | {r['replicas']} | {r['req_per_s']:.0f} | {linear:.2f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} | {c['requests'] - c['failed']} ({c['wrong']}, "
              f"{c['max_rel_err']:.1e}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
