"""Graphs that exercise every part of the .kiln format, shared by the serializer tests.

``feature_graph()`` is one fixed graph with every attribute kind, dtype, symbolic and unknown
dims, subgraphs (If inside Loop reading outer values), metadata and node meta.
``random_graph(data)`` draws a random graph of the same ingredients with hypothesis.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kiln.ir import Graph, Value
from kiln.ir.dtypes import DType
from kiln.ir.passes import infer_shapes

CONST_DTYPES = [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64, DType.INT8, DType.INT16,
                DType.INT32, DType.INT64, DType.UINT8, DType.BOOL]


def array(rng: np.random.Generator, dt: DType, shape) -> np.ndarray:
    if dt is DType.BOOL:
        return rng.random(shape) > 0.5
    if dt.is_float:
        return rng.standard_normal(shape).astype(np.float32).astype(dt.numpy)
    info = np.iinfo(dt.numpy)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dt.numpy)


def if_block(g: Graph, x: Value, outer: Value) -> Value:
    """If(ReduceSum(x) > 0) then Relu(x) * outer else Neg(x): branches read outer values."""
    total = g.op("ReduceSum", x, keepdims=0)
    cond = g.op("Greater", total, g.add_constant(np.array(0, np.float32), "zero"))
    then_b = g.subgraph("then")
    then_b.outputs = [then_b.op("Mul", then_b.op("Relu", x), outer)]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Neg", x)]
    node = g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}, num_outputs=1)
    infer_shapes(g)
    return node.output


def loop_block(g: Graph, x: Value, trips: int) -> Value:
    """Loop M times: acc = acc * 0.5 + x, with an If inside the body."""
    body = g.subgraph("body")
    body.add_input(f"{body.name}.i", "int64", ())
    cond_in = body.add_input(f"{body.name}.cond", "bool", ())
    acc = body.add_input(f"{body.name}.acc", x.type.dtype, x.type.shape)
    half = body.add_constant(np.array(0.5, np.float32), "half")
    new = body.op("Add", body.op("Mul", acc, half), x)
    new = if_block(body, new, half)
    body.outputs = [body.op("Identity", cond_in), new]
    m = g.add_constant(np.array(trips, np.int64), "trips")
    node = g.add_node("Loop", [m, None, x], {"body": body}, num_outputs=1)
    infer_shapes(g)
    return node.output


def feature_graph(seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    g = Graph("features")
    g.metadata.doc_string = "every feature of the format"
    g.metadata.props = {"author": "kiln tests", "unicode": "größe ✓", "empty": ""}
    x = g.add_input("x", "float32", ("batch", "seq", 4))
    y = g.add_input("y", "float32", (None, 4))
    z = g.add_input("z", "float32", None)
    w = g.add_initializer("layer.0.weight", array(rng, DType.FLOAT32, (4, 4)))
    h = g.op("MatMul", x, w)
    h.producer.meta.update({"scope": "layer.0", "source": "model.py:12"})
    h = g.op("LeakyRelu", h, alpha=0.125)
    h = g.op("Transpose", h, perm=[1, 0, 2])
    h = g.op("Gelu", h, approximate="tanh")
    c = g.op("Constant", value=array(rng, DType.FLOAT16, (2, 2)))
    floats = g.op("Constant", value_floats=[1.5, -2.25, 3.0])
    ints = g.op("Constant", value_ints=[3, -1])
    for i, dt in enumerate(CONST_DTYPES):
        g.add_initializer(f"const.{dt.short}", array(rng, dt, (i % 3 + 1, 2)))
    g.add_initializer("scalar", np.array(7, np.int64))
    g.add_initializer("empty", np.zeros((0, 3), np.float32))
    shared = array(rng, DType.FLOAT32, (3,))
    g.add_initializer("shared.a", shared)
    g.add_initializer("shared.b", shared)
    looped = loop_block(g, y, 3)
    outs = [h, c, floats, ints, looped, g.op("Relu", z), g.op("Cast", y, to=DType.INT32.value)]
    outs += [g.initializers[n] for n in ("const.bfloat16", "const.bool", "scalar", "empty", "shared.a", "shared.b")]
    g.outputs = outs
    infer_shapes(g)
    return g


UNARY = ("Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Exp")
DIMS = st.sampled_from([1, 2, 3, "batch", "seq", None])


def random_graph(data: st.DataObject) -> Graph:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    g = Graph(data.draw(st.sampled_from(["g", "model", "модель"]), label="name"))
    n_inputs = data.draw(st.integers(1, 3), label="inputs")
    pool = [g.add_input(f"in{i}", "float32", data.draw(st.lists(DIMS, max_size=3), label="shape"))
            for i in range(n_inputs)]
    for step in range(data.draw(st.integers(0, 12), label="steps")):
        kind = data.draw(st.sampled_from(["unary", "binary", "const", "attr", "if", "loop", "meta"]), label="kind")
        x = pool[data.draw(st.integers(0, len(pool) - 1), label="pick")]
        if kind == "unary":
            pool.append(g.op(data.draw(st.sampled_from(UNARY)), x))
        elif kind == "binary":
            pool.append(g.op("Add", x, g.add_constant(array(rng, DType.FLOAT32, (1,)), "c")))
        elif kind == "const":
            dt = data.draw(st.sampled_from(CONST_DTYPES), label="dtype")
            shape = data.draw(st.lists(st.integers(0, 3), max_size=3), label="const_shape")
            g.add_constant(array(rng, dt, tuple(shape)), "k")
        elif kind == "attr":
            pool.append(g.op("LeakyRelu", x, alpha=data.draw(st.floats(-4, 4, allow_nan=False))))
        elif kind == "if":
            pool.append(if_block(g, x, g.add_constant(np.float32(2.0), "two")))
        elif kind == "loop" and x.type.shape is not None:
            pool.append(loop_block(g, x, data.draw(st.integers(0, 3), label="trips")))
        elif kind == "meta" and pool[-1].producer is not None:
            pool[-1].producer.meta["scope"] = data.draw(st.text(max_size=8), label="scope")
    g.outputs = pool[-data.draw(st.integers(1, len(pool)), label="outputs"):]
    g.metadata.props = data.draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    infer_shapes(g)
    return g
