"""Load time against graph size: kiln.load_graph vs onnx.load (and onnxruntime) on chains of
N small layers (Gemm 64x64 + Relu + Add), the case where the graph, not the weights, dominates.

kiln's load checks the whole FlatBuffer structure, decodes it and verifies the graph (types and
shape inference of every node); onnx.load parses protobuf in C++ without checking the graph.

Run: .venv/bin/python bench/load_nodes_bench.py [--layers 25,250,1000] [--repeat 7] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from results_md import replace_section

import numpy as np

import kiln
from kiln.ir import Graph

SECTION = "## Model file loading: cost per node (issue 3)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def build(layers: int, rng: np.random.Generator) -> tuple[Graph, list]:
    g = Graph("chain")
    x = g.add_input("x", "float32", ("batch", 64))
    h = x
    weights = []
    for i in range(layers):
        w = rng.standard_normal((64, 64)).astype(np.float32)
        b = np.zeros(64, np.float32)
        weights.append((f"l{i}.w", w, f"l{i}.b", b))
        h = g.op("Gemm", h, g.add_initializer(f"l{i}.w", w), g.add_initializer(f"l{i}.b", b), transB=1)
        h = g.op("Add", g.op("Relu", h), x)
    g.outputs = [h]
    return g, weights


def to_onnx(layers: int, weights: list, path: Path) -> bool:
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return False
    nodes, inits, prev = [], [], "x"
    for i, (wn, w, bn, b) in enumerate(weights):
        inits += [numpy_helper.from_array(w, wn), numpy_helper.from_array(b, bn)]
        nodes += [helper.make_node("Gemm", [prev, wn, bn], [f"g{i}"], transB=1),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"]),
                  helper.make_node("Add", [f"r{i}", "x"], [f"a{i}"])]
        prev = f"a{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["batch", 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(path))
    return True


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up: page cache, lazy imports
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="25,250,1000", help="chain lengths (3 nodes each)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to update, '-' to skip")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for layers in [int(x) for x in args.layers.split(",")]:
            g, weights = build(layers, np.random.default_rng(0))
            kpath = kiln.save(g, Path(d) / f"c{layers}.kiln")
            opath = Path(d) / f"c{layers}.onnx"
            row = {"nodes": len(g.nodes), "kiln": median_ms(lambda: kiln.load_graph(kpath), args.repeat)}
            if to_onnx(layers, weights, opath):
                import onnx
                import onnxruntime as ort
                row["onnx"] = median_ms(lambda: onnx.load(str(opath)), args.repeat)
                row["ort"] = median_ms(lambda: ort.InferenceSession(str(opath), providers=["CPUExecutionProvider"]),
                                       args.repeat)
            rows.append(row)
            print(row, flush=True)
    table = ["| nodes | kiln.load_graph ms | µs/node | onnx.load ms | onnxruntime.InferenceSession ms |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['nodes']} | {r['kiln']:.1f} | {1000 * r['kiln'] / r['nodes']:.0f} | "
                     f"{r.get('onnx', float('nan')):.1f} | {r.get('ort', float('nan')):.1f} |")
    text = "\n".join(table)
    print(text)
    if args.results != "-":
        write_section(Path(args.results), text)


def write_section(path: Path, table: str) -> None:
    import platform
    body = (f"{SECTION}\n\nIn-process, warm page cache, median of the runs; {platform.processor() or platform.machine()}, "
            f"Python {platform.python_version()}, produced by `bench/load_nodes_bench.py`. kiln checks the "
            "FlatBuffer structure, decodes it in Python and verifies every node (types, shape inference); "
            "onnx.load parses protobuf in C++ with no graph check; onnxruntime also optimizes the graph.\n\n"
            f"{table}\n")
    replace_section(path, SECTION, body)


if __name__ == "__main__":
    main()
