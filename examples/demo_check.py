"""The two torch-side steps of ``make demo`` (see the Makefile):

    python examples/demo_check.py prepare --shape 1x3x32x32 -o build/demo/x.npy
    kiln export examples/models.py:SmallCNN -o build/demo/model.kiln --input x:1x3x32x32 --dynamic-batch
    kiln run build/demo/model.kiln --input x=build/demo/x.npy -o build/demo/out.npz --repeat 200 > build/demo/run.txt
    python examples/demo_check.py check --model examples/models.py:SmallCNN --input build/demo/x.npy \\
        --output build/demo/out.npz --kiln-log build/demo/run.txt

``check`` builds the same model (same class, same seed: the weights are those kiln exported),
runs torch eager on the same input, compares with what ``kiln run`` wrote, and prints kiln's
latency (parsed from ``kiln run --repeat``) next to torch eager's on the same number of runs.
Models with one float input only.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path

import numpy as np

RTOL, ATOL = 1e-4, 1e-5


def prepare(args: argparse.Namespace) -> int:
    shape = tuple(int(d) for d in args.shape.split("x"))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.save(args.o, x)
    print(f"input     {args.o}: float32{list(shape)}")
    return 0


def load_model(target: str):
    """``path.py:ATTR`` built the way ``kiln export`` builds it: a class with no arguments in eval
    mode, a factory called, or an instance."""
    import torch

    path, _, attr = target.rpartition(":")
    spec = importlib.util.spec_from_file_location("demo_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    obj = getattr(module, attr)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return obj().eval()
    return obj() if not isinstance(obj, torch.nn.Module) else obj


def torch_latency(model, x, runs: int, warmup: int = 10) -> np.ndarray:
    import torch

    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        times = np.empty(runs)
        for i in range(runs):
            start = time.perf_counter()
            model(x)
            times[i] = time.perf_counter() - start
    return times * 1e3


def kiln_latency(log: Path) -> tuple[int, float, float]:
    """(runs, median ms, p90 ms) from the line ``kiln run --repeat`` prints."""
    m = re.search(r"latency over (\d+) runs .*?median ([\d.]+) ms, p90 ([\d.]+) ms", log.read_text())
    if m is None:
        raise SystemExit(f"no latency line in {log}: run `kiln run ... --repeat N` into it")
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


def check(args: argparse.Namespace) -> int:
    import torch

    model = load_model(args.model)
    x = np.load(args.input)
    with torch.inference_mode():
        want = model(torch.from_numpy(x))
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    with np.load(args.output) as f:
        got = [f[k] for k in f.files]
    ok = len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want):
        w = w.numpy()
        ok = ok and g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL)
        worst = max(worst, float(np.abs(g - w).max())) if g.shape == w.shape else float("inf")
    verdict = "matches" if ok else "DOES NOT match"
    print(f"check     kiln run output {verdict} torch eager (max abs diff {worst:.2e}; rtol {RTOL}, atol {ATOL})")
    runs, median, p90 = kiln_latency(Path(args.kiln_log))
    eager = torch_latency(model, torch.from_numpy(x), runs)
    print(f"latency   median of {runs} runs on {list(x.shape)}, {torch.get_num_threads()} torch threads")
    print(f"  kiln run      {median:8.4f} ms  (p90 {p90:.4f} ms)")
    print(f"  torch eager   {np.median(eager):8.4f} ms  (p90 {np.percentile(eager, 90):.4f} ms)")
    print(f"  kiln / torch  {median / np.median(eager):8.3g}x")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="write a seeded random float32 input")
    p.add_argument("--shape", required=True, help="sizes joined by 'x', e.g. 1x3x32x32")
    p.add_argument("-o", required=True, help="the .npy file to write")
    p.set_defaults(run=prepare)
    c = sub.add_parser("check", help="compare kiln run's output with torch eager and print both latencies")
    c.add_argument("--model", required=True, help="path.py:ATTR, as given to kiln export")
    c.add_argument("--input", required=True, help="the .npy input given to kiln run")
    c.add_argument("--output", required=True, help="the .npz kiln run wrote")
    c.add_argument("--kiln-log", required=True, help="what kiln run --repeat printed")
    c.set_defaults(run=check)
    args = parser.parse_args()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
