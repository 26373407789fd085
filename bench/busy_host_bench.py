"""The CPU runtime on a busy host (issue 21): kiln, onnxruntime and torch eager, each with 2 threads, on a quiet
machine and then with BLAS-busy neighbours, in the same run.

A neighbour is a process doing float32 matmuls in a loop with its own OpenBLAS at 2 threads (what a host running
several model servers looks like); ``--hogs`` of them (default 6) run for the busy phase only and are stopped at
its end (each also stops itself after ``--hog-seconds``). Models (bench/runtime_models.py, random weights):

- ``mlp``: MLP 784-512-512-10 at batch 32;
- ``bert2``: a BERT-style encoder, 2 layers, hidden 128, seq 128, batch 1;
- ``vit``: a ViT-Tiny-style model (4 layers, hidden 192) on a 3x64x64 image, batch 1.

kiln runs as a user gets it: ``kiln.load(path)`` with nothing set (numpy's BLAS at its default thread count, the
cores), so the row measures kiln's own threading policy. onnxruntime: ``intra_op_num_threads=2``. torch:
``torch.set_num_threads(2)`` under ``inference_mode``. Each cell is the median of the calls made in
``--budget`` seconds (at most ``--repeat``), runtimes alternating in rounds; the slowdown is busy / quiet.

    python bench/busy_host_bench.py [--models mlp,bert2,vit] [--hogs 6] [--budget 6] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kiln

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
THREADS = 2
SECTION = "## The CPU runtime on a busy host (issue 21)"
BATCH = {"mlp": 32, "bert2": 1, "vit": 1}

HOG = """
import os, sys, time
os.environ["OPENBLAS_NUM_THREADS"] = "2"
import numpy as np
a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    a = (a @ a) * 1e-3 + 0.5
"""


def start_hogs(n: int, seconds: float) -> list:
    return [subprocess.Popen([sys.executable, "-c", HOG, str(seconds)]) for _ in range(n)]


def stop_hogs(procs: list) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)


def timed(fn, budget: float, repeat: int) -> list:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - start < budget):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def runners(key: str, folder: Path) -> tuple[dict, np.ndarray]:
    import torch

    from runtime_bench import export_model, ort_session
    from runtime_models import MODELS
    model, kiln_path, onnx_path = export_model(key, folder)
    x = MODELS[key].example(BATCH[key])
    xn = x.numpy()
    program = kiln.load(kiln_path)
    session = ort_session(onnx_path)
    name = session.get_inputs()[0].name

    def run_torch():
        with torch.inference_mode():
            return model(x)
    fns = {"kiln": lambda: program.run({program.inputs[0].name: xn}),
           "onnxruntime": lambda: session.run(None, {name: xn}),
           "torch": run_torch}
    want = run_torch().numpy()
    got = list(program.run({program.inputs[0].name: xn}).values())[0]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)  # the row measures a right answer
    return fns, xn


def phase(fns: dict, budget: float, repeat: int, rounds: int = 3) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            time.sleep(0.2)
            times[k] += timed(fn, budget / rounds, max(3, repeat // rounds))
    return {k: (statistics.median(v), len(v)) for k, v in times.items()}


def goal_line(rows: list) -> str:
    """Issue 21's goal, kiln's slowdown at most onnxruntime's, per model, from the unrounded medians."""
    parts = []
    for r in rows:
        k, o = (r["busy"][name][0] / r["quiet"][name][0] for name in ("kiln", "onnxruntime"))
        parts.append(f"{r['model']} {k:.2f}x against {o:.2f}x ({'met' if k <= o else 'not met'})")
    return "kiln's slowdown at most onnxruntime's: " + "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,bert2,vit")
    ap.add_argument("--hogs", type=int, default=6)
    ap.add_argument("--budget", type=float, default=6.0, help="seconds per cell and phase")
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--hog-seconds", type=float, default=120.0)
    ap.add_argument("--label", default="", help="a name for this run's rows (e.g. 'before')")
    ap.add_argument("--results", default="", help="append the rows to this markdown file ('-': print only)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(THREADS)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for key in [m for m in args.models.split(",") if m]:
            fns, _ = runners(key, Path(d))
            quiet = phase(fns, args.budget, args.repeat)
            hogs = start_hogs(args.hogs, args.hog_seconds)
            try:
                time.sleep(1.0)
                busy = phase(fns, args.budget, args.repeat)
            finally:
                stop_hogs(hogs)
            row = {"model": key, "batch": BATCH[key], "quiet": quiet, "busy": busy}
            rows.append(row)
            print(key, {k: f"{quiet[k][0] * 1e3:.2f} -> {busy[k][0] * 1e3:.2f} ms "
                              f"({busy[k][0] / quiet[k][0]:.1f}x, n={busy[k][1]})" for k in fns}, flush=True)
    lines = [f"| {args.label} | model | kiln quiet -> busy ms (x) | onnxruntime (x) | torch (x) |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['quiet'][k][0] * 1e3:.2f} -> {r['busy'][k][0] * 1e3:.2f} "
                 f"(**{r['busy'][k][0] / r['quiet'][k][0]:.1f}x**)" for k in ("kiln", "onnxruntime", "torch")]
        lines.append(f"| | {r['model']} b{r['batch']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n\n" + goal_line(rows)
    print(table)
    if args.results and args.results != "-":
        with open(args.results, "a") as f:
            f.write(f"\n{table}\n\n{os.uname().machine}, nproc {os.cpu_count()}, {args.hogs} neighbours x 2 OpenBLAS "
                    f"threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
