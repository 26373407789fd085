"""The batch-independence analysis (kiln/ir/batch_independence.py), op by op.

Every verdict is checked against the evaluator, not only against the expected answer: a graph the
analysis calls batchable must give, for a batch of stacked rows, exactly the rows it gives one at a
time; the dependent ones are shown to really differ (so the test of a "no" is not vacuous).
"""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, evaluate, verify
from kiln.ir.batch_independence import RULES, analyze_batching
from kiln.ir.passes import infer_shapes
from kiln.ir.registry import all_schemas
from kiln.ir.types import TensorType

RNG = np.random.default_rng(0)


def graph_of(build, shape=("batch", 6), dtype="float32", declare=None) -> Graph:
    """A graph of one input x; ``declare``: the output's shape as a frontend would declare it (where
    inference cannot tell its dim 0 is the batch)."""
    g = Graph("g")
    x = g.add_input("x", dtype, shape)
    out = build(g, x)
    g.outputs = list(out) if isinstance(out, (list, tuple)) else [out]
    infer_shapes(g)
    if declare is not None:
        g.outputs[0].type = TensorType(g.outputs[0].type.dtype, declare)
    verify(g)
    return g


def stacked_matches_rows(g: Graph, rows: int = 4) -> bool:
    """Run 4 stacked rows and each row alone; whether every output row is the same."""
    shape = [rows if d == "batch" else d for d in g.inputs[0].shape]
    x = RNG.standard_normal(shape).astype(np.float32)
    together = evaluate(g, {"x": x})
    for i in range(rows):
        alone = evaluate(g, {"x": x[i:i + 1]})
        for t, a in zip(together, alone):
            if t.shape[1:] != a.shape[1:] or not np.allclose(t[i:i + 1], a, rtol=1e-5, atol=1e-6):
                return False
    return True


def const(g: Graph, a, dtype=np.float32):
    return g.add_constant(np.asarray(a, dtype))


def ints(g: Graph, a):
    return g.add_constant(np.asarray(a, np.int64))


def assert_batchable(g: Graph) -> None:
    result = analyze_batching(g)
    assert result.batchable, result.reason
    assert result.symbol == "batch"
    assert stacked_matches_rows(g), "claimed batchable, but stacking changes the answer"


def assert_dependent(g: Graph, op: str, words: str, *, differs: bool = True):
    result = analyze_batching(g)
    assert not result.batchable
    assert result.op == op, result.reason
    assert words in result.reason, result.reason
    assert result.node in result.reason  # the node is named
    if differs:
        assert not stacked_matches_rows(g), "the model really is row-independent; the test is wrong"
    return result


# ---------------------------------------------------------------------------- yes


def test_elementwise_and_broadcast_against_constants():
    def build(g, x):
        y = g.op("Mul", g.op("Relu", x), const(g, RNG.standard_normal((1, 6))))   # [1, 6] broadcasts
        y = g.op("Add", y, const(g, RNG.standard_normal(6)))                       # [6] too
        return g.op("Where", g.op("Greater", y, const(g, 0.0)), y, g.op("Neg", y))
    assert_batchable(graph_of(build))


def test_broadcast_between_two_batch_operands():
    def build(g, x):
        s = g.op("ReduceSum", x, ints(g, [1]), keepdims=1)  # [batch, 1]: per row
        return g.op("Div", x, s)                              # both operands carry the batch
    assert_batchable(graph_of(build))


def test_matmul_and_gemm_with_the_batch_free():
    def build(g, x):
        h = g.op("Gemm", x, const(g, RNG.standard_normal((5, 6))), const(g, RNG.standard_normal(5)), transB=1)
        h = g.op("MatMul", h, const(g, RNG.standard_normal((5, 3))))
        return g.op("Softmax", h, axis=-1)
    assert_batchable(graph_of(build))


def test_conv_pool_and_norms():
    def build(g, x):
        w = const(g, RNG.standard_normal((4, 3, 3, 3)) * 0.2)
        y = g.op("Conv", x, w, pads=(1, 1, 1, 1))
        y = g.op("BatchNormalization", y, const(g, np.ones(4)), const(g, np.zeros(4)), const(g, RNG.random(4)),
                 const(g, 1 + RNG.random(4)))
        y = g.op("MaxPool", g.op("Relu", y), kernel_shape=(2, 2), strides=(2, 2))
        y = g.op("InstanceNormalization", y, const(g, np.ones(4)), const(g, np.zeros(4)))
        y = g.op("Flatten", g.op("GlobalAveragePool", y))
        return g.op("LayerNormalization", y, const(g, np.ones(4)), const(g, np.zeros(4)), axis=-1)
    assert_batchable(graph_of(build, ("batch", 3, 8, 8)))


def test_attention_folding_the_batch_with_heads_and_back():
    """nn.MultiheadAttention's layout: [seq, N, E] -> [seq, N * heads, hd] -> [N * heads, seq, hd],
    a batched matmul, then back through [seq * N, E]: the batch is folded, never mixed."""
    def build(g, x):  # x: [batch, 5, 8]
        t = g.op("Transpose", x, perm=(1, 0, 2))                    # [seq, N, 8]
        shape = g.op("Shape", t)
        seq, n = (g.op("Gather", shape, ints(g, [i])) for i in (0, 1))
        heads = g.op("Mul", n, ints(g, [2]))
        q = g.op("Reshape", t, g.op("Concat", seq, heads, ints(g, [4]), axis=0))   # [seq, N*2, 4]
        q = g.op("Transpose", q, perm=(1, 0, 2))                    # [N*2, seq, 4]
        s = g.op("Softmax", g.op("MatMul", q, g.op("Transpose", q, perm=(0, 2, 1))), axis=-1)
        o = g.op("Transpose", g.op("MatMul", s, q), perm=(1, 0, 2))  # [seq, N*2, 4]
        flat = g.op("Reshape", o, g.op("Concat", g.op("Mul", seq, n), ints(g, [8]), axis=0))  # [seq*N, 8]
        flat = g.op("Gemm", flat, const(g, RNG.standard_normal((8, 8))))
        back = g.op("Reshape", flat, g.op("Concat", seq, n, ints(g, [8]), axis=0))  # [seq, N, 8]
        return g.op("Transpose", back, perm=(1, 0, 2))
    assert_batchable(graph_of(build, ("batch", 5, 8)))


def test_reshape_keeping_the_batch_first():
    def build(g, x):  # [batch, 6] -> [batch, 2, 3] -> [batch, 6] (Shape(x)[0] and -1)
        y = g.op("Reshape", x, ints(g, [-1, 2, 3]))
        n = g.op("Gather", g.op("Shape", y), ints(g, [0]))
        return g.op("Reshape", y, g.op("Concat", n, ints(g, [-1]), axis=0))
    assert_batchable(graph_of(build))


def test_transpose_moves_the_batch_and_back():
    def build(g, x):  # [batch, 3, 4] -> [4, batch, 3] -> softmax over axis 0 (not the batch) -> back
        t = g.op("Transpose", x, perm=(2, 0, 1))
        t = g.op("Softmax", t, axis=0)
        return g.op("Transpose", t, perm=(1, 2, 0))
    assert_batchable(graph_of(build, ("batch", 3, 4)))


def test_non_batch_sizes_used_as_values_are_constants():
    """``x / sqrt(x.size(-1))``: a size read from the shape, but not the batch size."""
    def build(g, x):
        d = g.op("Cast", g.op("Gather", g.op("Shape", x), ints(g, -1)), to=1)
        return g.op("Div", x, g.op("Sqrt", d))
    assert_batchable(graph_of(build))


def test_embedding_lookup():
    def build(g, x):  # int ids [batch, 3] into a constant table
        return g.op("Gather", const(g, RNG.standard_normal((10, 4))), x, axis=0)
    g = graph_of(build, ("batch", 3), "int64")
    assert analyze_batching(g).batchable
    ids = RNG.integers(0, 10, (4, 3))
    together = evaluate(g, {"x": ids})[0]
    assert all(np.array_equal(together[i:i + 1], evaluate(g, {"x": ids[i:i + 1]})[0]) for i in range(4))


def test_if_with_a_constant_condition_and_row_wise_branches():
    def build(g, x):
        then_b, else_b = g.subgraph("then"), g.subgraph("else")
        then_b.outputs = [then_b.op("Relu", x)]
        else_b.outputs = [else_b.op("Neg", x)]
        return g.add_node("If", [const(g, True, np.bool_)], {"then_branch": then_b, "else_branch": else_b},
                          num_outputs=1).output
    assert_batchable(graph_of(build))


def test_loop_carrying_rows():
    def build(g, x):
        body = g.subgraph("body")
        body.add_input("i", "int64", ())
        cond = body.add_input("cond", "bool", ())
        acc = body.add_input("acc", "float32", ("batch", 6))
        body.outputs = [body.op("Identity", cond), body.op("Add", body.op("Mul", acc, const(body, 0.5)), x)]
        return g.add_node("Loop", [ints(g, 3), None, x], {"body": body}, num_outputs=1).output
    assert_batchable(graph_of(build))


def padding_mask_gather(g, x, offset: int = 0, scale_extra: int = 1):
    """How a traced Hugging Face model reads ``mask[batch_idx, kv_idx]``: flat indices
    (arange(N)[:, None] * seq + arange(seq)), negative ones wrapped, into the flattened mask."""
    shape = g.op("Shape", x)
    n = g.op("Squeeze", g.op("Gather", shape, ints(g, [0])), ints(g, [0]))
    seq = g.op("Squeeze", g.op("Gather", shape, ints(g, [1])), ints(g, [0]))

    def wrapped(v, size):
        return g.op("Where", g.op("Less", v, ints(g, 0)), g.op("Add", v, size), v)

    bi = wrapped(g.op("Unsqueeze", g.op("Range", ints(g, 0), n, ints(g, 1)), ints(g, [1])), n)
    ki = wrapped(g.op("Unsqueeze", g.op("Range", ints(g, 0), seq, ints(g, 1)), ints(g, [0])), seq)
    flat = g.op("Add", g.op("Mul", bi, g.op("Mul", seq, ints(g, scale_extra))), ki)
    if offset:
        flat = g.op("Add", flat, ints(g, offset))
    mask = g.op("Reshape", g.op("Greater", x, const(g, 0.0)), ints(g, [-1]))
    picked = g.op("Gather", mask, flat, axis=0)                     # [batch, seq]
    return g.op("Where", picked, x, const(g, -1.0))


def test_padding_mask_read_through_flat_indices():
    assert_batchable(graph_of(padding_mask_gather))


def test_flat_indices_that_leave_the_row_are_dependent():
    # Shifted by one element: the last index of row i reads row i + 1.
    g = graph_of(lambda g, x: padding_mask_gather(g, x, offset=1), declare=("batch", 6))
    assert_dependent(g, "Add", "inside a row", differs=False)  # the last row's index is out of range
    # Twice the row length: row i reads row 2i.
    g = graph_of(lambda g, x: padding_mask_gather(g, x, scale_extra=2), declare=("batch", 6))
    assert_dependent(g, "Add", "inside a row", differs=False)


def test_batch_positions_used_as_values():
    def build(g, x):  # x * arange(N)[:, None]
        n = g.op("Squeeze", g.op("Gather", g.op("Shape", x), ints(g, [0])), ints(g, [0]))
        pos = g.op("Cast", g.op("Unsqueeze", g.op("Range", ints(g, 0), n, ints(g, 1)), ints(g, [1])), to=1)
        return g.op("Mul", x, pos)
    assert_dependent(graph_of(build), "Mul", "positions in the stacked batch")


def guarded(g, x, times: int):
    """A traced ``if x.size(0) * times == 1:``, kept as a kiln.Guard expecting False."""
    n = g.op("Squeeze", g.op("Gather", g.op("Shape", x), ints(g, [0])), ints(g, [0]))
    cond = g.op("Equal", g.op("Mul", n, ints(g, times)), ints(g, 1))
    g.add_node("Guard", [cond], {"expected": np.array(False), "read": "bool"}, domain="kiln", num_outputs=0)
    return g.op("Relu", x)


def test_guard_on_the_batch_size_that_no_batch_size_changes():
    assert_batchable(graph_of(lambda g, x: guarded(g, x, 4)))  # 4N == 1 never holds


def test_guard_on_the_batch_size():
    # N == 1 holds alone, not stacked: a request refused alone would be answered stacked.
    g = graph_of(lambda g, x: guarded(g, x, 1))
    r = analyze_batching(g)
    assert not r.batchable and r.op == "kiln.Guard" and "could pass a check" in r.reason, r.reason


# ---------------------------------------------------------------------------- no


def test_mean_over_the_batch_axis():
    g = graph_of(lambda g, x: g.op("Sub", x, g.op("ReduceMean", x, ints(g, [0]), keepdims=1)))
    r = assert_dependent(g, "ReduceMean", "reduces over the batch axis")
    assert "batch" in r.reason


def test_reduce_over_every_axis():
    g = graph_of(lambda g, x: g.op("Sub", x, g.op("ReduceSum", x, keepdims=1)))
    assert_dependent(g, "ReduceSum", "every axis")


def test_reshape_folding_the_batch():
    def build(g, x):  # [batch, 6] -> [2, 3 * batch] (rows interleaved) -> softmax -> back
        y = g.op("Reshape", x, ints(g, [2, -1]))
        y = g.op("Softmax", y, axis=0)
        n = g.op("Gather", g.op("Shape", x), ints(g, [0]))
        return g.op("Reshape", y, g.op("Concat", n, ints(g, [6]), axis=0))
    assert_dependent(graph_of(build), "Reshape", "fold")


def test_transpose_leaving_the_batch_off_dim_0():
    g = graph_of(lambda g, x: g.op("Transpose", g.op("Softmax", g.op("Transpose", x, perm=(1, 0)), axis=1),
                                   perm=(1, 0)))
    assert_dependent(g, "Softmax", "along the batch axis")


def test_batch_size_used_as_a_value():
    def build(g, x):  # x / N
        n = g.op("Cast", g.op("Gather", g.op("Shape", x), ints(g, 0)), to=1)
        return g.op("Div", x, n)
    assert_dependent(graph_of(build), "Div", "batch size")


def test_gather_and_concat_along_the_batch():
    def build(g, x):  # x + x[0]
        return g.op("Add", x, g.op("Gather", x, ints(g, [0]), axis=0))
    assert_dependent(graph_of(build), "Gather", "batch axis")

    def build2(g, x):  # rows shifted by one
        shifted = g.op("Concat", g.op("Slice", x, ints(g, [1]), ints(g, [2**62]), ints(g, [0])),
                       g.op("Slice", x, ints(g, [0]), ints(g, [1]), ints(g, [0])), axis=0)
        return g.op("Sub", x, shifted)
    assert_dependent(graph_of(build2, declare=("batch", 6)), "Slice", "batch axis")


def test_product_across_requests():
    g = graph_of(lambda g, x: g.op("MatMul", g.op("Softmax", g.op("MatMul", x, g.op("Transpose", x)), axis=-1), x))
    assert_dependent(g, "MatMul", "batch")


def test_if_whose_condition_reads_the_batch():
    def build(g, x):
        cond = g.op("Greater", g.op("ReduceSum", x, keepdims=0), const(g, 0.0))
        then_b, else_b = g.subgraph("then"), g.subgraph("else")
        then_b.outputs = [then_b.op("Relu", x)]
        else_b.outputs = [else_b.op("Neg", x)]
        return g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}, num_outputs=1).output
    g = graph_of(build)
    r = analyze_batching(g)
    assert not r.batchable and r.op == "ReduceSum", r.reason  # the first node that mixed rows


def test_dependent_op_inside_a_loop_body():
    def build(g, x):
        body = g.subgraph("body")
        body.add_input("i", "int64", ())
        cond = body.add_input("cond", "bool", ())
        acc = body.add_input("acc", "float32", ("batch", 6))
        centred = body.op("Sub", acc, body.op("ReduceMean", acc, ints(body, [0]), keepdims=1))
        body.outputs = [body.op("Identity", cond), centred]
        return g.add_node("Loop", [ints(g, 2), None, x], {"body": body}, num_outputs=1).output
    assert_dependent(graph_of(build), "ReduceMean", "batch axis")


def test_op_without_a_rule_is_dependent():
    def build(g, x):  # ScatterND writing into row 0 of every batch: has no rule
        return g.op("ScatterND", x, ints(g, [[0]]), const(g, np.zeros((1, 6))))
    assert ("", "ScatterND") not in RULES
    assert_dependent(graph_of(build), "ScatterND", "unknown means dependent")


def test_no_shared_batch_symbol():
    g = graph_of(lambda g, x: g.op("Relu", x), shape=(4, 6))
    r = analyze_batching(g)
    assert not r.batchable and r.symbol is None and "no symbolic dim 0" in r.reason


def test_reason_names_the_module_path_and_source():
    g = graph_of(lambda g, x: g.op("Sub", x, g.op("ReduceMean", x, ints(g, [0]), keepdims=1)))
    node = next(n for n in g.nodes if n.op == "ReduceMean")
    node.meta.update({"scope": "head.norm", "source": "model.py:12"})
    r = analyze_batching(g)
    assert (r.scope, r.source) == ("head.norm", "model.py:12")
    assert "head.norm" in r.reason and "model.py:12" in r.reason
    assert r.to_json()["module"] == "head.norm"


def test_every_rule_names_a_registered_op():
    registered = {(s.domain, s.name) for s in all_schemas()}
    assert set(RULES) <= registered, set(RULES) - registered


def test_fused_bodies_are_analysed():
    from kiln.ir.passes import fuse_elementwise

    def row_wise(g, x):
        y = g.op("Add", g.op("Mul", x, const(g, 2.0)), const(g, 1.0))
        return g.op("Tanh", g.op("Relu", y))

    def over_n(g, x):  # (2x + 1) / N, the division fused with the rest
        n = g.op("Cast", g.op("Gather", g.op("Shape", x), ints(g, 0)), to=1)
        return g.op("Div", g.op("Add", g.op("Mul", x, const(g, 2.0)), const(g, 1.0)), n)

    for build, batchable in ((row_wise, True), (over_n, False)):
        g = graph_of(build)
        fuse_elementwise(g)
        assert any(n.domain == "kiln" for n in g.nodes), str(g)
        if batchable:
            assert_batchable(g)
        else:
            assert_dependent(g, "Div", "batch size")
