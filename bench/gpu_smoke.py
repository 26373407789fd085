"""One device-machine call for the CUDA backend (issue 8): tests, op conformance, and the
elementwise-chain timings, with everything logged under $OUT (or ./gpu_out).

    mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/kiln && PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_smoke.py

Steps: (1) tests/runtime/test_cuda.py (op families natively, fused chains, CUDA-graph replay,
zoo models against torch); (2) tests/ops through the CUDA backend (bench/gpu_conformance.py)
with a per-op record of native/fallback/failed cases; (3) the chain ``x+1, *2, relu, -0.5,
sigmoid`` at 2048^2 and 8192^2 float32: kiln's generated kernel (launch only, and through
CudaProgram with and without CUDA graphs), a plain CuPy ElementwiseKernel of the same chain and
torch eager, against the bandwidth floor from a device-to-device copy measured in the same
run. Times are medians of CUDA-event timings over repeated batches of launches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or "gpu_out"
os.makedirs(OUT, exist_ok=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd: list, log: str, env=None, timeout=400) -> int:
    t = time.time()
    with open(os.path.join(OUT, log), "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    tail = open(os.path.join(OUT, log)).read().strip().splitlines()[-3:]
    print(f"[{log}] rc={r.returncode} in {time.time() - t:.0f}s: " + " | ".join(tail), flush=True)
    return r.returncode


def bench(fn, iters: int, reps: int = 7) -> float:
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls, in ms (CUDA events)."""
    import cupy as cp
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / iters)
    times.sort()
    return times[len(times) // 2]


def chain_bench() -> dict:
    import cupy as cp
    import numpy as np

    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    from kiln.runtime.cuda_program import CudaProgram

    results = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": []}
    src = cp.ones(1 << 28, cp.float32)  # 1 GiB
    dst = cp.empty_like(src)
    ms = bench(lambda: cp.copyto(dst, src), 10)
    bw = 2 * src.nbytes / (ms * 1e-3)
    results["copy_GBps"] = bw / 1e9
    src = dst = None
    ref = cp.ElementwiseKernel("float32 x", "float32 y",
                               "float t = (x + 1.0f) * 2.0f; t = t > 0.0f ? t : 0.0f; t = t - 0.5f;"
                               " y = 1.0f / (1.0f + expf(-t));", "chain_ref")
    try:
        import torch
    except ImportError:
        torch = None
    for n in (2048, 8192):
        g = Graph("chain")
        x = g.add_input("x", "float32", [n, n])
        y = g.op("Add", x, g.add_constant(np.array(1.0, np.float32)))
        y = g.op("Mul", y, g.add_constant(np.array(2.0, np.float32)))
        y = g.op("Relu", y)
        y = g.op("Sub", y, g.add_constant(np.array(0.5, np.float32)))
        y = g.op("Sigmoid", y)
        g.outputs = [y]
        infer_shapes(g)
        eager = CudaProgram(g.copy(), cuda_graphs=False)
        graphed = CudaProgram(g.copy(), cuda_graphs=True)
        xd = cp.random.standard_normal((n, n), dtype=cp.float32)
        launcher = eager.plan.instructions[0].kernel.launcher
        want = ref(xd)
        got = eager.run([xd], as_list=True)[0]
        err = float(cp.abs(got - want).max())
        floor = 2 * xd.nbytes / bw * 1e3
        iters = 200 if n == 2048 else 30
        row = {"n": n, "floor_ms": floor, "max_abs_diff_vs_cupy": err,
               "kiln_kernel_ms": bench(lambda: launcher(xd), iters),
               "kiln_program_ms": bench(lambda: eager.run([xd], as_list=True), iters),
               "kiln_program_graphs_ms": bench(lambda: graphed.run([xd], as_list=True), iters),
               "cupy_elementwise_ms": bench(lambda: ref(xd), iters),
               "vector_path": launcher.vector_launches > 0}
        if torch is not None and torch.cuda.is_available():
            xt = torch.as_tensor(xd, device="cuda")

            def teager():
                return torch.sigmoid(torch.relu((xt + 1) * 2) - 0.5)
            s = torch.cuda.current_stream()
            # torch runs on its own stream: time it with torch's events.
            for _ in range(3):
                teager()
            torch.cuda.synchronize()
            ts = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                for _ in range(iters):
                    teager()
                b.record(s)
                b.synchronize()
                ts.append(a.elapsed_time(b) / iters)
            row["torch_eager_ms"] = sorted(ts)[3]
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    return results


def model_bench() -> list:
    """ResNet-50 (224x224) and a BERT-base-sized encoder (zoo.transformer_encoder) at batch 1:
    kiln eager, kiln with CUDA graphs, torch eager (all fp32, TF32 off), in ms."""
    import cupy as cp
    import torch

    import kiln
    import zoo
    from kiln.frontend.tracer import to_numpy
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name, factory in (("resnet50", lambda: zoo.resnet50(batch=1, width=64, image=224, num_classes=1000)),
                          ("encoder_768x12", lambda: zoo.transformer_encoder(batch=1, seq=128, d_model=768, nhead=12,
                                                                             dim_ff=3072, layers=12))):
        try:
            model, inputs, spec = factory()
            graph = kiln.trace(model, inputs, dynamic=spec)
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "error": f"trace: {type(e).__name__}: {str(e)[:200]}"})
            continue
        names, tensors = zoo.input_list(model, inputs)
        feeds = [cp.asarray(to_numpy(t)) for t in tensors]
        row = {"model": name}
        for label, graphs in (("kiln_eager_ms", False), ("kiln_graphs_ms", True)):
            p = kiln.load(graph.copy(), device="cuda", cuda_graphs=graphs)
            out = p.run(feeds, as_list=True)[0]
            row[label] = bench(lambda: p.run(feeds, as_list=True), 20, 5)
            row[label.replace("_ms", "_fallbacks")] = p.fallback_ops
            if graphs:
                row["graph_failures"] = list(p.graph_failures.values())[:1]
        m = model.cuda()
        tt = [t.cuda() for t in tensors]
        with torch.no_grad():
            want = m(*tt)
            want = want if isinstance(want, torch.Tensor) else want[0]
            err = float(cp.abs(out - cp.asarray(want)).max() / (cp.abs(cp.asarray(want)).max() + 1e-12))
            row["rel_err_vs_torch"] = err
            s = torch.cuda.current_stream()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                for _ in range(20):
                    m(*tt)
                b.record(s)
                b.synchronize()
                ts.append(a.elapsed_time(b) / 20)
            row["torch_eager_ms"] = sorted(ts)[2]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    info = subprocess.run("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "
                          "'import cupy, numpy, flatbuffers; print(cupy.__version__, numpy.__version__)'",
                          shell=True, capture_output=True, text=True)
    print(info.stdout, info.stderr, flush=True)
    steps = sys.argv[1:] or ["tests", "conformance", "bench", "models"]
    if "tests" in steps:
        sh([sys.executable, "-m", "pytest", "tests/runtime/test_cuda.py", "tests/runtime/test_cuda_epilogue.py", "-q", "-p", "no:cacheprovider", "-rfE",
            "--tb=short"], "test_cuda.log", env)
    if "conformance" in steps:
        env2 = dict(env, KILN_CONFORMANCE_JSON=os.path.join(OUT, "conformance.json"))
        sh([sys.executable, "-m", "pytest", "tests/ops", "-q", "-p", "gpu_conformance", "-p", "no:cacheprovider",
            "--tb=line", "-rf"], "conformance.log", env2)
        try:
            rec = json.load(open(os.path.join(OUT, "conformance.json")))
            native = sorted(op for op, r in rec.items() if r["fallback"] == 0 and r["failed"] == 0)
            fell = sorted(f"{op}({r['fallback']}/{r['cases']})" for op, r in rec.items() if r["fallback"])
            failed = sorted(f"{op}({r['failed']}/{r['cases']})" for op, r in rec.items() if r["failed"])
            print(f"conformance: {len(rec)} ops; native in every case: {len(native)}", flush=True)
            print("fallback cases:", " ".join(fell), flush=True)
            print("failed:", " ".join(failed), flush=True)
        except OSError as e:
            print("no conformance record:", e)
    if "models" in steps:
        rows = model_bench()
        with open(os.path.join(OUT, "model_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if "bench" in steps:
        res = chain_bench()
        with open(os.path.join(OUT, "chain_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"device {res['device']}, copy {res['copy_GBps']:.0f} GB/s (read+write)")
        for r in res["rows"]:
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
