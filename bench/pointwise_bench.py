"""1x1 convolutions of a batch as one sgemm call or a call per sample (issue 21).

A 1x1 stride-1 conv through the GEMM multiplies each sample's [C, H*W] input by the [M, C] weights. Until this
bench, ``native.gemm_conv2d`` made one sgemm call per sample (each split over the pool's threads by columns); now
a batch is one call (``native.BATCHED_POINTWISE``), the weights shared and the pool splitting the samples. Both
give the same bits (tests/runtime/test_native_gemm.py). Measured here, in one process, the settings alternating:

- each pointwise conv of the MobileNetV3-Small-style model (bench/runtime_models.py) at batch 8, with its bias
  and ReLU: the call per sample, the batched call, and the direct kernel (``direct_conv2d``, which takes the
  convs over at most ``DIRECT_MAX_POINTWISE`` input channels);
- 1x1 convs at batches 2, 3 and 5 (which do not all divide among the threads) as kiln runs them against a call
  per sample, MobileNetV3-style's and ResNet-50's (whose products are past ``BATCHED_POINTWISE_MACS``);
- the whole model (random weights) at batches 1, 8 and 32: kiln with the batched call, kiln with a call per
  sample, and onnxruntime (``intra_op_num_threads`` = the threads), in rounds.

    python bench/pointwise_bench.py [--threads 2] [--rounds 3] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SECTION = "## 1x1 convolutions of a batch: one sgemm call (issue 21)"
# MobileNetV3-Small-style's pointwise convs (input channels, output channels, map side), batch 8
LAYERS = ((16, 16, 56), (16, 32, 56), (32, 24, 28), (24, 48, 28), (48, 24, 28), (24, 64, 28), (64, 40, 14),
          (40, 96, 14), (96, 40, 14), (40, 240, 14))
BATCH = 8


def median_us(fn, arg, budget: float = 0.4, least: int = 20) -> float:
    for _ in range(3):
        fn(arg)
    times: list = []
    end = time.perf_counter() + budget
    while len(times) < least or time.perf_counter() < end:
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def gemm_kernels(w: np.ndarray, b: np.ndarray, x: np.ndarray, names: tuple) -> dict:
    """name -> (the GEMM conv kernel with its weights packed, BATCHED_POINTWISE for it): off, then on."""
    from kiln.ir.ops.nn import make_window
    from kiln.runtime.kernels.cpu import native
    kernels = {}
    for name, batched in zip(names, (False, True)):
        native.BATCHED_POINTWISE = batched
        kernel = native.gemm_conv2d(w, make_window((1, 1)), b, (1, 0.0, 0.0))
        kernel(x)
        kernel(x)
        native.wait_packed()
        kernels[name] = (kernel, batched)
    native.BATCHED_POINTWISE = True
    return kernels


def alternate(kernels: dict, x: np.ndarray, rounds: int) -> tuple:
    """(name -> per-round median us, name -> answer), the kernels alternating in rounds, each under its setting."""
    from kiln.runtime.kernels.cpu import native
    times: dict = {k: [] for k in kernels}
    answers = {}
    for _ in range(rounds):
        for name, (kernel, batched) in kernels.items():
            native.BATCHED_POINTWISE = batched
            times[name].append(median_us(kernel, x))
            answers[name] = kernel(x)
    native.BATCHED_POINTWISE = True
    return times, answers


def layers(rounds: int) -> list:
    from kiln.ir.ops.nn import make_window
    from kiln.runtime.kernels.cpu import native
    rng = np.random.default_rng(0)
    window = make_window((1, 1))
    rows = []
    for c, m, side in LAYERS:
        x = rng.standard_normal((BATCH, c, side, side)).astype(np.float32)
        w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
        b = rng.standard_normal(m).astype(np.float32)
        kernels = gemm_kernels(w, b, x, ("per sample", "batched"))
        kernels["direct"] = (native.direct_conv2d(w, window, 1, b, (1, 0.0, 0.0)), True)
        times, answers = alternate(kernels, x, rounds)
        assert np.array_equal(answers["per sample"], answers["batched"]), (c, m, side)
        row = {"shape": (c, m, side), **{k: statistics.median(v) for k, v in times.items()},
               "direct_taken": c <= native.DIRECT_MAX_POINTWISE}
        rows.append(row)
        print(f"{c}->{m} @{side}: " + ", ".join(f"{k} {row[k]:.1f} us" for k in kernels), flush=True)
    return rows


# Batches that do not divide among the threads, and products past BATCHED_POINTWISE_MACS (ResNet-50's 1x1 convs)
ODD = ((40, 240, 14), (48, 24, 28), (64, 256, 56), (256, 64, 56))
ODD_BATCHES = (2, 3, 5)


def odd_batches(rounds: int) -> list:
    """kiln's 1x1 conv as it runs (the batched call where it takes it) against a call per sample."""
    rng = np.random.default_rng(1)
    rows = []
    for c, m, side in ODD:
        w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
        b = rng.standard_normal(m).astype(np.float32)
        for batch in ODD_BATCHES:
            x = rng.standard_normal((batch, c, side, side)).astype(np.float32)
            times, answers = alternate(gemm_kernels(w, b, x, ("per sample", "as run")), x, rounds)
            assert np.array_equal(answers["per sample"], answers["as run"]), (c, m, side, batch)
            row = {"shape": (c, m, side), "batch": batch, **{k: statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(f"{c}->{m} @{side} b{batch}: per sample {row['per sample']:.1f} us, as run {row['as run']:.1f} us",
                  flush=True)
    return rows


def models(folder: Path, threads: int, rounds: int) -> list:
    import kiln
    from kiln.runtime.kernels.cpu import native
    import onnxruntime as ort

    from runtime_bench import export_model
    from runtime_models import MODELS
    _, kiln_path, onnx_path = export_model("mobilenet", folder)
    program = kiln.load(kiln_path, threads=threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    rows = []
    for batch in (1, 8, 32):
        x = MODELS["mobilenet"].example(batch).numpy()
        ref = session.run(None, {name: x})[0]
        fns = {}
        for label, batched in (("kiln, one call", True), ("kiln, a call per sample", False)):
            def run(a, batched=batched):
                native.BATCHED_POINTWISE = batched
                return program.run([a], as_list=True)[0]
            fns[label] = run
        fns["onnxruntime"] = lambda a: session.run(None, {name: a})[0]
        for label, fn in fns.items():
            got = fn(x)
            err = float(np.abs(got - ref).max() / max(1e-30, float(np.abs(ref).max())))
            assert err < 1e-4, (label, batch, err)
        times: dict = {k: [] for k in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                time.sleep(0.1)
                times[label].append(median_us(fn, x, budget=1.0, least=10) / 1e3)
        native.BATCHED_POINTWISE = True
        row = {"batch": batch, **{k: statistics.median(v) for k, v in times.items()}}
        rows.append(row)
        print(f"MobileNetV3-Small-style b{batch}: " + ", ".join(f"{k} {row[k]:.3f} ms" for k in fns), flush=True)
    return rows


def report(layer_rows: list, odd_rows: list, model_rows: list, threads: int, rounds: int) -> str:
    import onnxruntime

    from results_md import cpu_name, utc_now
    lines = [SECTION, "",
             f"`bench/pointwise_bench.py --threads {threads} --rounds {rounds}`, one process, the settings "
             "alternating in rounds; a cell is the median over rounds of each round's median. Each pointwise conv "
             "of the MobileNetV3-Small-style model at batch 8 with its bias and ReLU (us), then the whole model "
             "(ms) against onnxruntime.", "",
             "| conv (in -> out, map) | a call per sample | one batched call | direct kernel | batched / per sample |",
             "|---|---:|---:|---:|---:|"]
    for r in layer_rows:
        c, m, side = r["shape"]
        direct = f"{r['direct']:.1f}" + (" (its kernel at batch 1)" if r["direct_taken"] else "")
        lines.append(f"| {c} -> {m}, {side}x{side} | {r['per sample']:.1f} | {r['batched']:.1f} | {direct} | "
                     f"{r['batched'] / r['per sample']:.2f} |")
    lines += ["", f"Batches of 2, 3 and 5 (us; {threads} threads: as many samples as divide among them go in the "
              "batched call, the rest a call each; products past `BATCHED_POINTWISE_MACS` a call each):", "",
              "| conv (in -> out, map) | batch | a call per sample | as kiln runs it | ratio |",
              "|---|---:|---:|---:|---:|"]
    for r in odd_rows:
        c, m, side = r["shape"]
        lines.append(f"| {c} -> {m}, {side}x{side} | {r['batch']} | {r['per sample']:.1f} | {r['as run']:.1f} | "
                     f"{r['as run'] / r['per sample']:.2f} |")
    lines += ["", "| MobileNetV3-Small-style | kiln, one call ms | kiln, a call per sample ms | onnxruntime ms | "
              "kiln/onnxruntime |", "|---|---:|---:|---:|---:|"]
    for r in model_rows:
        one = r["kiln, one call"]
        lines.append(f"| batch {r['batch']} | {one:.3f} | {r['kiln, a call per sample']:.3f} | "
                     f"{r['onnxruntime']:.3f} | {one / r['onnxruntime']:.2f} |")
    lines += ["", f"Machine: {cpu_name()}, {threads} threads; numpy {np.__version__}, onnxruntime "
              f"{onnxruntime.__version__}; {utc_now()}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default=None, help="write the section to this file ('-': print only; default: "
                    "bench/RESULTS.md)")
    args = ap.parse_args(argv)
    from kiln.runtime.kernels.cpu import native
    from kiln.runtime.threads import _set_kernel_threads
    if not native.has_sgemm():
        print("the extension's sgemm does not run here (no AVX-512F): nothing to compare", file=sys.stderr)
        return 1
    _set_kernel_threads(args.threads)
    layer_rows = layers(args.rounds)
    odd_rows = odd_batches(args.rounds)
    with tempfile.TemporaryDirectory() as d:
        model_rows = models(Path(d), args.threads, args.rounds)
    from results_md import publish
    publish(args.results, SECTION, report(layer_rows, odd_rows, model_rows, args.threads, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
