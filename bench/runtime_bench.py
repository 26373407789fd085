"""CPU runtime: kiln.load(...).run against onnxruntime and torch eager on the same models, 2 threads each.

Models (bench/runtime_models.py, random weights): MLP 784-512-512-10, ResNet-18 (224x224), a
2-layer BERT-style encoder (hidden 128, seq 128), a 4-layer one (hidden 768, seq 128).
Per model: kiln.trace(dynamic_batch=True) + kiln.save, then kiln.load; torch.onnx.export
(legacy exporter, dynamic batch axis) into onnxruntime (intra_op_num_threads=2); torch eager
under inference_mode with torch.set_num_threads(2). numpy's OpenBLAS gets 2 threads
(OPENBLAS_NUM_THREADS, set before numpy loads). Each cell: the median of --repeat runs after a
warm-up (fewer when a cell passes --budget seconds), timed in rounds of blocks per runtime.

Also: interpreter overhead (a 1000-node chain of tiny elementwise ops on a [1,8] tensor: kiln
per node, numpy's own cost of the same ufunc calls, onnxruntime per node on the same chain built
with onnx.helper), cold start (fresh process: import, load the ResNet-18 file, run once; median
of 5) and, with --memory, the peak of live intermediates of a ResNet-50 run against keeping them all.

Run: .venv/bin/python bench/runtime_bench.py [--models mlp,resnet18,bert2,bert4] [--batches 1,32]
     [--repeat 20] [--budget 15] [--memory] [--results FILE|-]
"""
from __future__ import annotations

import os

THREADS = 2
os.environ["OPENBLAS_NUM_THREADS"] = str(THREADS)  # numpy's BLAS reads it when numpy loads

import argparse  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import kiln  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "runtime"))
from results_md import RESULTS, cpu_name, replace_section, utc_now  # noqa: E402
from runtime_models import MODELS, resnet50  # noqa: E402
from test_memory import live_bytes, without_release  # noqa: E402  (the memory test's measurement)

SECTION = "## CPU runtime (issue 5)"
ROUNDS = 3
PAUSE = 0.25  # seconds between blocks, for the last runtime's spinning threads to go to sleep


# ---------------------------------------------------------------------------- timing
def measure(fn: Callable[[], object], repeat: int, budget: float, warmup: int = 2, least: int = 3) -> list[float]:
    """Seconds per call: ``warmup`` untimed calls (one when a call takes over a second), then up
    to ``repeat`` timed ones, stopping early once ``budget`` seconds are spent (after ``least``)."""
    for _ in range(warmup):
        t = time.perf_counter()
        fn()
        if time.perf_counter() - t > 1.0:
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeat and (len(times) < least or time.perf_counter() - start < budget):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure_rounds(fns: dict, repeat: int, budget: float) -> dict:
    """Time each runtime in ROUNDS blocks, alternating (kiln, ORT, torch, kiln, ...): a block
    keeps one runtime's thread pool hot, and the rounds spread load from elsewhere on the
    machine over all of them. The pause between blocks matters on 2 cores: onnxruntime's spinning
    workers made the next torch block 30x slower in some runs. The first block warms up; later ones only for fast calls."""
    times: dict = {name: [] for name in fns}
    for r in range(ROUNDS):
        for name, fn in fns.items():
            slow = bool(times[name]) and statistics.median(times[name]) > 1.0
            time.sleep(PAUSE)
            times[name] += measure(fn, math.ceil(repeat / ROUNDS), budget / ROUNDS,
                                   warmup=2 if r == 0 else int(not slow), least=1)
    return times


def ort_session(path: Path, optimized: Path | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    if optimized is not None:  # to count the nodes ORT runs; quiet its hardware-specific warning
        so.optimized_model_filepath = str(optimized)
        so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------- reference models
def export_model(key: str, folder: Path) -> tuple[torch.nn.Module, Path, Path]:
    """The eager model, its .kiln file and its .onnx file (both with a dynamic batch)."""
    ref = MODELS[key]
    model = ref.build()
    x = ref.example(2)
    kiln_path = kiln.save(kiln.trace(model, (x,), dynamic_batch=True, check=False), folder / f"{key}.kiln")
    onnx_path = folder / f"{key}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(model, (x,), str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return model, Path(kiln_path), onnx_path


def bench_model(key: str, batches: list[int], repeat: int, budget: float, folder: Path) -> list[dict]:
    model, kiln_path, onnx_path = export_model(key, folder)
    program = kiln.load(kiln_path)
    session = ort_session(onnx_path)
    rows = []
    for batch in batches:
        xt = MODELS[key].example(batch)
        x = xt.numpy()
        with torch.inference_mode():
            want = model(xt).numpy()
        got = program.run([x], as_list=True)[0]
        row = {"model": MODELS[key].label, "batch": batch,
               "err": float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))}
        fns = {"kiln": lambda: program.run([x]), "ort": lambda: session.run(None, {"x": x}),
               "torch": lambda: model(xt)}
        with torch.inference_mode():  # entered once: its cost stays out of torch's timings
            row.update(measure_rounds(fns, repeat, budget))
        print(_console(row), flush=True)
        rows.append(row)
    return rows


def _console(row: dict) -> str:
    k, o, t = (statistics.median(row[c]) * 1e3 for c in ("kiln", "ort", "torch"))
    return (f"{row['model']}, batch {row['batch']}: kiln {k:.3f} ms, ORT {o:.3f} ms, torch {t:.3f} ms "
            f"(runs {len(row['kiln'])}/{len(row['ort'])}/{len(row['torch'])}), rel err {row['err']:.1e}")


# ---------------------------------------------------------------------------- interpreter overhead
CHAIN_OPS = (("Add", np.add), ("Mul", np.multiply), ("Sub", np.subtract), ("Relu", np.maximum))


def chain_constants(nodes: int) -> list[np.ndarray]:
    """One [1,8] constant per node (Relu's is the 0 that kiln's kernel passes to np.maximum);
    multipliers in [0.5, 1.5] keep the values finite over 1000 nodes."""
    rng = np.random.default_rng(0)
    consts = []
    for i in range(nodes):
        op = CHAIN_OPS[i % len(CHAIN_OPS)][0]
        if op == "Relu":
            consts.append(np.float32(0))
        elif op == "Mul":
            consts.append(rng.uniform(0.5, 1.5, (1, 8)).astype(np.float32))
        else:
            consts.append(rng.uniform(-1, 1, (1, 8)).astype(np.float32))
    return consts


def chain_kiln(consts: list, path: Path) -> Path:
    g = kiln.Graph("chain")
    y = g.add_input("x", "float32", (1, 8))
    for i, c in enumerate(consts):
        op = CHAIN_OPS[i % len(CHAIN_OPS)][0]
        y = g.op(op, y) if op == "Relu" else g.op(op, y, g.add_initializer(f"c{i}", c))
    g.outputs = [y]
    return Path(kiln.save(g, path))


def chain_onnx(consts: list, path: Path) -> Path:
    nodes, inits, prev = [], [], "x"
    for i, c in enumerate(consts):
        op = CHAIN_OPS[i % len(CHAIN_OPS)][0]
        inputs = [prev] if op == "Relu" else [prev, f"c{i}"]
        if op != "Relu":
            inits.append(numpy_helper.from_array(c, f"c{i}"))
        nodes.append(helper.make_node(op, inputs, [f"y{i}"]))
        prev = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def numpy_chain(x: np.ndarray, pairs: list) -> np.ndarray:
    """The chain as direct ufunc calls: ``pairs`` of (ufunc, constant), built once."""
    for f, c in pairs:
        x = f(x, c)
    return x


def interpreter_overhead(nodes: int, repeat: int, folder: Path) -> dict:
    consts = chain_constants(nodes)
    path = chain_kiln(consts, folder / "chain.kiln")
    program = kiln.load(path)  # as a user gets it: with the native extension, the chain fused into one pass
    # and one instruction per op (the interpreter's own cost): loaded and run with the extension off
    from kiln.runtime.kernels.cpu import native
    real = native._native
    native._native = None
    try:
        unfused = kiln.load(path)
    finally:
        native._native = real

    def run_unfused():
        native._native = None
        try:
            return unfused.run([x])
        finally:
            native._native = real
    session = ort_session(chain_onnx(consts, folder / "chain.onnx"), folder / "chain.ort.onnx")
    ort_nodes = len(onnx.load(str(folder / "chain.ort.onnx")).graph.node)
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    pairs = [(CHAIN_OPS[i % len(CHAIN_OPS)][1], c) for i, c in enumerate(consts)]
    np.testing.assert_allclose(program.run([x], as_list=True)[0], numpy_chain(x, pairs), rtol=1e-5)
    result = {"nodes": nodes, "kiln_nodes": len(program.plan.instructions), "ort_nodes": ort_nodes,
              "unfused_nodes": len(unfused.plan.instructions)}
    for name, fn in (("kiln", lambda: program.run([x])), ("unfused", run_unfused),
                     ("numpy", lambda: numpy_chain(x, pairs)), ("ort", lambda: session.run(None, {"x": x}))):
        time.sleep(PAUSE)
        result[name] = statistics.median(measure(fn, repeat * 5, 10.0, warmup=5)) / nodes * 1e6
    print(f"chain of {nodes}: kiln {result['kiln']:.2f} us/node ({result['kiln_nodes']} instructions), unfused "
          f"{result['unfused']:.2f}, numpy {result['numpy']:.2f} us/call, ORT {result['ort']:.2f} us/node", flush=True)
    return result


# ---------------------------------------------------------------------------- cold start
# Each prints the seconds spent importing, loading and running once.
KILN_COLD = ("import time; t0 = time.perf_counter()\nimport numpy as np, kiln\nt1 = time.perf_counter()\n"
             "p = kiln.load({model!r}); x = np.load({x!r}); t2 = time.perf_counter()\n"
             "y = p.run([x], as_list=True)[0]; t3 = time.perf_counter()\nprint(t1 - t0, t2 - t1, t3 - t2)")
ORT_COLD = ("import time; t0 = time.perf_counter()\nimport numpy as np, onnxruntime as ort\nt1 = time.perf_counter()\n"
            "so = ort.SessionOptions(); so.intra_op_num_threads = {threads}; so.inter_op_num_threads = 1\n"
            "s = ort.InferenceSession({model!r}, so, providers=['CPUExecutionProvider'])\n"
            "x = np.load({x!r}); t2 = time.perf_counter()\n"
            "y = s.run(None, {{'x': x}})[0]; t3 = time.perf_counter()\nprint(t1 - t0, t2 - t1, t3 - t2)")


def cold_start(folder: Path, runs: int = 5) -> dict:
    """Per runtime, median seconds of a fresh process on the ResNet-18 file: (whole process,
    import, load, first run)."""
    if not (folder / "resnet18.kiln").exists():
        export_model("resnet18", folder)
    x_path = folder / "x.npy"
    np.save(x_path, MODELS["resnet18"].example(1).numpy())
    scripts = {"kiln": KILN_COLD.format(model=str(folder / "resnet18.kiln"), x=str(x_path)),
               "ort": ORT_COLD.format(model=str(folder / "resnet18.onnx"), x=str(x_path), threads=THREADS)}
    result: dict = {"runs": runs}
    # As installed: a pip install compiles each package's bytecode, so the children may write and read it (this
    # sandbox sets PYTHONDONTWRITEBYTECODE, which made every kiln cold start compile kiln's sources: ~115 ms),
    # and one untimed process per runtime writes it first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    samples: dict = {name: [] for name in scripts}
    for code in scripts.values():
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    # The runtimes' processes alternate (kiln, ORT, kiln, ...): this VM's slow phases last tens of seconds, and a
    # block of one runtime's processes then another's had the ratio move 0.57 -> 0.73 between two runs.
    for _ in range(runs):
        for name, code in scripts.items():
            time.sleep(PAUSE)
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            samples[name].append((time.perf_counter() - t, *map(float, out.stdout.split()[-3:])))
    for name in scripts:
        result[name] = tuple(statistics.median(col) for col in zip(*samples[name]))
        print(f"cold start {name}: process {result[name][0] * 1e3:.0f} ms (import, load, run: "
              + ", ".join(f"{v * 1e3:.0f}" for v in result[name][1:]) + " ms)", flush=True)
    return result


# ---------------------------------------------------------------------------- memory
def memory(folder: Path) -> dict:
    """ResNet-50 1x3x224x224: live intermediates (slot accounting) and the traced heap peak
    (tracemalloc, kernel temporaries included), with the plan's releases and without them."""
    model, xt = resnet50()
    path = kiln.save(kiln.trace(model, (xt,), check=False), folder / "resnet50.kiln")
    program = kiln.load(path)
    x = xt.numpy()
    peak, keep_all = live_bytes(program, [x])
    keeper = without_release(program)
    result = {"peak": peak, "keep_all": keep_all}
    for name, p in (("heap", program), ("heap_keep_all", keeper)):
        p.run([x])  # warm-up outside the trace
        tracemalloc.start()
        p.run([x])
        result[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(f"ResNet-50 memory: live peak {peak / 2 ** 20:.1f} MiB vs keep-all {keep_all / 2 ** 20:.1f} MiB; "
          f"heap peak {result['heap'] / 2 ** 20:.1f} MiB vs {result['heap_keep_all'] / 2 ** 20:.1f} MiB", flush=True)
    return result


# ---------------------------------------------------------------------------- report
def _ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | kiln ms | ORT ms | torch ms | kiln/ORT | kiln/torch | kiln rel. err vs torch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k, o, t = _ms(r["kiln"]), _ms(r["ort"]), _ms(r["torch"])
        lines.append(f"| {r['model']} | {r['batch']} | {k:.3f} | {o:.3f} | {t:.3f} | {k / o:.2f} | {k / t:.2f} "
                     f"| {r['err']:.1e} |")
    if rows:
        lines.append(f"\nGeometric mean of kiln/ORT over {len(rows)} rows: {geomean_ort(rows):.2f}")
    return "\n".join(lines)


def geomean_ort(rows: list[dict]) -> float:
    return math.exp(statistics.fmean(math.log(_ms(r["kiln"]) / _ms(r["ort"])) for r in rows))


def overhead_text(o: dict) -> str:
    return (f"Interpreter overhead: a chain of {o['nodes']} tiny elementwise ops (Add, Mul, Sub, Relu with [1,8] "
            f"constants) on a [1,8] float32 input; kiln as loaded runs {o['kiln_nodes']} instruction(s) (the native "
            f"extension's fused chain), unfused {o['unfused_nodes']}; onnxruntime {o['ort_nodes']} nodes after its "
            f"optimizer. Per node: kiln {o['kiln']:.2f} µs as loaded, {o['unfused']:.2f} µs unfused (one instruction "
            f"an op), numpy's own cost of the same ufunc calls in a Python loop {o['numpy']:.2f} µs (so the "
            f"interpreter adds {o['unfused'] - o['numpy']:.2f} µs), onnxruntime {o['ort']:.2f} µs.")


def cold_text(c: dict) -> str:
    def parts(v: tuple) -> str:
        return f"{v[0] * 1e3:.0f} ms (import {v[1] * 1e3:.0f}, load {v[2] * 1e3:.0f}, first run {v[3] * 1e3:.0f})"
    return (f"Cold start, ResNet-18 1x3x224x224, median of {c['runs']} fresh processes per runtime, kiln's and "
            f"onnxruntime's alternating (`python -c`: import, load the file, run once; whole process, then its parts; "
            f"bytecode cached, as a pip install leaves it, by an untimed first process): kiln {parts(c['kiln'])}; onnxruntime "
            f"{parts(c['ort'])}; kiln/ORT {c['kiln'][0] / c['ort'][0]:.2f}.")


def memory_text(m: dict) -> str:
    mib = {k: v / 2 ** 20 for k, v in m.items()}
    return (f"Memory, ResNet-50 1x3x224x224 (`--memory`): the live intermediates peak at {mib['peak']:.1f} MiB "
            f"against {mib['keep_all']:.1f} MiB if every intermediate were kept ({m['peak'] / m['keep_all']:.0%}; "
            "distinct buffers, after each instruction and before its releases; the measurement of "
            "tests/runtime/test_memory.py). Heap peak traced by tracemalloc during one run (kernel temporaries "
            f"included): {mib['heap']:.1f} MiB with the plan's releases, {mib['heap_keep_all']:.1f} MiB with "
            "none.")


def goal_lines(rows: list[dict], over: dict | None, cold: dict | None) -> str:
    lines = ["Goals (issue 5):"]
    if rows:
        slow = [f"{r['model']} b{r['batch']} ({_ms(r['kiln']) / _ms(r['torch']):.2f}x)" for r in rows
                if _ms(r["kiln"]) > _ms(r["torch"])]
        lines.append("- kiln no slower than torch eager on every row: "
                     + ("met" if not slow else "not met: slower on " + ", ".join(slow)))
        g = geomean_ort(rows)
        lines.append(f"- geometric mean of kiln/ORT at most 1.0: {g:.2f}: " + ("met" if g <= 1.0 else "not met"))
    if over:
        extra = over["unfused"] - over["numpy"]
        lines.append(f"- interpreter overhead under 0.5 µs per node beyond numpy's call: {extra:.2f} µs: "
                     + ("met" if extra < 0.5 else "not met"))
        lines.append(f"- per-node total under ORT's: kiln {over['kiln']:.2f} µs vs ORT {over['ort']:.2f} µs: "
                     + ("met" if over["kiln"] < over["ort"] else "not met"))
    if cold:
        ratio = cold["kiln"][0] / cold["ort"][0]
        lines.append(f"- cold start at most half of ORT's: kiln/ORT {ratio:.2f}: " + ("met" if ratio <= 0.5 else "not met"))
    return "\n".join(lines)


def machine() -> str:
    cpu, date = cpu_name(), utc_now()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, nproc {os.cpu_count()} (load average {load} at the end), Python {platform.python_version()}; "
            f"kiln {kiln.__version__}, numpy {np.__version__} (OpenBLAS, {THREADS} threads), onnxruntime "
            f"{ort.__version__}, onnx {onnx.__version__}, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads); {date}")


def report(args: argparse.Namespace, rows: list, over: dict | None, cold: dict | None, mem: dict | None) -> str:
    parts = [SECTION, "",
             f"`bench/runtime_bench.py`, one process (cold start: fresh ones); {machine()}. Each cell: the median of up to "
             f"{ROUNDS * math.ceil(args.repeat / ROUNDS)} runs after a warm-up (fewer once a cell passes {args.budget:g} s, at least {ROUNDS}), "
             f"timed in {ROUNDS} rounds of blocks (kiln, ORT, torch, kiln, ...) so that load from elsewhere hits "
             f"each alike, {PAUSE:g} s apart (without the pause, thread pools still spinning from the last block "
             "slowed the next one up to 30x on 2 cores). kiln: `kiln.trace(dynamic_batch=True)` + `kiln.save`, then `kiln.load(path).run`; "
             "onnxruntime: `torch.onnx.export(dynamo=False)` with a dynamic batch axis, CPU provider, "
             "`intra_op_num_threads=2`; torch: eager under `torch.inference_mode()`, `torch.set_num_threads(2)`. "
             "Models in `bench/runtime_models.py` (random weights, fp32)."]
    if rows:
        parts += ["", table(rows)]
    for item, fmt in ((over, overhead_text), (cold, cold_text), (mem, memory_text)):
        if item:
            parts += ["", fmt(item)]
    parts += ["", goal_lines(rows, over, cold), ""]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)} "
                    "('' for none)")
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--repeat", type=int, default=21, help="timed runs per cell (at most; rounded up to a multiple "
                    f"of {ROUNDS})")
    ap.add_argument("--budget", type=float, default=15.0, help="seconds per cell before stopping early")
    ap.add_argument("--nodes", type=int, default=1000, help="length of the interpreter-overhead chain (0: skip)")
    ap.add_argument("--cold", type=int, default=5, help="fresh processes per cold-start measurement (0: skip)")
    ap.add_argument("--memory", action="store_true", help="also measure ResNet-50 peak memory against keep-all")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to update, '-' to only print")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    rows, over, cold, mem, failed = [], None, None, None, []
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        for key in keys:
            try:
                rows += bench_model(key, batches, args.repeat, args.budget, folder)
            except Exception as e:  # noqa: BLE001 - one failing model must not lose the others' rows
                failed.append(f"{MODELS[key].label}: {type(e).__name__}: {e}")
                print(f"FAILED {failed[-1]}", flush=True)
        if args.nodes:
            over = interpreter_overhead(args.nodes, args.repeat, folder)
        if args.cold:
            cold = cold_start(folder, args.cold)
        if args.memory:
            mem = memory(folder)
    text = report(args, rows, over, cold, mem)
    if failed:
        text += "\nNot measured (the run failed):\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    print("\n" + text)
    if args.results != "-":
        replace_section(Path(args.results), SECTION, text)


if __name__ == "__main__":
    main()
