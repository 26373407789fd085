"""Recurrent layers at run time (issue 15): a traced nn.LSTM in kiln's CPU runtime against torch eager
and onnxruntime, on the same inputs.

Model: nn.LSTM(256, 256, num_layers=2), random weights, fp32, input [T=50, batch, 256], batch 1
and 16. Runtimes:
- kiln: ``kiln.trace`` with a symbolic length and batch, ``kiln.save``, ``kiln.load(path).run``
  (one Loop over the time steps per layer, the input projection hoisted out as one MatMul);
- torch eager under ``torch.inference_mode()``;
- onnxruntime on kiln's export (``kiln.export_onnx``: the same graph, ONNX Loop);
- onnxruntime on ``torch.onnx.export(dynamo=False)``, which writes ONNX's fused LSTM op.

Two settings, each in a fresh process (numpy's OpenBLAS reads its thread count when it loads):
- 1 thread each (OpenBLAS, torch, onnxruntime's intra-op pool): every runtime computes on the
  calling thread, so its CPU time (``time.thread_time``) is what the run costs whatever else the
  machine is doing; wall time is given beside it;
- 2 threads each (the setting of bench/runtime_bench.py): wall time only.
Each cell: the median of --repeat runs after a warm-up, timed in 3 rounds of blocks (kiln, torch,
ORT kiln, ORT LSTM, kiln, ...) 0.25 s apart. ``--profile`` adds where kiln's time goes (the CPU
time of each op of the loop bodies, 1 thread).

Run: .venv/bin/python bench/rnn_bench.py [--repeat 30] [--profile] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTION = "## Recurrent layers (issue 15)"
ROUNDS = 3
PAUSE = 0.25
T, INPUT, HIDDEN, LAYERS = 50, 256, 256, 2
BATCHES = (1, 16)
RUNTIMES = ("kiln", "torch", "ort_kiln", "ort_lstm")
LABELS = {"kiln": "kiln CPU runtime", "torch": "torch eager", "ort_kiln": "ORT, kiln's export (Loop)",
          "ort_lstm": "ORT, torch.onnx LSTM op"}


# ---------------------------------------------------------------------------- one setting (a worker process)
def worker(threads: int, repeat: int, profile: bool) -> dict:
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)  # before numpy loads (a fresh process)
    import warnings

    import numpy as np
    import onnxruntime as ort
    import torch

    import kiln

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch.nn.LSTM(INPUT, HIDDEN, num_layers=LAYERS).eval()
    example = torch.randn(T, 2, INPUT)
    folder = Path(tempfile.mkdtemp())
    graph = kiln.trace(model, (example,), dynamic={"input": {0: "seq", 1: "batch"}})
    program = kiln.load(kiln.save(graph, folder / "lstm.kiln"))
    kiln.export_onnx(graph, folder / "kiln.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notices
        torch.onnx.export(model, (example,), str(folder / "torch.onnx"), dynamo=False, input_names=["input"],
                          output_names=["output", "h", "c"], dynamic_axes={"input": {0: "seq", 1: "batch"}})
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sessions = {k: ort.InferenceSession(str(folder / f"{f}.onnx"), so, providers=["CPUExecutionProvider"])
                for k, f in (("ort_kiln", "kiln"), ("ort_lstm", "torch"))}
    rows = []
    for batch in BATCHES:
        xt = torch.randn(T, batch, INPUT)
        x = xt.numpy()
        fns = {"kiln": lambda: program.run([x], as_list=True), "torch": lambda: model(xt),
               "ort_kiln": lambda: sessions["ort_kiln"].run(None, {"input": x}),
               "ort_lstm": lambda: sessions["ort_lstm"].run(None, {"input": x})}
        with torch.inference_mode():
            want = [t.numpy() for t in (lambda o: (o[0], *o[1]))(model(xt))]
            errors = {k: _rel_err(fns[k](), want) for k in ("kiln", "ort_kiln", "ort_lstm")}
            timed = _rounds(fns, repeat)
        row = {"batch": batch, "errors": errors, **timed}
        print(_console(threads, row), file=sys.stderr, flush=True)
        rows.append(row)
    result = {"threads": threads, "rows": rows, "gemm_ms": _bare_gemms(), "versions": {
        "numpy": np.__version__, "torch": torch.__version__, "onnxruntime": ort.__version__,
        "kiln": kiln.__version__}}
    if profile:
        result["profile"] = {b: _body_profile(program, np.random.default_rng(b).standard_normal(
            (T, b, INPUT)).astype(np.float32), repeat) for b in BATCHES}
    return result


def _bare_gemms() -> float:
    """Wall ms of numpy alone doing the batch-16 run's per-step product 100 times ([16, 256] x
    [256, 1024]): how this thread setting's BLAS treats a loop of small GEMMs."""
    import numpy as np

    rng = np.random.default_rng(0)
    h = rng.standard_normal((16, HIDDEN)).astype(np.float32)
    w = rng.standard_normal((HIDDEN, 4 * HIDDEN)).astype(np.float32)
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(T * LAYERS):
            h @ w
        best.append(time.perf_counter() - t)
    return statistics.median(best) * 1e3


def _rel_err(got, want) -> float:
    import numpy as np
    return max(float(np.abs(np.asarray(g) - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want))


def _rounds(fns: dict, repeat: int) -> dict:
    """Per runtime: wall and calling-thread CPU seconds of each run, in ROUNDS alternating blocks."""
    out = {k: {"wall": [], "cpu": []} for k in fns}
    per_block = max(1, -(-repeat // ROUNDS))
    for r in range(ROUNDS):
        for name, fn in fns.items():
            time.sleep(PAUSE)
            for _ in range(2 if r == 0 else 1):
                fn()
            for _ in range(per_block):
                w, c = time.perf_counter(), time.thread_time()
                fn()
                out[name]["cpu"].append(time.thread_time() - c)
                out[name]["wall"].append(time.perf_counter() - w)
    return out


def _body_profile(program, x, repeat: int) -> dict:
    """CPU microseconds per call of each op of the Loop bodies, and the whole run's, over ``repeat`` runs.

    The bodies' plans are found in the Loop kernels' closures and their kernels wrapped with a
    clock for the measurement only (the wrapper's own cost, about 0.3 us a call, is included)."""
    import inspect

    from kiln.runtime.plan import Plan

    total = []
    for _ in range(repeat):
        c = time.thread_time()
        program.run([x])
        total.append(time.thread_time() - c)
    stats: dict = {}
    for ins in program.plan.instructions:
        if ins.node.op != "Loop":
            continue
        body = inspect.getclosurevars(ins.kernel).nonlocals.get("plan")
        if not isinstance(body, Plan):
            continue
        steps = []
        for step, inner in zip(body.steps, body.instructions):
            steps.append((_clocked(step[0], stats.setdefault(inner.node.op, [0.0, 0])),) + step[1:])
        body.steps = steps
    for _ in range(repeat):
        program.run([x])
    ops = {op: (secs / calls * 1e6, calls // repeat) for op, (secs, calls) in stats.items()}
    return {"run_ms": statistics.median(total) * 1e3, "ops": ops}


def _clocked(kernel, acc: list):
    def run(*args):
        c = time.thread_time()
        r = kernel(*args)
        acc[0] += time.thread_time() - c
        acc[1] += 1
        return r
    return run


def _console(threads: int, row: dict) -> str:
    cells = ", ".join(f"{k} {statistics.median(row[k]['wall']) * 1e3:.2f} ms" for k in RUNTIMES)
    return f"threads {threads}, batch {row['batch']}: {cells}"


# ---------------------------------------------------------------------------- the report
def _ms(v: list) -> str:
    return f"{statistics.median(v) * 1e3:.2f}"


def table(result: dict, clock: str) -> str:
    head = ("| batch | " + " | ".join(f"{LABELS[k]} ms" for k in RUNTIMES)
            + " | kiln / ORT LSTM op | kiln / ORT Loop | kiln / torch | kiln rel. err |")
    lines = [head, "|---:|" + "---:|" * (len(RUNTIMES) + 4)]
    for row in result["rows"]:
        med = {k: statistics.median(row[k][clock]) for k in RUNTIMES}
        errs = "kiln {kiln:.1e}, ORT Loop {ort_kiln:.1e}, ORT LSTM {ort_lstm:.1e}".format(**row["errors"])
        lines.append(f"| {row['batch']} | " + " | ".join(_ms(row[k][clock]) for k in RUNTIMES)
                     + f" | {med['kiln'] / med['ort_lstm']:.2f} | {med['kiln'] / med['ort_kiln']:.2f} "
                       f"| {med['kiln'] / med['torch']:.2f} | {errs} |")
    return "\n".join(lines)


def profile_text(profile: dict) -> str:
    parts = []
    for batch, p in profile.items():
        ops = sorted(p["ops"].items(), key=lambda kv: -kv[1][0] * kv[1][1])
        steps = T * LAYERS
        body = sum(us * n for us, n in p["ops"].values()) / steps
        cells = ", ".join(f"{op} {us:.1f} us x{n // steps}" for op, (us, n) in ops)
        parts.append(f"batch {batch}: run {p['run_ms']:.2f} ms CPU, {p['run_ms'] * 1e3 / steps:.1f} us per layer-step, "
                     f"of which the body's ops {body:.1f} us ({cells}; per call, with the clock's own cost)")
    return "Where kiln's time goes (1 thread, `--profile`): " + "; ".join(parts) + "."


def machine(load_start: str, versions: dict) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_md import cpu_name, utc_now

    load_end = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_name()}, nproc {os.cpu_count()} (load average {load_start} at the start, {load_end} at the end), "
            f"Python {platform.python_version()}; kiln {versions['kiln']}, numpy {versions['numpy']} (OpenBLAS), "
            f"onnxruntime {versions['onnxruntime']}, torch {versions['torch']}; {utc_now()}")


def report(results: list, load_start: str, repeat: int) -> str:
    one = next(r for r in results if r["threads"] == 1)
    parts = [SECTION, "",
             f"`bench/rnn_bench.py`: nn.LSTM({INPUT}, {HIDDEN}, num_layers={LAYERS}), fp32, random weights, input "
             f"[T={T}, batch, {INPUT}]; {machine(load_start, one['versions'])}. kiln: `kiln.trace` with a symbolic "
             "length and batch, `kiln.save`, `kiln.load(path).run` (per layer: the input projection of all steps as "
             "one MatMul, then one Loop over the steps); torch: eager under `torch.inference_mode()`; ORT Loop: "
             "onnxruntime on `kiln.export_onnx` of the same graph; ORT LSTM op: onnxruntime on "
             "`torch.onnx.export(dynamo=False)`, ONNX's fused LSTM. Each cell: the median of "
             f"{ROUNDS * max(1, -(-repeat // ROUNDS))} runs in {ROUNDS} alternating rounds after a warm-up; "
             "each thread setting in a fresh process.", ""]
    parts += ["1 thread each (OpenBLAS, torch, ORT intra-op), CPU time of the calling thread (every runtime computes "
              "on it, so other load on the machine does not count):", "", table(one, "cpu"), "",
              "The same runs, wall time:", "", table(one, "wall")]
    two = next((r for r in results if r["threads"] == 2), None)
    if two is not None:
        parts += ["", "2 threads each (bench/runtime_bench.py's setting), wall time:", "", table(two, "wall")]
    parts += ["", "numpy alone, the batch-16 run's per-step product 100 times ([16, 256] x [256, 1024], wall): "
              + ", ".join(f"{r['gemm_ms']:.1f} ms with {r['threads']} BLAS thread{'s' if r['threads'] > 1 else ''}"
                          for r in results)
              + ". kiln's loop makes one such call per layer and step; where a second BLAS thread has to be "
                "woken for each (and more so on a loaded machine), that hand-off, not the arithmetic, is the cost."]
    if "profile" in one:
        parts += ["", profile_text({int(b): p for b, p in one["profile"].items()})]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=30, help="timed runs per cell")
    ap.add_argument("--threads", default="1,2", help="thread settings to run, comma-separated (1 is required)")
    ap.add_argument("--profile", action="store_true", help="also time each op of kiln's loop bodies")
    ap.add_argument("--results", default=None, help="markdown file to update (default bench/RESULTS.md), "
                    "'-' to only print")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeat, args.profile)))
        return
    load_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    results = []
    for threads in sorted({int(n) for n in args.threads.split(",")} | {1}):
        cmd = [sys.executable, __file__, "--worker", str(threads), "--repeat", str(args.repeat)]
        if args.profile and threads == 1:
            cmd.append("--profile")
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    text = report(results, load_start, args.repeat)
    print("\n" + text)
    if args.results != "-":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from results_md import RESULTS, replace_section
        replace_section(Path(args.results) if args.results else RESULTS, SECTION, text)


if __name__ == "__main__":
    main()
