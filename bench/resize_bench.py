"""Resize on the CPU (issue 15): kiln's CPU kernel against onnxruntime and torch's F.interpolate, on
decoder-style upsamples (1x256x64x64 and 1x64x128x128 float32), in the same run.

Each case is one traced ``F.interpolate`` (so the mapping is the one users get): kiln runs the
traced graph with ``kiln.load`` (the CPU runtime, run loop included), onnxruntime runs the same
graph exported with ``kiln.export_onnx`` (default threads), torch runs the function eagerly
(default threads). Every output is checked against torch first. The three are timed round-robin,
``--repeat`` rounds after a warm-up, and the median of each is reported: the box is shared, so
interleaving keeps a load change from favouring one of them.

    .venv/bin/python bench/resize_bench.py            # writes "## Resize (issue 15)" to RESULTS.md
    .venv/bin/python bench/resize_bench.py --results -
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kiln  # noqa: E402
from results_md import RESULTS, cpu_name, replace_section, utc_now  # noqa: E402

TITLE = "## Resize (issue 15)"
CASES = [  # (label, input shape, F.interpolate kwargs)
    ("bilinear x2", (1, 256, 64, 64), dict(scale_factor=2, mode="bilinear")),
    ("nearest x2", (1, 256, 64, 64), dict(scale_factor=2, mode="nearest")),
    ("bilinear x2, align_corners", (1, 256, 64, 64), dict(scale_factor=2, mode="bilinear", align_corners=True)),
    ("bicubic x2", (1, 256, 64, 64), dict(scale_factor=2, mode="bicubic")),
    ("bilinear x0.5, antialias", (1, 256, 64, 64), dict(scale_factor=0.5, mode="bilinear", antialias=True)),
    ("bilinear x2", (1, 64, 128, 128), dict(scale_factor=2, mode="bilinear")),
    ("nearest x2", (1, 64, 128, 128), dict(scale_factor=2, mode="nearest")),
    ("bilinear to 97x61", (1, 64, 128, 128), dict(size=(97, 61), mode="bilinear")),
]


def measure(label: str, shape: tuple, kwargs: dict, repeat: int, work: Path) -> dict:
    import onnxruntime as ort
    import torch
    import torch.nn.functional as F

    fn = lambda x: F.interpolate(x, **kwargs)  # noqa: E731
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    graph = kiln.trace(fn, x)
    prog = kiln.load(graph)
    path = work / "resize.onnx"
    kiln.export_onnx(graph, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = x.numpy()
    name = sess.get_inputs()[0].name
    runs = {"kiln": lambda: prog.run([feed], as_list=True)[0],
            "onnxruntime": lambda: sess.run(None, {name: feed})[0],
            "torch": lambda: fn(x).numpy()}
    with torch.no_grad():
        want = fn(x).numpy()
    errors = {}
    for k, f in runs.items():
        got = f()
        assert got.shape == want.shape, (k, got.shape, want.shape)
        errors[k] = float(np.abs(got - want).max())
    times = {k: [] for k in runs}
    cpu = []  # kiln's own thread: what one core of an idle box would take
    for _ in range(repeat):
        for k, f in runs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            f()
            times[k].append(time.perf_counter() - t0)
            if k == "kiln":
                cpu.append(time.thread_time() - c0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med["kiln cpu"] = statistics.median(cpu) * 1e3
    return {"label": label, "shape": shape, "out": want.shape, "ms": med, "err": errors,
            "ops": [n.op for n in graph.nodes if n.op not in ("Identity",)]}


def table(rows: list, load: tuple, repeat: int) -> str:
    import onnxruntime as ort
    import torch

    lines = [TITLE, "",
             "CPU Resize: kiln's numpy kernel (one thread) against onnxruntime and torch (their default "
             f"threads), wall-clock median of {repeat} interleaved runs, float32; 'kiln cpu' is the median "
             "time kiln's thread was on a core (what it takes when it has one to itself: the box is shared); "
             "kiln's output checked against torch (max |diff| in the last column). Written by "
             "bench/resize_bench.py.", "",
             "| case | input -> output | kiln ms | kiln cpu ms | onnxruntime ms | torch ms | kiln / ort | "
             "max abs diff vs torch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['label']} | {'x'.join(map(str, r['shape']))} -> {'x'.join(map(str, r['out']))} | "
                     f"{ms['kiln']:.2f} | {ms['kiln cpu']:.2f} | {ms['onnxruntime']:.2f} | {ms['torch']:.2f} | "
                     f"{ms['kiln'] / ms['onnxruntime']:.2f} | {r['err']['kiln']:.1e} |")
    # Bicubic apart: onnxruntime's cubic path is an outlier (tens of times torch's) that would carry a mean.
    usual = [r for r in rows if not r["label"].startswith("bicubic")]
    geo = lambda k: float(np.exp(np.mean([np.log(r["ms"][k] / r["ms"]["onnxruntime"]) for r in usual])))  # noqa: E731
    lines += ["", f"Geometric mean over the nearest and bilinear cases: kiln's wall clock {geo('kiln'):.2f}x "
              f"onnxruntime's, kiln's CPU time {geo('kiln cpu'):.2f}x onnxruntime's wall clock (onnxruntime runs "
              f"on both cores, kiln on one), torch {geo('torch'):.2f}x. Bicubic: kiln "
              + ", ".join(f"{r['ms']['kiln cpu'] / r['ms']['onnxruntime']:.2f}x" for r in rows if r not in usual)
              + " (CPU time against onnxruntime's wall clock). Every output matches torch (float32 rounding; "
              "torch's own float32 coordinates account for the 1e-5 of the non-integer scales). Wall clocks on "
              "this shared box move by 2x from run to run; the CPU column is kiln's steady number."]
    lines += ["", f"Machine: {cpu_name()}, nproc {os.cpu_count()} (load average {load[0]} at the start, {load[1]} "
              f"at the end: the box is shared), Python {platform.python_version()}, numpy {np.__version__}, "
              f"onnxruntime {ort.__version__}, torch {torch.__version__}; {utc_now()}."]
    return "\n".join(lines) + "\n"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def main(argv: list) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--results", default=str(RESULTS), help="RESULTS.md to update ('-': print only)")
    args = p.parse_args(argv)
    start = _load()
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for label, shape, kwargs in CASES:
            rows.append(measure(label, shape, kwargs, args.repeat, Path(d)))
            r = rows[-1]
            print(f"{label:28s} {shape}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in r["ms"].items()), flush=True)
    body = table(rows, (start, _load()), args.repeat)
    print("\n" + body)
    if args.results != "-":
        replace_section(Path(args.results), TITLE, body)
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main(sys.argv[1:])
