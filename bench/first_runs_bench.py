"""The first runs of a fresh process (issue 21): what a server's first requests or a one-shot `kiln run` meet.

Each model (bench/runtime_models.py, random weights, batch 1) is exported once; then fresh processes load its
.kiln file and time runs 1, 2 and 3 and the median of the next ones, with the weights packed on the background
thread (``native.PACK_IN_BACKGROUND``, the default) and on the calling thread (as before), the two alternating so
this VM's slow phases hit both alike. A cell is the median over the processes.

    python bench/first_runs_bench.py [--models resnet18,bert4,vit] [--processes 4] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTION = "## The first runs of a fresh process (issue 21)"
CHILD = """
import json, sys, time
import numpy as np, kiln
from kiln.runtime.kernels.cpu import native
native.PACK_IN_BACKGROUND = sys.argv[2] == "1"
program = kiln.load(sys.argv[1])
x = np.load(sys.argv[3])
times = []
for _ in range(12):
    t = time.perf_counter()
    program.run([x])
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""
MODES = {"background": "1", "calling thread": "0"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,bert4,vit", help="comma-separated keys of bench/runtime_models.py")
    ap.add_argument("--processes", type=int, default=4, help="fresh processes per model and mode (default 4)")
    ap.add_argument("--results", default=None, help="bench/RESULTS.md's section (default), FILE, or - (printed only)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import numpy as np

    import kiln
    from results_md import cpu_name, publish, utc_now
    from runtime_models import MODELS
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            ref = MODELS[key]
            path = kiln.save(kiln.trace(ref.build(), (ref.example(2),), dynamic_batch=True, check=False),
                             Path(tmp) / f"{key}.kiln")
            x_path = Path(tmp) / f"{key}.npy"
            np.save(x_path, ref.example(1).numpy())
            samples: dict = {mode: [] for mode in MODES}
            for _ in range(args.processes):
                for mode, flag in MODES.items():
                    time.sleep(0.3)
                    out = subprocess.run([sys.executable, "-c", CHILD, str(path), flag, str(x_path)],
                                         capture_output=True, text=True, check=True)
                    samples[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for mode, runs in samples.items():
                cells = [statistics.median(r[i] for r in runs) * 1e3 for i in range(3)]
                steady = statistics.median(t for r in runs for t in r[5:]) * 1e3
                rows.append((ref.label, mode, *cells, steady))
                print(f"{key} {mode}: " + ", ".join(f"{c:.1f}" for c in cells) + f", steady {steady:.1f} ms",
                      flush=True)
    lines = [SECTION, "",
             f"`bench/first_runs_bench.py`: fresh processes, batch 1, {args.processes} per model and mode, the modes "
             "alternating; a cell is the median over the processes. Weights packed on the background thread (the "
             "default) or on the calling thread (the code before it).", "",
             "| model | packing | run 1 ms | run 2 ms | run 3 ms | runs 6-12 ms |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {label} | {mode} | {r1:.1f} | {r2:.1f} | {r3:.1f} | {st:.1f} |"
              for label, mode, r1, r2, r3, st in rows]
    lines += ["", f"Machine: {cpu_name()}, nproc {os.cpu_count()}; {utc_now()}."]
    publish(args.results, SECTION, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
