"""The CPU options the runtime work was asked to measure and keep only if they win (issue 21): numexpr for fused
elementwise chains, and other BLAS libraries (MKL, BLIS) against numpy's OpenBLAS and kiln's own sgemm.

Two parts, both on this machine, every candidate in the same run:

- ``elementwise``: chains as the models have them, run by kiln as loaded (``kiln.load(path).run``: the native
  extension's one-pass chain where the chain's ops are its own, numpy's ufuncs op by op otherwise), by numexpr
  (the chain as one expression, compiled once, at 1 and 2 threads) and by numpy's ufuncs in sequence. Each
  answer is checked against a float64 reference (max abs error).
- ``gemm``: float32 products of the models' shapes, [M, K] x [K, N], one operand a constant weight (a Linear's
  [K, N]; a conv's [M, K], as kiln runs a conv as a GEMM: out channels x C*kh*kw x output positions):
  kiln's sgemm (the weight packed once, as a loaded Linear or Conv has it), numpy's matmul (OpenBLAS, on its
  AVX2 ``Haswell`` kernels and on its AVX-512 ``SkylakeX`` ones, set by ``OPENBLAS_CORETYPE``), MKL's
  ``cblas_sgemm`` (pip ``mkl``, through ctypes) and BLIS (pip ``blis``, cython-blis's ``gemm``), at 1 and 2
  threads. Each library runs in its own child process per thread count (its thread pool alone: OpenBLAS's and
  MKL's OpenMP threads spin after a call), the children alternating in rounds; a cell is the median over rounds
  of each child's median.

    pip install numexpr mkl blis        # in kiln's environment
    python bench/cpu_options_bench.py [--parts elementwise,gemm] [--rounds 3] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SECTION = "## CPU options measured: numexpr, MKL, BLIS (issue 21)"
BUDGET = 0.4  # seconds of calls per cell and child
# column -> (child kind, environment): numpy's OpenBLAS twice, on the AVX2 kernels this sandbox sets
# (OPENBLAS_CORETYPE=Haswell) and on its AVX-512 ones (what it picks on CPUs it knows, and what `import kiln` asks
# for on a Zen 5)
LIBS = {"kiln": ("kiln", {}), "OpenBLAS Haswell": ("openblas", {"OPENBLAS_CORETYPE": "Haswell"}),
        "OpenBLAS SkylakeX": ("openblas", {"OPENBLAS_CORETYPE": "SkylakeX"}), "MKL": ("mkl", {}), "BLIS": ("blis", {})}
KINDS = ("kiln", "openblas", "mkl", "blis")
# (label, M, K, N, constant side): a Linear's tokens x in x out, its [K, N] weight constant ("right"); or a conv as
# kiln runs it as a GEMM, out channels x C*kh*kw x output positions, its [M, K] weight constant ("left")
SHAPES = (
    ("ViT-Tiny FFN in, b1 (17 tokens)", 17, 192, 768, "right"),
    ("MLP 784-512 b32", 32, 784, 512, "right"),
    ("BERT hidden 128 FFN in, b1", 128, 128, 512, "right"),
    ("BERT hidden 768 FFN in, b1", 128, 768, 3072, "right"),
    ("BERT hidden 768 FFN in, b8", 1024, 768, 3072, "right"),
    ("ResNet-18 3x3 64ch 56x56 conv as GEMM, b1", 64, 576, 3136, "left"),
    ("ResNet-18 3x3 128ch s2 28x28 conv as GEMM, b1", 128, 576, 784, "left"),
    ("ResNet-18 3x3 256ch 14x14 conv as GEMM, b1", 256, 2304, 196, "left"),
    ("ResNet-18 3x3 512ch 7x7 conv as GEMM, b1", 512, 4608, 49, "left"),
)


def timed(fn, budget: float = BUDGET, least: int = 5, most: int = 2000) -> float:
    """Median seconds of ``fn()`` over the calls that fit ``budget`` (after two warm-up calls)."""
    fn(), fn()
    times: list = []
    end = time.perf_counter() + budget
    while len(times) < least or (time.perf_counter() < end and len(times) < most):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ----------------------------------------------------------------------------- GEMM children
def _mkl_sgemm():
    """MKL's cblas_sgemm from the pip ``mkl`` wheel's libmkl_rt (row-major, no transposes)."""
    paths = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if not paths:
        raise RuntimeError("no libmkl_rt in this environment: pip install mkl")
    lib = ctypes.CDLL(paths[0])
    f = lib.cblas_sgemm
    f.restype = None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                  ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                  ctypes.c_int]
    version = ctypes.create_string_buffer(256)
    lib.mkl_get_version_string(version, 256)

    def run(a, b, c):
        m, k = a.shape
        n = b.shape[1]
        f(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
    return run, version.value.decode().strip()


def child(lib: str, threads: int) -> dict:
    """Median seconds per shape of ``lib`` at ``threads`` (the BLAS's env var set by the parent), and its version."""
    rng = np.random.default_rng(0)
    out: dict = {"times": {}, "err": {}}
    if lib == "kiln":
        from kiln.runtime.kernels.cpu import native
        if not native.has_sgemm():
            raise RuntimeError("kiln's sgemm needs the native extension and AVX-512")
        out["version"] = "kiln native sgemm"
    elif lib == "mkl":
        mkl_run, out["version"] = _mkl_sgemm()
    elif lib == "blis":
        from importlib.metadata import version

        from blis.py import gemm as blis_gemm
        out["version"] = f"cython-blis {version('blis')}"
    else:
        from kiln.runtime.threads import blas_kernels
        out["version"] = f"numpy {np.__version__} matmul, OpenBLAS {blas_kernels()} kernels"
    for label, m, k, n, constant in SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        if lib == "kiln":  # the constant operand packed once, as kiln.load's kernels hold it
            from kiln.runtime.kernels.cpu import native
            packed = native.pack_rows(a) if constant == "left" else native.pack_cols(w)
            modes = (native._PACKED, native._ROWS) if constant == "left" else (native._ROWS, native._PACKED)
            sgemm = native._native.sgemm

            def fn(a=a, w=w, packed=packed, c=c, m=m, n=n, k=k, modes=modes, left=constant == "left"):
                sgemm(packed if left else a, w if left else packed, c, None, m, n, k, *modes, native._BIAS_NONE, 0,
                      0.0, 0.0, threads)
        elif lib == "mkl":
            def fn(a=a, w=w, c=c):
                mkl_run(a, w, c)
        elif lib == "blis":
            def fn(a=a, w=w, c=c):
                blis_gemm(a, w, out=c, beta=0.0)  # cython-blis adds into out by default (beta=1)
        else:
            def fn(a=a, w=w, c=c):
                np.matmul(a, w, out=c)
        out["times"][label] = timed(fn)
        ref = a.astype(np.float64) @ w.astype(np.float64)
        out["err"][label] = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    return out


def gemm(rounds: int) -> dict:
    env_base = {k: v for k, v in os.environ.items() if k not in (
        "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "BLIS_NUM_THREADS", "OPENBLAS_CORETYPE")}
    samples: dict = {}
    info: dict = {}
    for r in range(rounds):
        for threads in (1, 2):
            for lib, (kind, extra) in LIBS.items():
                env = dict(env_base, OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                           OMP_NUM_THREADS=str(threads), BLIS_NUM_THREADS=str(threads), **extra)
                time.sleep(0.3)
                proc = subprocess.run([sys.executable, __file__, "--child", kind, "--threads", str(threads)],
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    info.setdefault("failed", {})[lib] = proc.stderr.strip().splitlines()[-1:]
                    continue
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                info[lib] = got["version"]
                info.setdefault("err", {})[lib] = max(got["err"].values())
                for label, t in got["times"].items():
                    samples.setdefault((label, lib, threads), []).append(t)
        print(f"gemm round {r + 1}/{rounds} done", flush=True)
    return {"cells": {key: statistics.median(v) for key, v in samples.items()}, "info": info}


def gemm_table(result: dict) -> str:
    cells, info = result["cells"], result["info"]
    libs = [lib for lib in LIBS if any(key[1] == lib for key in cells)]
    lines = ["| product [M, K] x [K, N] | threads | " + " | ".join(f"{lib} ms (GFLOP/s)" for lib in libs) + " | best |",
             "|---|---:|" + "---:|" * len(libs) + "---|"]
    wins: dict = {lib: 0 for lib in libs}
    for label, m, k, n, _ in SHAPES:
        for threads in (1, 2):
            row = {lib: cells.get((label, lib, threads)) for lib in libs}
            present = {lib: t for lib, t in row.items() if t is not None}
            best = min(present, key=present.get) if present else "-"
            if present:
                wins[best] += 1
            flops = 2 * m * k * n
            text = [("-" if t is None else f"{t * 1e3:.3f} ({flops / t / 1e9:.0f})") for t in row.values()]
            lines.append(f"| {label}: [{m}, {k}] x [{k}, {n}] | {threads} | " + " | ".join(text) + f" | {best} |")
    lines.append("")
    lines.append("Fastest cells: " + ", ".join(f"{lib} {count}" for lib, count in wins.items())
                 + f" of {2 * len(SHAPES)}. Versions: " + "; ".join(f"{lib}: {info.get(lib, '?')}" for lib in libs)
                 + ". Largest relative error against float64, per library: "
                 + ", ".join(f"{lib} {e:.1e}" for lib, e in info.get("err", {}).items()) + ".")
    if info.get("failed"):
        lines.append(f"Failed to run: {info['failed']}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- elementwise
def _chains():
    """(label, torch module, input shapes, (numexpr expression over x[, y] and constants c0, c1, ..., the constants),
    numpy function, float64 reference)."""
    import torch

    class Residual(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y)

    class AffineClip(torch.nn.Module):
        def forward(self, x):
            return ((x * 1.5 + 0.25) * 0.5 - 0.125).clamp(min=0)

    class Silu(torch.nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    class TanhGelu(torch.nn.Module):  # written out, as many exported models have it
        def forward(self, x):
            return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))

    # numexpr takes a Python float constant as float64 (the chain would compute and answer in float64): the
    # constants are float32 0-d inputs instead (c0, c1, ...), as kiln would pass a chain's constants
    gelu = ("c0 * x * (c1 + tanh(c2 * (x + c3 * x * x * x)))", (0.5, 1.0, 0.7978845608, 0.044715))
    chains = []
    for shape, where in (((1, 64, 56, 56), "ResNet-18 b1"), ((8, 64, 56, 56), "ResNet-18 b8")):
        chains.append((f"residual Add + Relu, {where} {list(shape)}", Residual(), [shape, shape],
                       ("where(x + y > c0, x + y, c0)", (0.0,)), lambda x, y: np.maximum(x + y, 0),
                       lambda x, y: np.maximum(x + y, 0)))
    for shape, where in (((1, 128, 512), "b1"), ((32, 128, 512), "b32")):
        chains.append((f"affine chain + Clip(min=0), BERT-128 FFN {where} {list(shape)}", AffineClip(), [shape],
                       ("where((x * c0 + c1) * c2 - c3 > c4, (x * c0 + c1) * c2 - c3, c4)",
                        (1.5, 0.25, 0.5, 0.125, 0.0)),
                       lambda x: np.maximum((x * np.float32(1.5) + np.float32(0.25)) * np.float32(0.5)
                                            - np.float32(0.125), 0),
                       lambda x: np.maximum((x * 1.5 + 0.25) * 0.5 - 0.125, 0)))
        chains.append((f"SiLU x * sigmoid(x), {where} {list(shape)}", Silu(), [shape], ("x / (c0 + exp(-x))", (1.0,)),
                       lambda x: x / (1 + np.exp(-x)), lambda x: x / (1 + np.exp(-x))))
        chains.append((f"tanh GELU written out (8 ops), {where} {list(shape)}", TanhGelu(), [shape], gelu,
                       lambda x: np.float32(0.5) * x * (1 + np.tanh(np.float32(0.7978845608) * (
                           x + np.float32(0.044715) * x * x * x))),
                       lambda x: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))))
    return chains


def elementwise(rounds: int, folder: Path) -> list:
    import numexpr
    import torch

    import kiln
    rows = []
    rng = np.random.default_rng(0)
    for i, (label, module, shapes, expr, numpy_fn, ref_fn) in enumerate(_chains()):
        xs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        path = folder / f"chain{i}.kiln"
        kiln.save(kiln.trace(module, tuple(torch.from_numpy(x) for x in xs), check=False), path)
        program = kiln.load(path)
        text, constants = expr
        names = ["x", "y"][:len(xs)] + [f"c{j}" for j in range(len(constants))]
        operands = xs + [np.array(c, np.float32) for c in constants]
        compiled = numexpr.NumExpr(text, signature=[(n, float) for n in names])  # numexpr's "float" is float32
        ref = ref_fn(*[x.astype(np.float64) for x in xs])
        runs = {
            "kiln": lambda: program.run(xs, as_list=True)[0],
            "numexpr 1 thread": lambda: compiled(*operands),
            "numexpr 2 threads": lambda: compiled(*operands),
            "numpy ufuncs": lambda: numpy_fn(*xs),
        }
        times: dict = {name: [] for name in runs}
        errs = {}
        for _ in range(rounds):
            for name, fn in runs.items():
                numexpr.set_num_threads(2 if "2 threads" in name else 1)
                times[name].append(timed(fn, budget=BUDGET / 2))
                errs[name] = float(np.max(np.abs(fn().astype(np.float64) - ref)))
        instructions = len(program.plan.instructions)
        rows.append({"label": label, "instructions": instructions,
                     "ops": [ins.node.op for ins in program.plan.instructions],
                     "times": {k: statistics.median(v) for k, v in times.items()}, "errs": errs})
        print(f"{label}: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in times.items()),
              flush=True)
    return rows


def elementwise_table(rows: list) -> str:
    names = list(rows[0]["times"])
    lines = ["| chain | kiln's instructions | " + " | ".join(f"{n} us" for n in names)
             + " | max abs err kiln / numexpr |",
             "|---|---|" + "---:|" * len(names) + "---|"]
    for r in rows:
        t = r["times"]
        lines.append(f"| {r['label']} | {r['instructions']}: {', '.join(r['ops'])} | "
                     + " | ".join(f"{t[n] * 1e6:.1f}" for n in names)
                     + f" | {r['errs']['kiln']:.1e} / {r['errs']['numexpr 2 threads']:.1e} |")
    return "\n".join(lines)


def machine() -> str:
    from results_md import cpu_name, utc_now
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    versions = []
    for mod in ("numexpr", "mkl", "blis"):
        try:
            from importlib.metadata import version
            versions.append(f"{mod} {version(mod)}")
        except Exception:  # noqa: BLE001 - not installed: that part is skipped or failed above
            versions.append(f"{mod} not installed")
    return (f"{cpu_name()}, nproc {os.cpu_count()} (load average {load} at the end), Python "
            f"{platform.python_version()}, numpy {np.__version__}, " + ", ".join(versions) + f"; {utc_now()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="elementwise,gemm", help="comma-separated: elementwise, gemm")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of alternating candidates (default 3)")
    ap.add_argument("--results", default=None,
                    help="where the section goes: bench/RESULTS.md's own section (default), FILE, or - (printed only)")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return 0
    sys.path.insert(0, str(HERE))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"elementwise", "gemm"}
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}: choose elementwise, gemm")
    text = [SECTION, ""]
    if "elementwise" in parts:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            rows = elementwise(args.rounds, Path(tmp))
        text += ["Elementwise chains (median per call, one process, candidates alternating in "
                 f"{args.rounds} rounds; kiln as loaded, 2 threads):", "", elementwise_table(rows), ""]
    if "gemm" in parts:
        text += [f"Products (median over {args.rounds} rounds of each child's median):", "",
                 gemm_table(gemm(args.rounds)), ""]
    text.append(f"Machine: {machine()}.")
    from results_md import publish
    publish(args.results, SECTION, "\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
