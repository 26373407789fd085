"""Launch shape of kiln's generated elementwise kernels: threads per block and the grid cap.

    PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_launch_shape.py

codegen.py launches ``BLOCK`` threads per block and at most ``BLOCKS_PER_SM`` blocks per
multiprocessor (0: no cap, one element or 4-wide vector per thread; otherwise threads loop
grid-stride), with a separate pair (``BLOCK_VEC``, ``BLOCKS_PER_SM_VEC``) for the 4-wide path;
each row here sets both pairs.
This times the issue-8 chain ``x+1, *2, relu, -0.5, sigmoid`` (float32, 2048^2 and 8192^2) and
a broadcast add + Gelu of a BERT-sized [4096, 3072] activation for each shape, through the
same ``ElementwiseKernel`` the backend uses, against the bandwidth floor (a device-to-device copy
of 1 GiB measured in the same run). Median of CUDA-event-timed batches. Writes
``$OUT/launch_shape.json``; the default in codegen.py is the row this picked (see
bench/RESULTS.md).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import bench  # noqa: E402  (median of CUDA-event-timed batches)

SHAPES = [(256, 32), (256, 64), (256, 0), (128, 0), (512, 0), (1024, 0), (128, 32)]


def main() -> int:
    import cupy as cp
    import numpy as np

    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    from kiln.runtime.kernels.cuda import codegen
    src = cp.ones(1 << 28, cp.float32)
    dst = cp.empty_like(src)
    bw = 2 * src.nbytes / (bench(lambda: cp.copyto(dst, src), 10, reps=9) * 1e-3)
    src = dst = None  # the 2 GiB back to the pool
    cases = []
    for n in (2048, 8192):
        g = Graph("chain")
        x = g.add_input("x", "float32", [n, n])
        y = g.op("Add", x, g.add_constant(np.array(1.0, np.float32)))
        y = g.op("Mul", y, g.add_constant(np.array(2.0, np.float32)))
        y = g.op("Sub", g.op("Relu", y), g.add_constant(np.array(0.5, np.float32)))
        g.outputs = [g.op("Sigmoid", y)]
        infer_shapes(g)
        xd = cp.random.standard_normal((n, n), dtype=cp.float32)
        cases.append((f"chain {n}^2", g, [xd], 2 * xd.nbytes))
    g = Graph("bias_gelu")
    x = g.add_input("x", "float32", [4096, 3072])
    b = g.add_input("b", "float32", [3072])
    g.outputs = [g.op("Gelu", g.op("Add", x, b))]
    infer_shapes(g)
    xd = cp.random.standard_normal((4096, 3072), dtype=cp.float32)
    cases.append(("bias+gelu 4096x3072", g, [xd, cp.random.standard_normal(3072, dtype=cp.float32)], 2 * xd.nbytes))
    rows = []
    for name, g, ops, nbytes in cases:
        floor = nbytes / bw * 1e3
        want = None
        for block, per_sm in SHAPES:
            codegen.BLOCK, codegen.BLOCKS_PER_SM = block, per_sm
            codegen.BLOCK_VEC, codegen.BLOCKS_PER_SM_VEC = block, per_sm
            ew = codegen.ElementwiseKernel(codegen.body_from_graph(g))
            got = ew(*ops)[0]
            if want is None:
                want = got.copy()
            same = bool(cp.array_equal(got, want))
            iters = 200 if nbytes < (64 << 20) else 40
            ms = bench(lambda: ew(*ops), iters, reps=9)
            rows.append({"case": name, "block": block, "blocks_per_sm": per_sm, "ms": ms, "floor_ms": floor,
                         "x_floor": ms / floor, "same_result": same})
            print(f"{name:22s} block {block:5d} per-SM cap {per_sm or 'none':>4}: {ms:.4f} ms "
                  f"({ms / floor:.3f}x floor {floor:.4f}){'' if same else ' RESULT DIFFERS'}", flush=True)
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_shape.json").write_text(json.dumps({
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "copy_GBps": bw / 1e9, "rows": rows},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
