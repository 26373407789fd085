"""kiln's quickstart on a bundled example: a small CNN built directly in the IR (random weights,
no downloads), optimized by the pass pipeline and checked against the unoptimized graph.

Run: python examples/quickstart.py
(The frontend and runtime issues turn this into export-from-torch + run-from-file.)
"""
from __future__ import annotations

import time

import numpy as np

import kiln
from kiln.ir import Graph, evaluate
from kiln.ir.passes import optimize


def conv_bn_relu(g: Graph, x, name: str, cin: int, cout: int, rng: np.random.Generator, stride: int = 1):
    w = g.add_initializer(f"{name}.conv.weight", (rng.standard_normal((cout, cin, 3, 3)) * 0.2).astype(np.float32))
    y = g.op("Conv", x, w, pads=[1, 1, 1, 1], strides=[stride, stride])
    bn = [g.add_initializer(f"{name}.bn.{p}", v.astype(np.float32)) for p, v in (
        ("weight", rng.uniform(0.5, 1.5, cout)), ("bias", rng.standard_normal(cout) * 0.1),
        ("running_mean", rng.standard_normal(cout) * 0.1), ("running_var", rng.uniform(0.5, 2.0, cout)))]
    return g.op("Relu", g.op("BatchNormalization", y, *bn, epsilon=1e-5))


def build_model(seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    g = Graph("tiny_cnn")
    g.metadata.doc_string = "quickstart: conv-bn-relu x3, global pool, linear classifier"
    x = g.add_input("image", "float32", ("batch", 3, 32, 32))
    h = conv_bn_relu(g, x, "stem", 3, 16, rng)
    h = conv_bn_relu(g, h, "block1", 16, 32, rng, stride=2)
    h = g.op("Add", conv_bn_relu(g, h, "block2", 32, 32, rng), h)  # residual
    h = g.op("Flatten", g.op("GlobalAveragePool", h))
    w = g.add_initializer("fc.weight", (rng.standard_normal((10, 32)) * 0.1).astype(np.float32))
    b = g.add_initializer("fc.bias", np.zeros(10, np.float32))
    g.outputs = [g.op("Softmax", g.op("Gemm", h, w, b, transB=1), axis=-1)]
    return g


def main() -> None:
    g = build_model()
    kiln.verify(g)
    reference = g.copy()
    print(f"kiln {kiln.__version__}: built '{g.name}' with {len(g.nodes)} nodes")
    report = optimize(g, level=2)
    kiln.verify(g)
    print(report)
    print(g)
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    t0 = time.perf_counter()
    (got,) = evaluate(g, {"image": x})
    t1 = time.perf_counter()
    (want,) = evaluate(reference, {"image": x})
    err = float(np.max(np.abs(got - want)))
    print(f"batch 4 -> output {got.shape}, max |optimized - original| = {err:.2e} "
          f"(reference evaluator, {1000 * (t1 - t0):.1f} ms)")
    if err > 1e-5:
        raise SystemExit("optimized graph disagrees with the original")


if __name__ == "__main__":
    main()
