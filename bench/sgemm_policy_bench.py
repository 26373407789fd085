"""Whether kiln's own sgemm should run the products where numpy's OpenBLAS has AVX-512 kernels (issue 21).

The CPU runtime's convolutions (GEMM, Winograd), Linear layers and attention products run on the extension's
AVX-512 sgemm where ``native.sgemm_wanted`` says so. This measures the reference models (bench/runtime_models.py,
random weights) with it on and off (``KILN_NATIVE_SGEMM=1`` / ``0``) and numpy's OpenBLAS on its AVX-512
``SkylakeX`` kernels in both (``OPENBLAS_CORETYPE=SkylakeX``: what OpenBLAS picks on the CPUs it knows with
AVX-512, and what ``import kiln`` asks for on a Zen 5). Each setting runs in its own child processes, the
settings alternating in rounds; a cell is the median over rounds of each child's median per run. The two
settings' answers are compared (largest difference relative to the largest output).

    python bench/sgemm_policy_bench.py [--models mlp,resnet18,...] [--threads N] [--rounds 3] [--results FILE|-]
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

import numpy as np

HERE = Path(__file__).resolve().parent
SECTION = "## kiln's sgemm or numpy's AVX-512 OpenBLAS (issue 21)"
ROWS = (("mlp", 32), ("resnet18", 1), ("resnet18", 8), ("bert2", 1), ("bert4", 1), ("vit", 1), ("mobilenet", 1))
SETTINGS = {"kiln's sgemm": "1", "numpy's OpenBLAS": "0"}
BUDGET = 2.0  # seconds of runs per row and child


def child(folder: Path, rows: list, threads: int) -> dict:
    import kiln
    from kiln.runtime.kernels.cpu import native
    from kiln.runtime.threads import blas_kernels
    out: dict = {"times": {}, "sgemm": bool(native.has_sgemm()), "blas": blas_kernels(), "sums": {}}
    for key, batch in rows:
        program = kiln.load(folder / f"{key}.kiln", threads=threads)
        x = np.load(folder / f"{key}_b{batch}.npy")
        y = program.run([x], as_list=True)[0]
        np.save(folder / f"{key}_b{batch}_{os.environ['KILN_NATIVE_SGEMM']}.npy", y)
        for _ in range(2):
            program.run([x])
        times: list = []
        end = time.perf_counter() + BUDGET
        while len(times) < 5 or (time.perf_counter() < end and len(times) < 200):
            t = time.perf_counter()
            program.run([x])
            times.append(time.perf_counter() - t)
        out["times"][f"{key} b{batch}"] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(dict.fromkeys(k for k, _ in ROWS)), help="comma-separated keys")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="kiln's threads= and OpenBLAS's (default: the cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default=None, help="bench/RESULTS.md's section (default), FILE, or - (printed only)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    rows = [(k, b) for k, b in ROWS if k in keys]
    if args.child:
        print(json.dumps(child(Path(args.child), rows, args.threads)))
        return 0
    sys.path.insert(0, str(HERE))
    import kiln
    from runtime_models import MODELS
    samples: dict = {}
    info: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for key in dict.fromkeys(k for k, _ in rows):
            ref = MODELS[key]
            kiln.save(kiln.trace(ref.build(), (ref.example(2),), dynamic_batch=True, check=False),
                      folder / f"{key}.kiln")
            for k, batch in rows:
                if k == key:
                    np.save(folder / f"{key}_b{batch}.npy", ref.example(batch).numpy())
        env_base = {k: v for k, v in os.environ.items() if k not in ("KILN_NATIVE_SGEMM", "OPENBLAS_CORETYPE")}
        for r in range(args.rounds):
            for name, flag in SETTINGS.items():
                env = dict(env_base, KILN_NATIVE_SGEMM=flag, OPENBLAS_CORETYPE="SkylakeX",
                           OPENBLAS_NUM_THREADS=str(args.threads))
                time.sleep(0.5)
                proc = subprocess.run([sys.executable, __file__, "--child", str(folder), "--models", args.models,
                                       "--threads", str(args.threads)], capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr)
                    return 1
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                info[name] = (got["sgemm"], got["blas"])
                for row, t in got["times"].items():
                    samples.setdefault((row, name), []).append(t)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        diffs = {}
        for key, batch in rows:
            a, b = (np.load(folder / f"{key}_b{batch}_{flag}.npy") for flag in SETTINGS.values())
            diffs[f"{key} b{batch}"] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    names = list(SETTINGS)
    lines = [SECTION, "", "| model | " + " | ".join(f"{n} ms" for n in names)
             + " | OpenBLAS / sgemm | answers' difference |",
             "|---|" + "---:|" * len(names) + "---:|---:|"]
    ratios = []
    for key, batch in rows:
        row = f"{key} b{batch}"
        cells = [statistics.median(samples[(row, n)]) for n in names]
        ratios.append(cells[1] / cells[0])
        lines.append(f"| {MODELS[key].label} b{batch} | " + " | ".join(f"{c * 1e3:.3f}" for c in cells)
                     + f" | {cells[1] / cells[0]:.2f} | {diffs[row]:.1e} |")
    geo = float(np.exp(np.mean(np.log(ratios))))
    from results_md import cpu_name, utc_now
    lines += ["", f"Geometric mean OpenBLAS / sgemm: {geo:.2f}. Children's settings: "
              + "; ".join(f"{n}: extension's sgemm {'on' if s else 'off'}, OpenBLAS kernels {b}"
                          for n, (s, b) in info.items())
              + f". {args.threads} threads (kiln's threads= and OPENBLAS_NUM_THREADS), median over {args.rounds} "
              f"rounds of each child's median. Machine: {cpu_name()}, nproc {os.cpu_count()}, Python "
              f"{platform.python_version()}, numpy {np.__version__}; {utc_now()}."]
    from results_md import publish
    publish(args.results, SECTION, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
