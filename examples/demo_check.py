"""The two torch-side steps of ``make demo`` (see the Makefile):

    python examples/demo_check.py prepare --shape 1x3x32x32 -o build/demo/x.npy
    kiln export examples/models.py:SmallCNN -o build/demo/model.kiln --input x:1x3x32x32 --dynamic-batch
    kiln run build/demo/model.kiln --input x=build/demo/x.npy -o build/demo/out.npz --repeat 200 > build/demo/run.txt
    python examples/demo_check.py check --model examples/models.py:SmallCNN --input build/demo/x.npy \\
        --output build/demo/out.npz --kiln-log build/demo/run.txt

``check`` builds the same model (same class, same seed: the weights are those kiln exported),
runs torch eager on the same input, compares with what ``kiln run`` wrote, and prints kiln's
latency (parsed from ``kiln run --repeat``) next to torch eager's on the same number of runs:
min, median, p90 and max of each, and their ratio. Models with one float input only.

Other work on the machine only ever adds time, so the minimum of many runs is the estimate of
a runtime's own cost that load disturbs least: the headline ratio is of the minimums (the
medians' ratio is printed beside it). When a runtime's median or p90 is far above its minimum,
the machine was busy while it was timed (kiln and torch are timed one after the other, so load
that comes and goes hits them differently): the summary says so instead of letting a ratio of
disturbed medians (once ``kiln / torch 105x``: median 60 ms against a minimum of 0.40 ms) stand
as the result.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RTOL, ATOL = 1e-4, 1e-5
# A runtime's timings count as disturbed past these ratios to its minimum. On an idle machine the median of
# a few hundred runs sits within ~1.2x of the minimum and the p90 within ~1.5x; a busy one moves both far more.
BUSY_MEDIAN, BUSY_P90 = 1.5, 3.0


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


def ratio(a: float, b: float) -> float:
    """a / b, where b may be a time printed as 0.0000 ms."""
    return a / b if b > 0 else float("inf")


@dataclass(frozen=True)
class Latency:
    """One runtime's timings over ``runs`` runs, in ms."""
    runs: int
    min: float
    median: float
    p90: float
    max: float

    @classmethod
    def of(cls, ms: np.ndarray) -> Latency:
        ms = np.asarray(ms, dtype=np.float64)
        return cls(len(ms), float(ms.min()), float(np.median(ms)), float(np.percentile(ms, 90)), float(ms.max()))

    def disturbance(self) -> str | None:
        """Why these timings look disturbed by other work (median or p90 far above the minimum), or None."""
        spread = [f"{what} is {ratio(value, self.min):.3g}x its minimum"
                  for what, value, limit in (("median", self.median, BUSY_MEDIAN), ("p90", self.p90, BUSY_P90))
                  if value > limit * self.min]
        return " and ".join(spread) or None


def torch_latency(model, x, runs: int, warmup: int = 10) -> Latency:
    import torch

    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        times = np.empty(runs)
        for i in range(runs):
            start = time.perf_counter()
            model(x)
            times[i] = time.perf_counter() - start
    return Latency.of(times * 1e3)


_LATENCY_LINE = re.compile(r"latency over (\d+) runs .*?median ([\d.]+) ms, p90 ([\d.]+) ms, "
                           r"min ([\d.]+) ms, mean [\d.]+ ms, max ([\d.]+) ms")


def kiln_latency(text: str, source: str = "kiln run's output") -> Latency:
    """The timings of the line ``kiln run --repeat N`` prints (kiln.runtime.cli.format_latency)."""
    m = _LATENCY_LINE.search(text)
    if m is None:
        raise SystemExit(f"no latency line (latency over N runs ...: median, p90, min, mean, max) in {source}: "
                         "run `kiln run ... --repeat N` into it, with the kiln of this checkout")
    runs, median, p90, low, high = m.groups()
    return Latency(int(runs), float(low), float(median), float(p90), float(high))


def latency_report(kiln: Latency, eager: Latency) -> list[str]:
    """The rows of min/median/p90/max for both runtimes, the ratio of the minimums (the least disturbed
    runs) with the medians' beside it, and a warning when either runtime's timings are spread wide."""
    lines = [f"  {'ms':<12}  {'min':>9}  {'median':>9}  {'p90':>9}  {'max':>9}"]
    for label, t in (("kiln run", kiln), ("torch eager", eager)):
        lines.append(f"  {label:<12}  {t.min:9.4f}  {t.median:9.4f}  {t.p90:9.4f}  {t.max:9.4f}")
    lines.append(f"  kiln / torch  {ratio(kiln.min, eager.min):.2f}x by the minimums (the runs least disturbed by "
                 f"other work; by the medians {ratio(kiln.median, eager.median):.2f}x)")
    busy = [f"{label}'s {why}" for label, t in (("kiln", kiln), ("torch", eager)) if (why := t.disturbance())]
    if busy:
        lines.append(f"warning   the machine was busy, so timings vary: {'; '.join(busy)}.")
        lines.append("          Compare the minimums, not the medians, or rerun on an idle machine: kiln and torch")
        lines.append("          were timed one after the other, so load that came and went hit them differently.")
    return lines


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
    kiln = kiln_latency(Path(args.kiln_log).read_text(), args.kiln_log)
    eager = torch_latency(model, torch.from_numpy(x), kiln.runs)
    print(f"latency   {kiln.runs} runs each on {list(x.shape)}, {torch.get_num_threads()} torch threads")
    print("\n".join(latency_report(kiln, eager)))
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
