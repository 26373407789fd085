"""Where a guard's time goes on the GPU (issue 15): CUDA-event timings of the pieces.

Rows: (a) ResNet-50 with and without its two guards (replay only, and the whole run() call);
(b) the check's own ops alone (Abs -> ReduceMax -> Greater -> Guard over the input) against the same
graph without the Guard; (c) the guard's host side (records copy + read) on a tiny graph.
    mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/kiln && PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_guard_profile.py
"""
from __future__ import annotations

import statistics
import time

import cupy as cp
import numpy as np

from guard_bench import build
from kiln.ir import Graph
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.runtime.cuda_program import CudaProgram


def wall(fn, n=200):
    for _ in range(10):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def check_graph(shape, guard: bool):
    g = Graph("check")
    x = g.add_input("x", "float32", list(shape))
    m = g.op("ReduceMax", g.op("Abs", x), keepdims=0)
    ok = g.op("Greater", m, g.add_constant(np.array(1e4, np.float32)))
    if guard:
        g.add_node("Guard", [ok], {"expected": np.array(False), "read": "bool"}, domain="kiln", num_outputs=0)
        g.outputs = [g.op("Relu", x)]
    else:
        g.outputs = [g.op("Relu", x), ok]
    infer_shapes(g)
    return g


def main():
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for batch in (1, 32):
        on, x = build(True, batch)
        off, _ = build(False, batch)
        xd = cp.asarray(x)
        pon, poff = CudaProgram(on, cuda_graphs=True), CudaProgram(off, cuda_graphs=True)
        print(f"resnet50 b{batch}: run() on {wall(lambda: pon.run([xd])):.1f} us, off {wall(lambda: poff.run([xd])):.1f} us")
        for name, p in (("on", pon), ("off", poff)):
            entry = next(iter(p._graphs.values()))
            graph, stream = entry.graph, entry.stream
            print(f"   replay only {name}: {wall(lambda: graph.launch(stream)):.1f} us")
        shape = x.shape
        for guard in (True, False):
            p = CudaProgram(check_graph(shape, guard), cuda_graphs=True)
            print(f"   check ops alone, guard={guard}: run() {wall(lambda: p.run([xd])):.1f} us")
            entry = next(iter(p._graphs.values()))
            print(f"      replay only: {wall(lambda: entry.graph.launch(entry.stream)):.1f} us")
        a = cp.abs(xd)
        print(f"   cupy abs+amax: {wall(lambda: cp.abs(xd).max()):.1f} us")
    tiny = check_graph((4,), True)
    p = CudaProgram(tiny, cuda_graphs=True)
    q = CudaProgram(check_graph((4,), False), cuda_graphs=True)
    t4 = cp.ones(4, cp.float32)
    print(f"tiny with guard run(): {wall(lambda: p.run([t4])):.1f} us, without: {wall(lambda: q.run([t4])):.1f} us")
    rec = cp.zeros(3, cp.float64)
    print(f"records copy+get: {wall(lambda: rec.copy().get()):.1f} us; get alone {wall(lambda: rec.get()):.1f} us")
    pinned = cp.cuda.alloc_pinned_memory(24)
    host = np.frombuffer(pinned, np.float64, 3)
    s = cp.cuda.Stream(non_blocking=True)

    def pinned_read():
        rec.get(stream=s, out=host)
        s.synchronize()
    print(f"records async get into pinned + sync: {wall(pinned_read):.1f} us")


if __name__ == "__main__":
    main()
