"""Big graphs (issue 20): ``optimize()`` and each pass on chains of 4k-32k nodes, and loading a 3k / 30k-node
file against ``onnx.load`` of the same graph, plus ``kiln.load`` and the first run of the 30k-node one.

    python bench/graph_scale_bench.py [--sizes 4000,8000,16000,32000] [--load-sizes 3000,30000] [--write]

Graphs (built with kiln's IR builder, no torch):
- *dead chain*: input -> Relu -> ... (n nodes) whose result nothing reads, next to a one-node live path: every
  node is removed by DCE (the issue's measurement);
- *live chain*: Add(x, c_i) / Mul / Relu cycling, n nodes, all live: what loading, shape inference, CSE,
  folding and fusion walk over (fusion turns it into few fused nodes).
Loading: the live chain optimized (as ``kiln export`` writes it) and saved as .kiln (``kiln.save``) and as ONNX
(``kiln.export_onnx``); ``kiln.load_graph``
(decode + verify) against ``onnx.load`` (protobuf parse only; ``onnx.checker`` is not run), best of 3 each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np



def dead_chain(n: int):
    from kiln.ir import Graph
    g = Graph("dead")
    x = g.add_input("x", "float32", [4, 8])
    v = x
    for _ in range(n):
        v = g.op("Relu", v)
    g.outputs = [g.op("Neg", x)]
    return g


def live_chain(n: int):
    from kiln.ir import Graph
    g = Graph("live")
    x = g.add_input("x", "float32", ["batch", 16])
    c = g.add_initializer("c", np.full((16,), 0.5, np.float32))
    v = x
    for i in range(n):
        v = g.op(("Add", "Mul", "Relu")[i % 3], *((v, c) if i % 3 < 2 else (v,)))
    g.outputs = [v]
    return g


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def pass_rows(sizes) -> list:
    from kiln.ir.passes import infer_shapes, optimize
    from kiln.ir.passes.pipeline import PASSES
    rows = []
    for n in sizes:
        for kind, build in (("dead chain", dead_chain), ("live chain", live_chain)):
            g = build(n)
            t = time.perf_counter()
            report = optimize(g)
            total = time.perf_counter() - t
            per_pass = {}
            for name in ("infer_shapes", *PASSES):
                fn = PASSES.get(name) or infer_shapes
                h = build(n)
                t = time.perf_counter()
                fn(h)
                per_pass[name] = time.perf_counter() - t
            row = {"graph": kind, "nodes": n, "optimize_s": total, "nodes_after": report.nodes_after, **per_pass}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def load_rows(sizes) -> list:
    import onnx

    import kiln
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in sizes:
            g = live_chain(n)
            from kiln.ir.passes import optimize
            optimize(g)  # as `kiln export` saves it: optimized (and marked so, so that kiln.load does not redo it)
            kpath, opath = os.path.join(d, f"c{n}.kiln"), os.path.join(d, f"c{n}.onnx")
            kiln.save(g, kpath)
            kiln.export_onnx(g, opath)
            t_kiln = best(lambda: kiln.load_graph(kpath))
            t_onnx = best(lambda: onnx.load(opath))
            x = np.ones((2, 16), np.float32)

            def load_and_run():
                kiln.load(kpath).run({"x": x})
            t_first = best(load_and_run, 2)
            row = {"nodes": n, "kiln_load_graph_s": t_kiln, "onnx_load_s": t_onnx, "ratio": t_kiln / t_onnx,
                   "kiln_load_and_first_run_s": t_first}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4000,8000,16000,32000")
    ap.add_argument("--load-sizes", default="3000,30000")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = {"passes": pass_rows([int(s) for s in args.sizes.split(",") if s]),
           "load": load_rows([int(s) for s in args.load_sizes.split(",") if s])}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
