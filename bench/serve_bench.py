"""Server benchmark (issue 7): `kiln serve` against a hand-written FastAPI + onnxruntime endpoint,
measured from outside, against real server processes on 127.0.0.1.

Why from outside: what a user of a server sees is the latency and throughput of HTTP requests,
the memory of the whole process tree and what happens to requests at shutdown; none of it shows
in-process. Every server here is a separate process started from its command line.

1. Load. The MLP and the 2-layer BERT of the runtime benchmark (bench/runtime_models.py, exported
   by bench/runtime_bench.py's ``export_model``: ``kiln.trace(dynamic_batch=True)`` + ``kiln.save``
   and ``torch.onnx.export(dynamo=False)`` with a dynamic batch axis) are served three ways, each
   in its own process, all three started before the cells so the cells can interleave (1 client:
   kiln on, kiln off, peer; then 8 clients; ...): ``kiln serve`` with dynamic batching
   (``--max-batch-size``, ``--max-queue-delay-ms``), ``kiln serve --max-batch-size 0`` (request by
   request), and bench/serve_peer.py (one ``InferenceSession``, pydantic V2-style JSON in and out,
   uvicorn with 1 worker). The load generator runs N client tasks in closed loop, each with its own
   ``httpx.AsyncClient`` (one HTTP/1.1 keep-alive connection), each sending V2 JSON requests
   with batch-1 inputs drawn from a pool of distinct random inputs; every response must be a 200
   whose first output has the right shape and whose first values match ``Program.run`` on that
   input (so mix-ups across a batch would show). A cell is bounded in requests and in seconds.
   After each kiln cell the server's /metrics gives the mean batch size and the mean compute time
   per batch over that cell (histogram sums and counts, before and after).
2. Overhead. A blocking raw-socket HTTP/1.1 client (so no client library cost is in it) sends the
   same small MLP request sequentially; server overhead = that p50 minus the median of
   ``Program.run`` on the same input in this process.
3. Memory. A >= 400 MB fp32 MLP (7 Gemm 4096x4096 + Relu, random weights, built with kiln's graph
   API) is served with 1 and with 4 worker processes; after requests have reached every worker
   (each worker's resident set holds the weights), RSS and PSS are summed over the server process
   and all its descendants from /proc/<pid>/smaps_rollup.
4. Shutdown. N requests are sent on N connections to a server busy with the big model; once all are
   written, SIGTERM; count the responses that arrive and the server's exit status.

Runs on a shared 2-core machine, so the load generator competes with the servers for the CPU:
the figures are what this machine gives with client and server on it, and the load average is
recorded. The whole run takes about 5 minutes.

Run: .venv/bin/python bench/serve_bench.py [--models mlp,bert2] [--clients 1,8,64] [--scale 1.0]
     [--time-cap 10] [--max-batch-size 32] [--max-queue-delay-ms 0.5] [--servers on,off,peer]
     [--shutdown-requests 32] [--blas-threads N] [--kiln "CMD"] [--no-memory] [--no-shutdown]
     [--results FILE|-] [--grpc [--grpc-requests N]]
--grpc measures only the gRPC rows (issue 25) and prints them: tritonclient.grpc against tritonclient.http
(binary tensors) on one kiln serve, MLP: single-request overhead over Program.run and closed-loop
throughput at --clients (sync clients, one per thread).
Servers get this environment minus the BLAS thread variables (unless --blas-threads), so they pick
the thread counts a user's server would.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import fastapi
import httpx
import numpy as np
import onnxruntime as ort
import uvicorn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from results_md import RESULTS, cpu_name, replace_section, utc_now  # noqa: E402
from runtime_bench import export_model  # noqa: E402  (imports torch; the servers never do)
from runtime_models import MODELS  # noqa: E402

import kiln  # noqa: E402

SECTION = "## Server (issue 7)"
HOST = "127.0.0.1"
# Requests per cell at each client count, for the default --scale 1; a cell also stops at --time-cap.
REQUESTS = {"mlp": {1: 400, 8: 1000, 64: 2000}, "bert2": {1: 100, 8: 300, 64: 600}}
POOL = 32            # distinct random inputs per model, pre-encoded
CHECK_VALUES = 64    # leading output values compared with Program.run in every response
PAUSE = 0.25         # seconds between cells: idle thread pools (onnxruntime spins) settle
BIG_LAYERS, BIG_WIDTH = 7, 4096  # the memory model: 7 x 64 MiB of weights


# ---------------------------------------------------------------------------- server processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


KILN_COMMAND: list[str] = []  # --kiln
BLAS_THREADS: list[int] = []  # --blas-threads
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def server_env() -> dict[str, str]:
    """The servers' environment: this one without the BLAS thread count that runtime_bench sets on
    import (so a server picks what it would for a user), or with --blas-threads."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if BLAS_THREADS:
        env.update({k: str(BLAS_THREADS[0]) for k in THREAD_VARS})
    return env


def kiln_command() -> list[str]:
    if KILN_COMMAND:
        return list(KILN_COMMAND)
    script = Path(sys.executable).with_name("kiln")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kiln"]


@dataclass
class Server:
    """A server process on a free port, its output in a log file."""

    label: str
    argv: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv + ["--host", HOST, "--port", str(self.port)], env=server_env(),
                                         stdout=out, stderr=subprocess.STDOUT, cwd=BENCH.parent)
        return self

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url("/v2/health/ready"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.label} not ready after {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def kiln_server(label: str, model: Path, log: Path, *flags: str) -> Server:
    return Server(label, kiln_command() + ["serve", str(model), *flags], log)


def peer_server(label: str, model: Path, name: str, log: Path) -> Server:
    return Server(label, [sys.executable, str(BENCH / "serve_peer.py"), str(model), "--name", name], log)


# ---------------------------------------------------------------------------- requests
def v2_body(name: str, x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


@dataclass
class Workload:
    """Pre-encoded request bodies (one pool per input name) and Program.run's outputs for them."""

    model: str
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    bodies: dict[str, list[bytes]] = field(default_factory=dict)

    def body(self, input_name: str, i: int) -> bytes:
        if input_name not in self.bodies:
            self.bodies[input_name] = [v2_body(input_name, x) for x in self.inputs]
        return self.bodies[input_name][i % len(self.inputs)]

    def check(self, status: int, content: bytes, i: int) -> str | None:
        """None when the response is right for input ``i``, else what is wrong with it."""
        if status != 200:
            return f"HTTP {status}: {content[:200]!r}"
        try:
            out = json.loads(content)["outputs"][0]
            want = self.expected[i % len(self.expected)]
            if list(out["shape"]) != list(want.shape):
                return f"shape {out['shape']} != {list(want.shape)}"
            data = out["data"]
            flat = np.asarray(data, dtype=np.float64).ravel() if data and isinstance(data[0], list) else data
            if len(flat) != want.size:
                return f"{len(flat)} values for shape {list(want.shape)}"
            got = np.asarray(flat[:CHECK_VALUES], dtype=np.float64)
            if not np.allclose(got, want.ravel()[:CHECK_VALUES], rtol=1e-3, atol=1e-4):
                return "values differ from Program.run on this request's input"
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return f"malformed response ({type(e).__name__}: {e}): {content[:200]!r}"
        return None


def make_workload(key: str, program: kiln.Program, pool: int = POOL) -> Workload:
    rng = np.random.default_rng(7)
    shape = MODELS[key].example(1).shape
    inputs = [rng.standard_normal(tuple(shape), dtype=np.float32) for _ in range(pool)]
    expected = [program.run([x], as_list=True)[0] for x in inputs]
    return Workload(key, inputs, expected)


# ---------------------------------------------------------------------------- load generator
async def load_cell(url: str, input_name: str, work: Workload, clients: int, count: int,
                    time_cap: float, server_pid: int | None = None) -> dict:
    """``clients`` closed-loop tasks, each with its own httpx.AsyncClient holding one keep-alive
    connection, send up to ``count`` requests, stopping at ``time_cap`` seconds; one untimed request
    per client first opens the connections. Returns throughput, latencies, the first error seen and
    CPU seconds per request over the timed part: the server process, its descendants (worker
    processes), and this process (the load generator).
    (One AsyncClient shared by 64 tasks made the generator the bottleneck: its pool managed about
    170 requests/s on /v2/health/live against over 1,000 with a client per task.)"""
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    pool = [httpx.AsyncClient(limits=limits, timeout=60.0, http1=True, http2=False) for _ in range(clients)]
    try:
        async def send(client: httpx.AsyncClient, i: int) -> float:
            t = time.perf_counter()
            try:
                r = await client.post(url, content=work.body(input_name, i), headers=headers)
                problem = work.check(r.status_code, r.content, i)
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t
            if problem:
                errors.append(problem)
            return dt

        await asyncio.gather(*(send(c, i) for i, c in enumerate(pool)))  # warm-up: opens the connections
        errors.clear()
        nxt = 0
        cpu0 = cpu_split(server_pid)
        start = time.perf_counter()
        deadline = start + time_cap

        async def client_task(client: httpx.AsyncClient) -> None:
            nonlocal nxt
            while nxt < count and time.perf_counter() < deadline:
                i, nxt = nxt, nxt + 1
                latencies.append(await send(client, i))

        await asyncio.gather(*(client_task(c) for c in pool))
        wall = time.perf_counter() - start
        cpu = {k: (v - cpu0[k]) / max(len(latencies), 1) for k, v in cpu_split(server_pid).items()}
    finally:
        await asyncio.gather(*(c.aclose() for c in pool))
    lat = np.array(latencies) * 1e3
    return {"clients": clients, "n": len(latencies), "capped": len(latencies) < count, "wall": wall,
            "rps": len(latencies) / wall, "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
            "errors": len(errors), "first_error": errors[0] if errors else None, "cpu": cpu}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of the server process, of its descendants alive now, and of this process."""
    out = {"client": time.process_time()}
    if server_pid is not None:
        out["server"] = cpu_seconds(server_pid)
        total = 0.0
        for p in descendants(server_pid)[1:]:
            try:
                total += cpu_seconds(p)
            except OSError:
                continue
        out["workers"] = total
    return out


# ---------------------------------------------------------------------------- raw HTTP (overhead)
def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """One HTTP/1.1 response from ``sock`` (Content-Length or chunked); ``buf`` keeps extra bytes."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before the response headers")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    buf[:] = rest
    if "content-length" in hdrs:
        n = int(hdrs["content-length"])
        while len(buf) < n:
            buf += sock.recv(65536)
        body = bytes(buf[:n])
        del buf[:n]
        return status, body
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            while b"\r\n" not in buf:
                buf += sock.recv(65536)
            size_line, _, _ = bytes(buf).partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            need = len(size_line) + 2 + size + 2
            while len(buf) < need:
                buf += sock.recv(65536)
            body += buf[len(size_line) + 2:len(size_line) + 2 + size]
            del buf[:need]
            if size == 0:
                return status, bytes(body)
    raise ValueError(f"response without Content-Length or chunked encoding: {hdrs}")


def raw_latencies(port: int, method: str, path: str, body: bytes, n: int, check=None,
                  time_cap: float = 10.0) -> list[float]:
    """Seconds per request of ``n`` sequential requests on one keep-alive connection (after 20
    untimed ones; fewer once ``time_cap`` seconds have passed), with no client library in the way."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            + (f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if method == "POST" else "")
            + "\r\n").encode()
    request = head + body
    times = []
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        deadline = time.perf_counter() + time_cap
        for k in range(n + 20):
            if k > 25 and time.perf_counter() > deadline:
                break
            t = time.perf_counter()
            sock.sendall(request)
            status, content = _read_response(sock, buf)
            dt = time.perf_counter() - t
            problem = check(status, content) if check else (None if status == 200 else f"HTTP {status}")
            if problem:
                raise RuntimeError(f"{path}: {problem}")
            if k >= 20:
                times.append(dt)
    return times


def median_run(fn, n: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------------------- /metrics
def scrape(server: Server) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(metric name, label text): value}."""
    out = {}
    for line in httpx.get(server.url("/metrics"), timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            out[(name, labels.rstrip("}"))] = float(value)
        except ValueError:
            continue
    return out


def histogram_mean(before: dict, after: dict, name: str, model: str) -> tuple[float, float] | None:
    """(mean, count) over the cell of histogram ``name`` (server/metrics.py's names) for ``model``:
    (sum after - sum before) / (count after - count before), over all its label sets."""
    def total(snap: dict, suffix: str) -> tuple[float, set]:
        keys = {(n, lab) for (n, lab) in snap if n == name + suffix and f'model="{model}"' in lab}
        return sum(snap[k] for k in keys), keys
    s1, keys = total(after, "_sum")
    if not keys:
        return None
    c1, _ = total(after, "_count")
    s0, _ = total(before, "_sum")
    c0, _ = total(before, "_count")
    return ((s1 - s0) / (c1 - c0), c1 - c0) if c1 > c0 else None


def histogram_quantile(before: dict, after: dict, name: str, model: str, q: float) -> float | None:
    """Upper bound of the bucket holding quantile ``q`` of histogram ``name`` over the cell (bucket
    counts after - before, summed over the other labels): as coarse as the server's buckets."""
    per_le: dict[float, float] = {}
    for snap, sign in ((after, 1), (before, -1)):
        for (n, lab), v in snap.items():
            if n == name + "_bucket" and f'model="{model}"' in lab:
                le = lab.split('le="', 1)[1].split('"', 1)[0]
                bound = math.inf if le == "+Inf" else float(le)
                per_le[bound] = per_le.get(bound, 0.0) + sign * v
    if not per_le or max(per_le.values()) <= 0:
        return None
    total = per_le[max(per_le)]
    return next(le for le in sorted(per_le) if per_le[le] >= q * total)


# ---------------------------------------------------------------------------- 1+2: load and overhead
def bench_model(key: str, args: argparse.Namespace, folder: Path) -> tuple[list[dict], dict | None, list[str]]:
    _, kiln_path, onnx_path = export_model(key, folder)
    program = kiln.load(kiln_path)
    in_name = program.inputs[0].name
    work = make_workload(key, program)
    batching = ["--max-batch-size", str(args.max_batch_size), "--max-queue-delay-ms", f"{args.max_queue_delay_ms:g}"]
    servers = [s for tag, s in (
        ("on", kiln_server("kiln serve, batching on", kiln_path, folder / f"{key}-on.log", *batching)),
        ("off", kiln_server("kiln serve, batching off", kiln_path, folder / f"{key}-off.log", "--max-batch-size", "0")),
        ("peer", peer_server("FastAPI + onnxruntime", onnx_path, key, folder / f"{key}-peer.log")))
        if tag in args.servers]
    names = {s.label: "x" if s.label.startswith("FastAPI") else in_name for s in servers}  # export_model: x
    rows, failed, overhead = [], [], None
    for s in servers:
        s.start()
    try:
        live = []
        for s in servers:
            try:
                s.wait_ready()
                asyncio.run(load_cell(s.url(f"/v2/models/{key}/infer"), names[s.label], work, 8, 64, 30.0))  # warm-up
                live.append(s)
            except Exception as e:  # noqa: BLE001 - report it and go on with the other servers
                failed.append(f"{MODELS[key].label}, {s.label}: {type(e).__name__}: {e}")
                print(f"FAILED {failed[-1]}", flush=True)
        for clients in args.clients:
            count = max(clients, round(REQUESTS[key].get(clients, REQUESTS[key][64]) * args.scale))
            for s in live:
                time.sleep(PAUSE)
                before = scrape(s) if s.label.startswith("kiln") else None
                row = asyncio.run(load_cell(s.url(f"/v2/models/{key}/infer"), names[s.label], work, clients, count,
                                            args.time_cap, s.proc.pid))
                row.update(model=MODELS[key].label, key=key, server=s.label)
                if before is not None:
                    after = scrape(s)
                    row["batch"] = histogram_mean(before, after, "kiln_batch_size", key)
                    row["compute"] = histogram_mean(before, after, "kiln_compute_duration_seconds", key)
                    row["server_p99"] = histogram_quantile(before, after, "kiln_request_duration_seconds", key, 0.99)
                rows.append(row)
                print(console_row(row), flush=True)
        if key == "mlp":
            overhead = measure_overhead(key, program, onnx_path, work, {s.label: s for s in live}, in_name)
    finally:
        for s in servers:
            s.stop()
    return rows, overhead, failed


def cpu_text(r: dict) -> str:
    c = r["cpu"]
    workers = f"{c['workers'] * 1e3:.2f}" if r["server"].startswith("kiln") else "-"
    return f"{c['server'] * 1e3:.2f} / {workers} / {c['client'] * 1e3:.2f}"


def console_row(r: dict) -> str:
    extra = f", server p99 <= {r['server_p99'] * 1e3:g} ms" if r.get("server_p99") is not None else ""
    if r.get("batch"):
        extra += f", mean batch {r['batch'][0]:.1f}"
    if r.get("compute"):
        extra += f", compute {r['compute'][0] * 1e3:.2f} ms/batch"
    err = f", {r['errors']} errors (first: {r['first_error']})" if r["errors"] else ""
    return (f"{r['key']} | {r['server']} | {r['clients']} clients: {r['n']} requests in {r['wall']:.1f} s"
            f"{' (time cap)' if r['capped'] else ''}, {r['rps']:.0f} req/s, p50 {r['p50']:.2f} ms, "
            f"p99 {r['p99']:.2f} ms{extra}, CPU ms/request (server / workers / client) {cpu_text(r)}{err}")


def measure_overhead(key: str, program: kiln.Program, onnx_path: Path, work: Workload, servers: dict,
                     in_name: str, n: int = 1000) -> dict:
    """p50 of a single small request over a raw socket, per server, against in-process run times
    (``Program.run``; for the peer, ``session.run`` with default options as it uses)."""
    x = work.inputs[0]
    result = {"n": n, "counts": {}, "run": median_run(lambda: program.run([x]), 2000)}
    if "FastAPI + onnxruntime" in servers:
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        result["ort_run"] = median_run(lambda: session.run(None, {"x": x}), 2000)
        del session
    for label, s in servers.items():
        name = "x" if label.startswith("FastAPI") else in_name
        body = work.body(name, 0)
        time.sleep(PAUSE)
        lat = raw_latencies(s.port, "POST", f"/v2/models/{key}/infer", body, n,
                            check=lambda st, c: work.check(st, c, 0))
        result[label] = statistics.median(lat)
        result["counts"][label] = len(lat)
        if label.startswith("kiln") and "live" not in result:
            result["live"] = statistics.median(raw_latencies(s.port, "GET", "/v2/health/live", b"", n))
    print("overhead: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in result.items() if isinstance(v, float)),
          flush=True)
    return result


# ---------------------------------------------------------------------------- 3: memory
def big_model(path: Path, x: np.ndarray) -> tuple[Path, int, np.ndarray]:
    """7 x (Gemm 4096x4096 + Relu) then Gemm 4096->16, fp32, random weights, dynamic batch: the
    file, its weight bytes and its output for ``x``, computed here with numpy so that this process
    never maps the file (its pages would count in the servers' PSS as shared with us)."""
    rng = np.random.default_rng(3)
    g = kiln.Graph("big_mlp")
    y = g.add_input("x", "float32", ("batch", BIG_WIDTH))
    nbytes, want = 0, x
    for i in range(BIG_LAYERS + 1):
        out = BIG_WIDTH if i < BIG_LAYERS else 16
        w = rng.standard_normal((out, BIG_WIDTH), dtype=np.float32)
        w *= np.float32(BIG_WIDTH ** -0.5)
        b = np.zeros(out, np.float32)
        nbytes += w.nbytes + b.nbytes
        y = g.op("Gemm", y, g.add_initializer(f"w{i}", w), g.add_initializer(f"b{i}", b), transB=1)
        want = want @ w.T + b
        if i < BIG_LAYERS:
            y = g.op("Relu", y)
            want = np.maximum(want, 0)
    g.outputs = [y]
    return Path(kiln.save(g, path)), nbytes, want


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def smaps(pid: int) -> dict[str, int]:
    """Bytes per field of /proc/<pid>/smaps_rollup (Rss, Pss, Pss_Anon, Pss_File, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def memory(path: Path, nbytes: int, workers: int, folder: Path, x: np.ndarray) -> tuple[dict, Server]:
    """Start the big model with ``workers`` worker processes, send requests until every worker has
    the weights resident (or 20 rounds pass), then sum smaps_rollup over the process tree. Returns
    the measurement and the server, still running."""
    s = kiln_server(f"kiln serve --workers {workers}", path, folder / f"big-{workers}.log",
                    "--workers", str(workers), "--max-batch-size", "0").start()
    s.wait_ready()
    body = v2_body("x", x)

    async def round_of(n: int) -> None:
        async with httpx.AsyncClient(timeout=120.0) as client:
            rs = await asyncio.gather(*(client.post(s.url("/v2/models/big/infer"), content=body,
                                                    headers={"content-type": "application/json"}) for _ in range(n)))
            bad = [r.status_code for r in rs if r.status_code != 200]
            if bad:
                raise RuntimeError(f"warm-up requests failed: {bad[:5]} {rs[0].text[:200]}")

    warm = 0
    for rounds in range(1, 21):
        asyncio.run(round_of(2 * workers))
        procs = [p for p in descendants(s.proc.pid) if p != s.proc.pid]
        warm = sum(1 for p in procs if smaps(p).get("Rss", 0) >= 0.8 * nbytes)
        if warm >= workers:
            break
    time.sleep(0.5)
    per = []
    for p in descendants(s.proc.pid):
        try:
            per.append({"pid": p, "cmd": cmdline(p), **smaps(p)})
        except OSError:
            continue
    result = {"workers": workers, "warm": warm, "rounds": rounds, "procs": per,
              **{k: sum(q.get(k, 0) for q in per) for k in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")}}
    print(f"memory, {workers} worker(s): {len(per)} processes, {warm} with the weights resident after {rounds} "
          f"round(s); RSS {result['Rss'] / 2**20:.0f} MiB, PSS {result['Pss'] / 2**20:.0f} MiB "
          f"(anon {result['Pss_Anon'] / 2**20:.0f}, file {result['Pss_File'] / 2**20:.0f})", flush=True)
    return result, s


# ---------------------------------------------------------------------------- 4: shutdown
async def _raw_request(port: int, request: bytes, sent: asyncio.Future) -> tuple[int | None, bytes, float]:
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(request)
        await writer.drain()
    except OSError as e:
        if not sent.done():
            sent.set_exception(e)
        return None, b"", time.perf_counter()
    sent.set_result(None)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(hdrs.get("content-length", 0)))
        return status, body, time.perf_counter()
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
        return None, b"", time.perf_counter()
    finally:
        writer.close()


async def shutdown(s: Server, n: int, body: bytes, check) -> dict:
    """``n`` requests on ``n`` connections; once all are written and 0.15 s have passed (the server
    has read them), SIGTERM.
    Counts the responses, checks a new connection is refused (or answered 503), and waits for the exit."""
    path = "/v2/models/big/infer"
    request = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{s.port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    sent = [loop.create_future() for _ in range(n)]
    tasks = [asyncio.create_task(_raw_request(s.port, request, f)) for f in sent]
    await asyncio.gather(*sent)
    await asyncio.sleep(0.15)
    done_before = sum(t.done() for t in tasks)
    t_term = time.perf_counter()
    s.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.05)
    late = "no answer"
    try:
        r = await asyncio.wait_for(asyncio.to_thread(httpx.post, s.url(path), content=body,
                                                     headers={"content-type": "application/json"}, timeout=10), 15)
        late = f"HTTP {r.status_code}"
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        late = type(e).__name__
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    ok = sum(1 for st, content, _ in results if st is not None and check(st, content) is None)
    statuses = sorted({str(st) for st, _, _ in results})
    last = max(t for _, _, t in results) - t_term
    rc = await asyncio.to_thread(s.proc.wait, 60)
    exit_s = time.perf_counter() - t_term
    out = {"server": s.label, "n": n, "done_before": done_before, "in_flight": n - done_before, "ok": ok,
           "statuses": statuses, "last": last, "rc": rc, "exit_s": exit_s, "late": late}
    print(f"shutdown ({s.label}): {n} sent, {done_before} answered before SIGTERM, {ok}/{n} right 200s "
          f"(statuses {statuses}), last response {last:.2f} s after SIGTERM, exit {rc} after {exit_s:.2f} s; "
          f"a new request after SIGTERM: {late}", flush=True)
    return out


def memory_and_shutdown(args: argparse.Namespace, folder: Path) -> tuple[list[dict], list[dict], dict, list[str]]:
    x = np.random.default_rng(5).standard_normal((1, BIG_WIDTH), dtype=np.float32)
    path, nbytes, want = big_model(folder / "big.kiln", x)
    info = {"bytes": path.stat().st_size, "weights": nbytes}
    work = Workload("big", [x], [want])
    mems, shuts, failed = [], [], []
    if not args.no_memory:
        for workers in (1, 4):
            try:
                m, s = memory(path, nbytes, workers, folder, x)
                mems.append(m)
                if workers == 1 and not args.no_shutdown:
                    shuts.append(asyncio.run(shutdown(s, args.shutdown_requests, v2_body("x", x),
                                                      lambda st, c: work.check(st, c, 0))))
                s.stop()
            except Exception as e:  # noqa: BLE001
                failed.append(f"memory with {workers} worker(s): {type(e).__name__}: {e}")
                print(f"FAILED {failed[-1]}", flush=True)
    if not args.no_shutdown:
        s = kiln_server("kiln serve --workers 2 --max-batch-size 4", path, folder / "big-shutdown.log",
                        "--workers", "2", "--max-batch-size", "4").start()
        try:
            s.wait_ready()
            shuts.append(asyncio.run(shutdown(s, args.shutdown_requests, v2_body("x", x),
                                              lambda st, c: work.check(st, c, 0))))
        except Exception as e:  # noqa: BLE001
            failed.append(f"shutdown ({s.label}): {type(e).__name__}: {e}")
            print(f"FAILED {failed[-1]}\n{s.tail()}", flush=True)
        finally:
            s.stop()
    return mems, shuts, info, failed


# ---------------------------------------------------------------------------- gRPC rows (issue 25)
def grpc_rows(args: argparse.Namespace, folder: Path) -> str:
    """gRPC against HTTP binary on one ``kiln serve`` (batching on, the default flags plus ``--grpc-port``),
    both through tritonclient (``tritonclient.grpc`` and ``tritonclient.http`` with binary inputs and
    outputs): single-request p50 over ``Program.run`` (sequential, one client, rounds interleaved), and
    closed-loop throughput at each client count, each client a thread with its own sync client (its own
    channel / connection), every response checked against ``Program.run``."""
    import threading

    import tritonclient.grpc as tg
    import tritonclient.http as th

    _, kiln_path, _ = export_model("mlp", folder)
    program = kiln.load(kiln_path)
    in_name = program.inputs[0].name
    work = make_workload("mlp", program)
    gport = free_port()
    s = kiln_server("kiln serve", kiln_path, folder / "grpc.log", "--max-batch-size", str(args.max_batch_size),
                    "--max-queue-delay-ms", f"{args.max_queue_delay_ms:g}", "--grpc-port", str(gport)).start()

    def caller(kind: str):
        if kind == "gRPC":
            c = tg.InferenceServerClient(f"{HOST}:{gport}")
            ins = [tg.InferInput(in_name, list(x.shape), "FP32") for x in work.inputs]
            for i, x in zip(ins, work.inputs):
                i.set_data_from_numpy(x)
            return c, lambda k: c.infer("mlp", [ins[k % len(ins)]]).as_numpy(program.outputs[0].name)
        c = th.InferenceServerClient(f"{HOST}:{s.port}")
        ins = [th.InferInput(in_name, list(x.shape), "FP32") for x in work.inputs]
        for i, x in zip(ins, work.inputs):
            i.set_data_from_numpy(x, binary_data=True)
        outs = [th.InferRequestedOutput(o.name, binary_data=True) for o in program.outputs]
        return c, lambda k: c.infer("mlp", [ins[k % len(ins)]], outputs=outs).as_numpy(program.outputs[0].name)

    def ok(k: int, got) -> bool:
        want = work.expected[k % len(work.expected)]
        return got.shape == want.shape and np.allclose(got, want, rtol=1e-3, atol=1e-4)

    lines = []
    try:
        s.wait_ready()
        run = median_run(lambda: program.run([work.inputs[0]]), 2000)
        p50: dict[str, list[float]] = {"gRPC": [], "HTTP binary": []}
        clients = {kind: caller(kind) for kind in p50}
        for _ in range(3):  # interleaved rounds
            for kind, (_, call) in clients.items():
                for k in range(50):
                    call(k)
                times = []
                for k in range(args.grpc_requests):
                    t = time.perf_counter()
                    got = call(0)
                    times.append(time.perf_counter() - t)
                    if k == 0 and not ok(0, got):
                        raise RuntimeError(f"{kind}: wrong answer")
                p50[kind].append(statistics.median(times))
        for c, _ in clients.values():
            c.close()
        med = {k: statistics.median(v) for k, v in p50.items()}
        lines.append(f"Single request, {MODELS['mlp'].label} batch 1 ({work.inputs[0].size} floats), one client, "
                     f"{args.grpc_requests} sequential requests x 3 interleaved rounds (p50 of each round; median "
                     f"of the rounds): `Program.run` in-process {run * 1e3:.3f} ms; "
                     + "; ".join(f"{k} {med[k] * 1e3:.3f} ms (overhead {(med[k] - run) * 1e3:.3f} ms; rounds "
                                 + ", ".join(f"{v * 1e3:.3f}" for v in p50[k]) + ")" for k in med) + ".")
        lines += ["", "| transport | clients | requests | req/s | p50 ms | p99 ms | CPU ms/request: server / workers "
                  "/ client | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n in args.clients:
            count = max(n, round(REQUESTS["mlp"].get(n, REQUESTS["mlp"][64]) * args.scale))
            for kind in ("gRPC", "HTTP binary"):
                time.sleep(PAUSE)
                # Each thread makes its own client: tritonclient.http's (gevent) works only in its own thread.
                lat, errors, nxt, lock = [], [], [0], threading.Lock()
                ready, go, deadline = threading.Barrier(n + 1), threading.Event(), [0.0]

                def client() -> None:
                    c, call = caller(kind)
                    try:
                        call(0)  # opens the connection, untimed
                    finally:
                        ready.wait()
                    go.wait()
                    try:
                        while time.perf_counter() < deadline[0]:
                            with lock:
                                if nxt[0] >= count:
                                    return
                                k = nxt[0]
                                nxt[0] += 1
                            t = time.perf_counter()
                            try:
                                good = ok(k, call(k))
                            except Exception as e:  # noqa: BLE001 - counted
                                errors.append(f"{type(e).__name__}: {e}")
                                continue
                            lat.append(time.perf_counter() - t)
                            if not good:
                                errors.append("values differ from Program.run")
                    finally:
                        c.close()

                threads = [threading.Thread(target=client) for _ in range(n)]
                for t in threads:
                    t.start()
                ready.wait()
                cpu0 = cpu_split(s.proc.pid)
                start = time.perf_counter()
                deadline[0] = start + args.time_cap
                go.set()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - start
                cpu = {k: (v - cpu0[k]) / max(len(lat), 1) * 1e3 for k, v in cpu_split(s.proc.pid).items()}
                ms = np.array(lat) * 1e3
                row = (f"| {kind} | {n} | {len(lat)}{' (cap)' if len(lat) < count else ''} | {len(lat) / wall:.0f} | "
                       f"{np.percentile(ms, 50):.2f} | {np.percentile(ms, 99):.2f} | {cpu['server']:.2f} / "
                       f"{cpu['workers']:.2f} / {cpu['client']:.2f} | {len(errors)} |")
                print(row + (f" first error: {errors[0]}" if errors else ""), flush=True)
                lines.append(row)
    finally:
        s.stop()
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report
def machine(load_start: tuple) -> str:
    cpu, date = cpu_name(), utc_now()
    fmt = lambda la: ", ".join(f"{v:.1f}" for v in la)  # noqa: E731
    return (f"{cpu}, nproc {os.cpu_count()} (load average {fmt(load_start)} at the start, {fmt(os.getloadavg())} "
            f"at the end), Python {platform.python_version()}; kiln {kiln.__version__}, numpy {np.__version__}, "
            f"onnxruntime {ort.__version__}, fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}, "
            f"httpx {httpx.__version__}, {extras()}; {date}")


def grpc_version() -> str:
    import importlib.metadata as md
    return f"{md.version('grpcio')}, tritonclient {md.version('tritonclient')}"


def extras() -> str:
    """uvicorn's optional speed-ups, which both kinds of server pick up when installed."""
    import importlib.metadata as md
    out = []
    for dist in ("uvloop", "httptools"):
        try:
            out.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            out.append(f"no {dist}")
    return ", ".join(out)


def table(rows: list[dict]) -> str:
    lines = ["| model | server | clients | requests | req/s | p50 ms | p99 ms | server p99 ms (bucket) | mean batch "
             "| compute ms/batch | CPU ms/request: server / workers / client | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        batch = f"{r['batch'][0]:.1f}" if r.get("batch") else ""
        comp = f"{r['compute'][0] * 1e3:.2f}" if r.get("compute") else ""
        sp99 = f"<= {r['server_p99'] * 1e3:g}" if r.get("server_p99") is not None else ""
        lines.append(f"| {r['model']} | {r['server']} | {r['clients']} | {r['n']}{' (cap)' if r['capped'] else ''} "
                     f"| {r['rps']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {sp99} | {batch} | {comp} | {cpu_text(r)} "
                     f"| {r['errors']} |")
    return "\n".join(lines)


def find(rows: list[dict], key: str, server: str, clients: int) -> dict | None:
    return next((r for r in rows if r["key"] == key and r["server"] == server and r["clients"] == clients), None)


def overhead_text(o: dict) -> str:
    ms = lambda v: f"{v * 1e3:.3f} ms"  # noqa: E731
    short = [f"{k}: {v}" for k, v in o["counts"].items() if v < o["n"]]
    parts = [f"Server overhead, MLP batch-1 request (784 floats in JSON), {o['n']} sequential requests "
             + (f"(fewer where 10 s passed: {', '.join(short)}) " if short else "")
             + f"on one keep-alive connection from a raw-socket client (p50): `Program.run` in-process {ms(o['run'])}"]
    for label in ("kiln serve, batching off", "kiln serve, batching on"):
        if label in o:
            parts.append(f"{label} {ms(o[label])} (overhead {ms(o[label] - o['run'])})")
    if "FastAPI + onnxruntime" in o:
        parts.append(f"FastAPI + onnxruntime {ms(o['FastAPI + onnxruntime'])} (its `session.run` in-process "
                     f"{ms(o['ort_run'])}, overhead {ms(o['FastAPI + onnxruntime'] - o['ort_run'])})")
    if "live" in o:
        parts.append(f"for scale, `GET /v2/health/live` on kiln serve {ms(o['live'])}")
    return "; ".join(parts) + "."


def memory_text(mems: list[dict], info: dict) -> str:
    mib = lambda v: f"{v / 2 ** 20:.0f}"  # noqa: E731
    lines = [f"Memory: a {info['weights'] / 1e6:.0f} MB fp32 MLP ({BIG_LAYERS} Gemm {BIG_WIDTH}x{BIG_WIDTH} + Relu, "
             f"then {BIG_WIDTH}->16; file {info['bytes'] / 2 ** 20:.0f} MiB, never mapped by the benchmark's own "
             "process), `kiln serve --max-batch-size 0 --workers N`; requests sent "
             "(2N at a time) until every worker process had the weights resident (RSS >= 80% of them), then "
             "/proc/<pid>/smaps_rollup summed over the server and all its descendants.", "",
             "| workers | processes | warm workers | RSS MiB | PSS MiB | PSS anon MiB | PSS file MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for m in mems:
        lines.append(f"| {m['workers']} | {len(m['procs'])} | {m['warm']} | {mib(m['Rss'])} | {mib(m['Pss'])} "
                     f"| {mib(m['Pss_Anon'])} | {mib(m['Pss_File'])} |")
    lines.append("")
    for m in mems:
        root, rest = m["procs"][0], m["procs"][1:]  # descendants() lists the server first
        lines.append(f"- {m['workers']} worker(s): server process RSS {mib(root.get('Rss', 0))} / PSS "
                     f"{mib(root.get('Pss', 0))} MiB; its descendants (RSS / PSS MiB): "
                     + ", ".join(f"{mib(q.get('Rss', 0))} / {mib(q.get('Pss', 0))}" for q in rest))
    return "\n".join(lines)


def shutdown_text(shuts: list[dict]) -> str:
    lines = ["Shutdown: N requests for the big model, each on its own connection; once all were written and "
             "0.15 s had passed, SIGTERM to the server; then a new request, and the server's exit status.", ""]
    for s in shuts:
        lines.append(f"- {s['server']}: {s['n']} sent, {s['done_before']} answered before SIGTERM, "
                     f"{s['in_flight']} in flight; {s['ok']}/{s['n']} got their right 200 (statuses "
                     f"{', '.join(s['statuses'])}), the last {s['last']:.2f} s after SIGTERM; a new request "
                     f"after SIGTERM: {s['late']}; exit status {s['rc']} after {s['exit_s']:.2f} s.")
    return "\n".join(lines)


def goal_lines(rows: list[dict], over: dict | None, mems: list[dict], shuts: list[dict],
               delay_ms: float) -> str:
    lines = ["Goals (issue 7):"]
    on, off = find(rows, "mlp", "kiln serve, batching on", 64), find(rows, "mlp", "kiln serve, batching off", 64)
    if on and off:
        ratio = on["rps"] / off["rps"]
        why = (f" (CPU per request, server process / workers: on {on['cpu']['server'] * 1e3:.2f} / "
               f"{on['cpu']['workers'] * 1e3:.2f} ms, off {off['cpu']['server'] * 1e3:.2f} / "
               f"{off['cpu']['workers'] * 1e3:.2f} ms"
               + (f"; batch-1 `Program.run` in-process {over['run'] * 1e3:.2f} ms" if over else "") + ")")
        lines.append(f"- MLP at 64 clients, batching on at least 4x batching off in requests/s: {on['rps']:.0f} vs "
                     f"{off['rps']:.0f} = {ratio:.2f}x{why}: " + ("met" if ratio >= 4 else "not met"))
    if over and "kiln serve, batching off" in over:
        for label in ("kiln serve, batching off", "kiln serve, batching on"):
            if label in over:
                extra = (over[label] - over["run"]) * 1e3
                lines.append(f"- server overhead under 1 ms at p50, single small request ({label}): {extra:.3f} ms: "
                             + ("met" if extra < 1 else "not met"))
    for r in rows:
        if r["server"] == "kiln serve, batching on" and r.get("compute"):
            bound = delay_ms + 2 * r["compute"][0] * 1e3
            lines.append(f"- p99 under max queue delay + 2x the batch's compute time, {r['key']} at {r['clients']} "
                         f"client(s): p99 {r['p99']:.2f} ms vs {delay_ms:g} + 2 x {r['compute'][0] * 1e3:.2f} = "
                         f"{bound:.2f} ms (mean batch {r['batch'][0]:.1f}): " + ("met" if r["p99"] < bound else "not met"))
    by = {m["workers"]: m for m in mems}
    if 1 in by and 4 in by:
        for k, what, note in (("Pss", "PSS", "the fair measure"),
                              ("Rss", "RSS", "counts shared pages in every process that maps them")):
            ratio = by[4][k] / by[1][k]
            lines.append(f"- 4 workers under 1.3x the memory of 1, {what}: {ratio:.2f}x: "
                         + ("met" if ratio < 1.3 else "not met") + f" ({note})")
    for s in shuts:
        good = s["ok"] == s["n"] and s["rc"] == 0
        lines.append(f"- requests in flight at SIGTERM all answered, clean exit ({s['server']}): {s['ok']}/{s['n']} "
                     f"answered, exit {s['rc']}: " + ("met" if good else "not met"))
    return "\n".join(lines)


def report(args: argparse.Namespace, load_start: tuple, rows: list, over: dict | None, mems: list, shuts: list,
           info: dict | None) -> str:
    counts = "; ".join(f"{k}: " + ", ".join(f"{c} at {n}" for n, c in v.items()) for k, v in REQUESTS.items())
    parts = [SECTION, "",
             f"`bench/serve_bench.py`; {machine(load_start)}. Every server is its own process on 127.0.0.1 "
             "(uvicorn, one process; kiln serve with its default worker settings, 1 worker process): `kiln serve "
             f"--max-batch-size {args.max_batch_size} --max-queue-delay-ms {args.max_queue_delay_ms:g}` (batching on), "
             "`kiln serve --max-batch-size 0` (batching off), and `bench/serve_peer.py`, what a user would write by "
             "hand: FastAPI, pydantic V2-style JSON request and response models, one `onnxruntime.InferenceSession` "
             "(default options) called per request from a sync endpoint, uvicorn with 1 worker, access log off. "
             "Models from `bench/runtime_models.py` (random weights, fp32) exported as in `bench/runtime_bench.py`. "
             "Load generator: N clients in another process (one asyncio loop), each an `httpx.AsyncClient` "
             "with one HTTP/1.1 keep-alive connection (a single AsyncClient shared by 64 tasks capped the generator "
             "near 170 requests/s), in closed loop, sending V2 JSON requests with batch-1 inputs from a pool of "
             f"{POOL} random ones; every response checked (200, output shape, first {CHECK_VALUES} values against "
             f"`Program.run`). Requests per cell ({counts} clients, x{args.scale:g}), capped at {args.time_cap:g} s, "
             "after one untimed request per connection; cells interleaved across the three servers. Servers' BLAS threads: "
             + ("each server's default (kiln serve's workers: max(1, (cores - 1) // workers) BLAS threads, 1 here; onnxruntime: its own pool)" if args.blas_threads is None
                else f"OPENBLAS/OMP/MKL_NUM_THREADS={args.blas_threads}") + ". Mean batch and "
             "compute time per batch: from kiln's /metrics histograms (sum/count) over the cell; server p99: the upper "
             "bound of the `kiln_request_duration_seconds` bucket holding the cell's 99th percentile (time inside "
             "the app, without HTTP parsing and the client). CPU ms/request: user + system CPU time over the cell "
             "(/proc/<pid>/stat) per request, of the server process (all its threads; the peer's onnxruntime runs "
             "there), of its descendants (kiln's worker processes) and of the load generator. On 2 cores the "
             "client, the server and its worker share the CPU, so these are this machine's figures with the load "
             "generator on it."]
    if rows:
        parts += ["", table(rows)]
    if over:
        parts += ["", overhead_text(over)]
    if mems:
        parts += ["", memory_text(mems, info)]
    if shuts:
        parts += ["", shutdown_text(shuts)]
    parts += ["", goal_lines(rows, over, mems, shuts, args.max_queue_delay_ms), ""]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,bert2", help="comma-separated, from mlp, bert2 ('' for none)")
    ap.add_argument("--clients", default="1,8,64", help="comma-separated concurrent client counts")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the requests per cell")
    ap.add_argument("--time-cap", type=float, default=10.0, help="seconds per cell at most")
    ap.add_argument("--max-batch-size", type=int, default=32, help="kiln serve's, with batching on (its default)")
    ap.add_argument("--max-queue-delay-ms", type=float, default=0.5, help="kiln serve's, with batching on (its "
                    "default)")
    ap.add_argument("--servers", default="on,off,peer", help="comma-separated, from on (kiln serve, batching on), "
                    "off (kiln serve, batching off), peer (FastAPI + onnxruntime)")
    ap.add_argument("--shutdown-requests", type=int, default=32, help="requests in flight at SIGTERM")
    ap.add_argument("--no-memory", action="store_true", help="skip the 1 and 4 worker memory measurement")
    ap.add_argument("--no-shutdown", action="store_true", help="skip the SIGTERM measurement")
    ap.add_argument("--blas-threads", type=int, help="set OPENBLAS/OMP/MKL_NUM_THREADS for every server (default: "
                    "unset, each library's own default)")
    ap.add_argument("--kiln", default="", help="command line that runs kiln, split on spaces (default: the kiln "
                    "script next to this Python)")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to update, '-' to only print")
    ap.add_argument("--grpc", action="store_true", help="only the gRPC rows (issue 25): gRPC against HTTP binary "
                    "through tritonclient on one kiln serve, MLP; printed, not written to --results")
    ap.add_argument("--grpc-requests", type=int, default=1000, help="sequential requests per round, --grpc")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.servers = [s for s in args.servers.split(",") if s]
    KILN_COMMAND[:] = args.kiln.split()
    BLAS_THREADS[:] = [] if args.blas_threads is None else [args.blas_threads]
    keys = [k for k in args.models.split(",") if k]
    if unknown := [k for k in keys if k not in REQUESTS]:
        ap.error(f"unknown models {unknown}; choose from {', '.join(REQUESTS)}")
    load_start = os.getloadavg()
    if args.grpc:
        with tempfile.TemporaryDirectory(prefix="kiln-serve-bench-") as d:
            text = grpc_rows(args, Path(d))
        print(f"\n`bench/serve_bench.py --grpc`; {machine(load_start)}; grpcio {grpc_version()}.\n\n{text}")
        return
    rows, over, mems, shuts, info, failed = [], None, [], [], None, []
    with tempfile.TemporaryDirectory(prefix="kiln-serve-bench-") as d:
        folder = Path(d)
        for key in keys:
            try:
                r, o, f = bench_model(key, args, folder)
                rows, over, failed = rows + r, over or o, failed + f
            except Exception as e:  # noqa: BLE001 - one failing model must not lose the others' rows
                failed.append(f"{MODELS[key].label}: {type(e).__name__}: {e}")
                print(f"FAILED {failed[-1]}", flush=True)
        if not (args.no_memory and args.no_shutdown):
            mems, shuts, info, f = memory_and_shutdown(args, folder)
            failed += f
    text = report(args, load_start, rows, over, mems, shuts, info)
    if failed:
        text += "\nNot measured (the run failed):\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    print("\n" + text)
    if args.results != "-":
        replace_section(Path(args.results), SECTION, text)


if __name__ == "__main__":
    main()
