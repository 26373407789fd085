"""Triton Inference Server's own single-request gRPC and HTTP overhead, through PyTriton (issue 25 peer).

Measured the same way as ``bench/serve_bench.py --grpc`` measures kiln: MLP 784-512-512-10 (ReLU) batch 1,
one client, N sequential requests x 3 interleaved rounds over tritonclient.grpc and tritonclient.http
(binary inputs and outputs), p50 of each round, median of the rounds; overhead = p50 - the bound
function's own compute time (the numpy MLP alone, timed in the server process, batch 1).

The model is bound with PyTriton: ``max_batch_size=32`` and a dynamic batcher with a 500 us queue delay,
as kiln's bench uses; the infer function computes the MLP with numpy matmuls (random weights, seed 0).

Setup (PyTriton's Python backend stub needs Python 3.12 here, and PyTriton's Python layer numpy < 2)::

    /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /tmp/pyt
    /tmp/pyt/bin/pip install nvidia-pytriton "numpy<2"

Run (the client is the repo's Python 3.11 venv, which has tritonclient[http,grpc]; it starts the server
with ``--server-python`` and sets LD_LIBRARY_PATH to that interpreter's lib folder)::

    .venv/bin/python bench/triton_grpc_peer.py --server-python /tmp/pyt/bin/python \
        --server-lib /root/.pyenv/versions/3.12.1/lib
"""
from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

SIZES = (784, 512, 512, 10)


def weights():
    rng = np.random.default_rng(0)
    ws = []
    for a, b in zip(SIZES, SIZES[1:]):
        ws.append((rng.standard_normal((a, b), dtype=np.float32) / np.float32(np.sqrt(a)),
                   rng.standard_normal(b, dtype=np.float32) * np.float32(0.01)))
    return ws


def mlp(ws, x: np.ndarray) -> np.ndarray:
    for i, (w, b) in enumerate(ws):
        x = x @ w + b
        if i < len(ws) - 1:
            x = np.maximum(x, 0)
    return x


def median_run(fn, n: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def serve(http_port: int, grpc_port: int, metrics_port: int, delay_us: int) -> None:
    """Server side (Python 3.12 with PyTriton): time the MLP alone, then bind and serve until killed."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    ws = weights()
    x1 = np.random.default_rng(7).standard_normal((1, 784), dtype=np.float32)
    compute = median_run(lambda: mlp(ws, x1), 2000)

    @batch
    def infer(x):
        return {"y": mlp(ws, x)}

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    # PyTriton restricts the statistics API to a token; the client passes the same one (environment).
    security = TritonSecurityConfig(access_token=os.environ["TRITON_PEER_TOKEN"])
    with Triton(config=config, security_config=security) as triton:
        triton.bind(model_name="mlp", infer_func=infer,
                    inputs=[Tensor(name="x", dtype=np.float32, shape=(784,))],
                    outputs=[Tensor(name="y", dtype=np.float32, shape=(10,))],
                    config=ModelConfig(max_batch_size=32, batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)))
        triton.run()
        from importlib import metadata as md
        print(f"READY compute_s={compute!r} numpy={np.__version__} pytriton={md.version('nvidia-pytriton')} "
              f"python={sys.version.split()[0]}", flush=True)
        triton.serve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(args) -> None:
    import tritonclient.grpc as tg
    import tritonclient.http as th

    hp, gp, mp = free_port(), free_port(), free_port()
    env = dict(os.environ)
    token = env["TRITON_PEER_TOKEN"] = secrets.token_urlsafe(16)
    if args.server_lib:
        env["LD_LIBRARY_PATH"] = args.server_lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    log = open(args.log, "w")
    proc = subprocess.Popen([args.server_python, os.path.abspath(__file__), "--serve", str(hp), str(gp), str(mp),
                             str(args.queue_delay_us)],
                            stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    try:
        ready = ""
        for line in proc.stdout:  # tritonserver logs to stdout too: skip to the READY line
            if line.startswith("READY"):
                ready = line
                break
            log.write(line)
        if not ready:
            raise RuntimeError(f"server did not start; see {args.log}")
        threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True).start()
        fields = dict(kv.split("=", 1) for kv in ready.split()[1:])
        compute = float(fields["compute_s"])
        x = np.random.default_rng(7).standard_normal((1, 784), dtype=np.float32)
        want = mlp(weights(), x)

        gc = tg.InferenceServerClient(f"127.0.0.1:{gp}")
        gi = tg.InferInput("x", [1, 784], "FP32")
        gi.set_data_from_numpy(x)
        hc = th.InferenceServerClient(f"127.0.0.1:{hp}")
        hi = th.InferInput("x", [1, 784], "FP32")
        hi.set_data_from_numpy(x, binary_data=True)
        ho = [th.InferRequestedOutput("y", binary_data=True)]
        calls = {"gRPC": lambda: gc.infer("mlp", [gi]).as_numpy("y"),
                 "HTTP binary": lambda: hc.infer("mlp", [hi], outputs=ho).as_numpy("y")}
        p50: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(3):  # interleaved rounds
            for kind, call in calls.items():
                for _ in range(50):
                    call()
                times = []
                for k in range(args.requests):
                    t = time.perf_counter()
                    got = call()
                    times.append(time.perf_counter() - t)
                    if k == 0 and not (got.shape == want.shape and np.allclose(got, want, rtol=1e-3, atol=1e-4)):
                        raise RuntimeError(f"{kind}: wrong answer {got!r}")
                p50[kind].append(statistics.median(times))
        # Triton's own per-request breakdown (server side, all requests above): where the time goes.
        st = hc.get_inference_statistics("mlp", headers={"triton-access-token": token})["model_stats"][0]["inference_stats"]
        n = int(st["success"]["count"])
        parts = ", ".join(f"{k} {int(st[k]['ns']) / n / 1e6:.3f}" for k in
                          ("success", "queue", "compute_input", "compute_infer", "compute_output"))
        gc.close()
        hc.close()
        from importlib import metadata as md
        med = {k: statistics.median(v) for k, v in p50.items()}
        print(f"Triton (PyTriton {fields['pytriton']}, server Python {fields['python']}, numpy {fields['numpy']}; "
              f"client Python {sys.version.split()[0]}, tritonclient {md.version('tritonclient')}, grpcio "
              f"{md.version('grpcio')}); MLP 784-512-512-10 batch 1, one client, {args.requests} sequential requests "
              f"x 3 interleaved rounds, max_batch_size 32, queue delay {args.queue_delay_us} us (p50 of each round; median of the rounds): bound numpy MLP in-process "
              f"{compute * 1e3:.3f} ms; "
              + "; ".join(f"{k} {med[k] * 1e3:.3f} ms (overhead {(med[k] - compute) * 1e3:.3f} ms; rounds "
                          + ", ".join(f"{v * 1e3:.3f}" for v in p50[k]) + ")" for k in med)
              + f". Triton's server-side mean ms/request over {n} requests: {parts}.")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--serve":
        serve(*map(int, sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server-python", default="/tmp/pyt/bin/python", help="Python 3.12 with nvidia-pytriton, numpy<2")
    ap.add_argument("--server-lib", default="/root/.pyenv/versions/3.12.1/lib",
                    help="folder holding libpython3.12.so (LD_LIBRARY_PATH for the backend stub)")
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests per round")
    ap.add_argument("--queue-delay-us", type=int, default=500, help="dynamic batcher max queue delay")
    ap.add_argument("--log", default="/tmp/triton_grpc_peer.log", help="server's stderr")
    client(ap.parse_args())


if __name__ == "__main__":
    main()
