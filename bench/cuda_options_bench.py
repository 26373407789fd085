"""Issue 17: what per-program TF32 costs on the host, measured on the GPU machine.

kiln keeps two cuBLAS handles per (device, stream), one per math mode, and picks one per call
(runtime/kernels/cuda/linalg.py). The alternative is one handle whose math mode is set before
every call (``cublasSetMathMode``). This measures, on small GEMMs (host-bound: what a batch-1
model's products are):

- ``two handles``: alternate tf32 / strict programs' products by taking the other handle;
- ``set mode``: one handle, ``cublasSetMathMode`` before each call, alternating modes;
- ``one mode``: one handle, no switching (the floor);
- ``cublasSetMathMode`` alone, and the context variable each run of a CudaProgram sets
  (``kernels.cuda.bind``/``unbind``; and the ``bound`` context manager) alone;
- CudaProgram.run of a 4-layer MLP (batch 1, eager): one program alone, a tf32 and a strict
  program interleaved, and two strict programs interleaved (the control: what alternating
  between two programs costs whatever their settings).

Prints one JSON object; ``--results FILE`` appends a line to a RESULTS.md-style file.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time

import cupy as cp
import numpy as np


def _per_call(fn, n: int) -> float:
    """Microseconds per call of fn(i) over n calls (after 200 warm-up calls), synchronized."""
    for i in range(200):
        fn(i)
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / n * 1e6


def gemm_bench(n: int, size: int) -> dict:
    from kiln.runtime.kernels.cuda import linalg
    lib = linalg._lib()
    stream = cp.cuda.get_current_stream()
    h_strict, h_tf32 = linalg._handle(stream, False), linalg._handle(stream, True)
    # A handle of our own for the set-mode variant (the shipped ones never change mode).
    h = ctypes.c_void_p()
    linalg._check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
    linalg._check(lib.cublasSetStream_v2(h, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
    ws = cp.cuda.memory.alloc(linalg.WORKSPACE_BYTES)
    linalg._check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.ptr), ctypes.c_size_t(linalg.WORKSPACE_BYTES)),
                  "cublasSetWorkspace")
    a = cp.random.standard_normal((size, size), dtype=np.float32)
    b = cp.random.standard_normal((size, size), dtype=np.float32)
    out = cp.empty((size, size), np.float32)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    fn = lib.cublasSgemmStridedBatched
    args = (0, 0, size, size, size, one.ctypes.data, b.data.ptr, size, 0, a.data.ptr, size, 0,
            zero.ctypes.data, out.data.ptr, size, size * size, 1)
    modes = (linalg._DEFAULT_MATH, linalg._TF32_MATH)

    def two_handles(i):
        fn(h_tf32 if i & 1 else h_strict, *args)

    def set_mode(i):
        lib.cublasSetMathMode(h, modes[i & 1])
        fn(h, *args)

    def one_mode(i):
        fn(h_strict, *args)

    def mode_only(i):
        lib.cublasSetMathMode(h, modes[i & 1])

    res = {"gemm": f"{size}x{size}x{size} fp32", "calls": n}
    # Interleave the variants (three rounds) and keep each one's best, against drift.
    for name, f in (("two_handles_us", two_handles), ("set_mode_us", set_mode), ("one_mode_us", one_mode)) * 3:
        res[name] = min(res.get(name, float("inf")), _per_call(f, n))
    res["cublasSetMathMode_us"] = _per_call(mode_only, n * 4)
    lib.cublasDestroy_v2(h)
    return res


def bind_bench(n: int) -> dict:
    from kiln.runtime.cuda_options import CudaOptions
    from kiln.runtime.kernels import cuda
    opts = CudaOptions()

    def bound(i):
        with cuda.bound(opts):
            pass

    def bind(i):
        cuda.unbind(cuda.bind(opts))
    return {"bound_us": _per_call(bound, n), "bind_us": _per_call(bind, n)}


def program_bench(n: int) -> dict:
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    from kiln.runtime.cuda_program import CudaProgram
    rng = np.random.default_rng(0)
    g = Graph("mlp")
    t = g.add_input("x", "float32", [1, 512])
    for i in range(4):
        t = g.op("Relu", g.op("Add", g.op("MatMul", t, g.add_initializer(f"w{i}", rng.standard_normal((512, 512))
                                                                          .astype(np.float32) / 22)),
                              g.add_initializer(f"b{i}", rng.standard_normal(512).astype(np.float32))))
    g.outputs = [t]
    infer_shapes(g)
    a = CudaProgram(g.copy(), tf32=True, cuda_graphs=False)
    b = CudaProgram(g.copy(), tf32=False, cuda_graphs=False)
    c = CudaProgram(g.copy(), tf32=False, cuda_graphs=False)  # control: two programs, one setting
    x = cp.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    feeds = [x]

    def alone(i):
        b.run(feeds, as_list=True)

    def interleaved(i):
        (a if i & 1 else b).run(feeds, as_list=True)

    def same_setting(i):
        (c if i & 1 else b).run(feeds, as_list=True)
    res = {}
    for name, f in (("program_alone_us", alone), ("program_interleaved_us", interleaved),
                    ("program_same_setting_us", same_setting)) * 3:
        res[name] = min(res.get(name, float("inf")), _per_call(f, n))
    res["program_epilogues"] = b.epilogues
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--results")
    args = ap.parse_args()
    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    res.update(gemm_bench(args.calls, args.size))
    res.update(bind_bench(args.calls * 4))
    res.update(program_bench(args.calls // 5))
    print(json.dumps(res, indent=1))
    if args.results:
        line = (f"| issue 17 per-program TF32 ({res['device']}) | {res['gemm']} cuBLAS call, host-bound: two handles "
                f"(kiln) {res['two_handles_us']:.2f} us, set-mode-per-call {res['set_mode_us']:.2f} us, "
                f"one mode {res['one_mode_us']:.2f} us; cublasSetMathMode alone {res['cublasSetMathMode_us']:.3f} us; "
                f"per-run binding {res['bind_us']:.3f} us (context manager {res['bound_us']:.3f}); 4-layer MLP b1 "
                f"eager run: one program {res['program_alone_us']:.1f} us, tf32/strict programs interleaved "
                f"{res['program_interleaved_us']:.1f} us, two strict programs interleaved "
                f"{res['program_same_setting_us']:.1f} us |\n")
        with open(args.results, "a") as f:
            f.write(line)


if __name__ == "__main__":
    main()
