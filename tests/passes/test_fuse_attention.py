"""fuse_attention / kiln.FusedAttention: which chains fuse (a Mul, Div or no scale; an additive
mask of [B, 1, 1, Lk] or [Lq, Lk], either operand order; a bool mask through Where(cond, -inf, s)
as GPT and causal SDPA trace it; symbolic batch and sequence dims; inside an If branch), what is
left alone (an intermediate read twice, or a graph output, a softmax over another axis, ranks that
differ, broadcast batch dims, a computed scale, a finite mask fill, unknown dims), the body's
layout (checked by hand, not through attention_parts), idempotence, the order of the GPU loader
(fuse_attention, fuse_elementwise, fuse_epilogues: the other two leave the node alone, and run
first they would break the chain), and that fused graphs compute what the unfused ones do: in the
reference evaluator, in the CPU runtime for the zoo's transformers, after a .kiln round trip and in
onnxruntime after ONNX export."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.ir import Graph, evaluate, verify
from kiln.ir.ops.fused import attention_parts
from kiln.ir.passes import fuse_attention, fuse_elementwise, fuse_epilogues, infer_shapes
from kiln.ir.types import TensorType

RNG = np.random.default_rng(0)
H, D, DV = 2, 4, 3


def attention(g: Graph) -> bool:
    """The pass as check_pass wants it (a bool: whether it changed the graph)."""
    return fuse_attention(g) > 0


def gpu_passes(g: Graph) -> tuple:
    """The three fusion passes in CudaProgram's order; returns what each made."""
    return fuse_attention(g), fuse_elementwise(g), fuse_epilogues(g)


def attention_nodes(g: Graph) -> list:
    return [n for n in g.walk() if n.qualified_op == "kiln.FusedAttention"]


def body_ops(node) -> list:
    return [n.op for n in node.attrs["body"].nodes]


def feeds_for(g: Graph, batch: int = 2, seq: int = 5, seed: int = 0) -> dict:
    return graph_feeds.feeds_for(g, batch, seed, seq=seq)


def qkv(g: Graph, batch="batch", seq="seq") -> tuple:
    """Graph inputs q [batch, H, seq, D], k (transposed in the graph, as traced) and v."""
    q = g.add_input("q", "float32", (batch, H, seq, D))
    k = g.add_input("k", "float32", (batch, H, seq, D))
    v = g.add_input("v", "float32", (batch, H, seq, DV))
    return q, g.op("Transpose", k, perm=(0, 1, 3, 2)), v


def chain(g: Graph, q, kt, v, *, scale="mul", mask=None, mask_first=False, softmax_axis=-1):
    """softmax(q @ kt [* c | / c] [+ mask]) @ v with plain ops; ``scale``: None, "mul", "mul_first"
    (c * s) or "div"."""
    s = g.op("MatMul", q, kt)
    if scale in ("mul", "mul_first"):
        c = g.add_constant(np.array(D ** -0.5, np.float32), "scale")
        s = g.op("Mul", *((c, s) if scale == "mul_first" else (s, c)))
    elif scale == "div":
        s = g.op("Div", s, g.add_constant(np.array(D ** 0.5, np.float32), "scale"))
    if mask is not None:
        s = g.op("Add", *((mask, s) if mask_first else (s, mask)))
    return g.op("MatMul", g.op("Softmax", s, axis=softmax_axis), v)


def assert_layout(node, outer: list, scale: float, mask: bool) -> None:
    """The contract the CUDA kernel relies on, checked by hand (then through attention_parts)."""
    body = node.attrs["body"]
    assert list(node.inputs) == outer and len(body.inputs) == len(outer)
    q, kt, v = body.inputs[:3]
    first, *middle, softmax, last = body.nodes
    assert first.op == "MatMul" and list(first.inputs) == [q, kt]
    assert [n.op for n in middle] in ([], ["Mul"], ["Div"], ["Add"], ["Mul", "Add"], ["Div", "Add"])
    assert (middle[-1].op == "Add" and body.inputs[3] in middle[-1].inputs) if mask else len(body.inputs) == 3
    assert softmax.op == "Softmax" and softmax.attrs.get("axis", -1) in (-1, len(q.type.shape) - 1)
    assert last.op == "MatMul" and last.inputs[1] is v and body.outputs == [last.outputs[0]]
    for prev, nxt in zip(body.nodes, body.nodes[1:]):
        assert [u for u, _ in prev.outputs[0].uses] == [nxt]
    assert [c.const.size for c in body.initializers.values()] == ([1] if middle and middle[0].op != "Add" else [])
    assert attention_parts(body) == {"scale": pytest.approx(scale, rel=1e-6), "mask": mask, "safe": False}


# --------------------------------------------------------------------------- what fuses


@pytest.mark.parametrize("mask_shape", [None, ("batch", 1, 1, "seq"), ("seq", "seq")])
@pytest.mark.parametrize("scale", [None, "mul", "mul_first", "div"])
def test_pattern_variants(check_pass, scale, mask_shape):
    g = Graph("attention")
    q, kt, v = qkv(g)
    mask = None if mask_shape is None else g.add_input("mask", "float32", mask_shape)
    out = chain(g, q, kt, v, scale=scale, mask=mask, mask_first=scale == "mul_first")
    g.outputs = [g.op("Relu", out)]  # a reader after the chain keeps reading the same Value
    check_pass(attention, g, feeds_for(g))
    (node,) = attention_nodes(g)
    assert [n.op for n in g.nodes] == ["Transpose", "FusedAttention", "Relu"]
    outer = [q, kt, v] + ([mask] if mask is not None else [])
    assert_layout(node, outer, 1.0 if scale is None else D ** -0.5, mask is not None)
    assert node.outputs == [out] and out.name == "matmul_1" and out.users == [g.nodes[-1]]
    assert out.type == TensorType("float32", ("batch", H, "seq", DV))
    assert node.name == "attention" and not g.initializers  # the scale moved into the body
    for batch, seq in ((1, 3), (3, 7)):  # the symbolic dims stay symbolic
        feeds = feeds_for(g, batch, seq, seed=batch)
        np.testing.assert_allclose(kiln.load(g).run(feeds, as_list=True)[0], evaluate(g, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fill_first", [True, False])
@pytest.mark.parametrize("constant", [False, True])
def test_bool_mask_through_where(check_pass, fill_first, constant):
    """GPT's masked_fill (Where(cond, -inf, s)) and causal SDPA's Where(cond, s, -inf) become an
    additive mask Where(cond, -inf, 0) outside the node (a constant for a constant condition)."""
    g = Graph("causal")
    seq = 6 if constant else "seq"
    q, kt, v = qkv(g, seq=seq)
    if constant:
        ones = np.ones((6, 6), bool)
        cond = g.add_initializer("cond", np.triu(ones, 1) if fill_first else np.tril(ones))
    else:
        cond = g.add_input("cond", "bool", ("seq", "seq"))
    s = g.op("Mul", g.op("MatMul", q, kt), g.add_constant(np.array(0.5, np.float32), "scale"))
    ninf = g.add_constant(np.array(-np.inf, np.float32), "ninf")
    s = g.op("Where", cond, ninf, s) if fill_first else g.op("Where", cond, s, ninf)
    g.outputs = [g.op("MatMul", g.op("Softmax", s, axis=-1), v)]
    feeds = feeds_for(g)
    if not constant:  # never a fully masked row (NaN either way)
        feeds["cond"] = np.triu(np.ones((5, 5), bool), 1) if fill_first else np.tril(np.ones((5, 5), bool))
    check_pass(attention, g, feeds)
    (node,) = attention_nodes(g)
    mask = node.inputs[3]
    assert mask.type == TensorType("float32", (seq, seq))
    assert_layout(node, [q, kt, v, mask], 0.5, True)
    assert body_ops(node) == ["MatMul", "Mul", "Add", "Softmax", "MatMul"]
    if constant:
        assert mask.const is not None and set(np.unique(mask.const)) == {0.0, -np.inf}
        assert np.array_equal(np.isneginf(mask.const), cond.const if fill_first else ~cond.const)
        assert set(g.initializers) == {mask.name}  # cond, -inf and the scale are gone
        assert [n.op for n in g.nodes] == ["Transpose", "FusedAttention"]
    else:
        where = mask.producer
        assert where.op == "Where" and where.inputs[0] is cond
        assert [x.const.item() for x in where.inputs[1:]] == ([-np.inf, 0.0] if fill_first else [0.0, -np.inf])
        assert [n.op for n in g.nodes] == ["Transpose", "Where", "FusedAttention"]


def _safe_softmax_chain(g, q, kt, v, cond):
    """kiln's trace of F.scaled_dot_product_attention with a bool mask on torch >= 2.5 (frontend/torch_ops/
    attention.py): Where(cond, s, -inf), then the safe softmax Where(Equal(ReduceMax(s), -inf), 0, Softmax(s))."""
    s = g.op("Mul", g.op("MatMul", q, kt), g.add_constant(np.array(0.5, np.float32), "scale"))
    s = g.op("Where", cond, s, g.add_constant(np.array(-np.inf, np.float32), "ninf"))
    p = g.op("Softmax", s, axis=-1)
    mx = g.op("ReduceMax", s, g.add_constant(np.array([-1], np.int64), "axes"), keepdims=1)
    empty = g.op("Equal", mx, g.add_constant(np.array(-np.inf, np.float32), "ninf"))
    return g.op("MatMul", g.op("Where", empty, g.add_constant(np.array(0.0, np.float32), "zero"), p), v)


def test_safe_softmax_fuses_and_keeps_zeros_for_fully_masked_rows(check_pass):
    """torch's _safe_softmax tail moves into the body (attention_parts says safe): a fully masked row
    gives zeros in the fused graph as in the unfused one, in the evaluator and in the CPU runtime."""
    g = Graph("sdpa_mask")
    q, kt, v = qkv(g, seq=5)
    cond = g.add_input("cond", "bool", ("batch", 1, 5, 5))
    g.outputs = [g.op("Relu", _safe_softmax_chain(g, q, kt, v, cond))]
    feeds = feeds_for(g)
    c = np.ones((2, 1, 5, 5), bool)
    c[0, 0, 2] = False          # query 2 of sequence 0 sees no key
    c[1, 0, :, 3:] = False      # padding
    feeds["cond"] = c
    want = evaluate(g, feeds)[0]
    assert np.all(want[0, :, 2] == 0) and np.isfinite(want).all()
    check_pass(attention, g, feeds)
    (node,) = attention_nodes(g)
    assert body_ops(node) == ["MatMul", "Mul", "Add", "Softmax", "ReduceMax", "Equal", "Where", "MatMul"]
    assert attention_parts(node.attrs["body"]) == {"scale": 0.5, "mask": True, "safe": True}
    assert [n.op for n in g.nodes] == ["Transpose", "Where", "FusedAttention", "Relu"]
    verify(g)
    np.testing.assert_allclose(kiln.load(g).run(feeds, as_list=True)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_safe_softmax_fuses_after_a_half_conversion(precision):
    """The -inf and 0 of the mask and the safe softmax are half constants after kiln's conversion (bfloat16's
    from ml_dtypes, no np.floating subtype): the chain is still recognized."""
    pytest.importorskip("ml_dtypes")
    from kiln.ir.passes.precision import convert_precision
    g = Graph("sdpa_half")
    q, kt, v = qkv(g, seq=5)
    cond = g.add_input("cond", "bool", ("batch", 1, 5, 5))
    g.outputs = [g.op("Relu", _safe_softmax_chain(g, q, kt, v, cond))]
    convert_precision(g, precision)
    assert fuse_attention(g) == 1
    (node,) = attention_nodes(g)
    assert attention_parts(node.attrs["body"])["safe"]


def test_safe_softmax_variants_left_alone(check_pass):
    """A tail that is not exactly the safe softmax (ReduceMax over another axis, Where's fill not 0)."""
    for axis, fill in ((2, 0.0), (-1, 1.0)):
        g = Graph("alone")
        q, kt, v = qkv(g, seq=5)
        s = g.op("MatMul", q, kt)
        p = g.op("Softmax", s, axis=-1)
        mx = g.op("ReduceMax", s, g.add_constant(np.array([axis], np.int64), "axes"), keepdims=1)
        empty = g.op("Equal", mx, g.add_constant(np.array(-np.inf, np.float32), "ninf"))
        g.outputs = [g.op("MatMul", g.op("Where", empty, g.add_constant(np.array(fill, np.float32), "f"), p), v)]
        check_pass(attention, g, feeds_for(g), changes=False)


def test_two_layers_share_the_scale_constant(check_pass):
    """One scale initializer read by two chains (as CSE leaves it): each body gets its own copy,
    and the outer one goes once both are fused."""
    g = Graph("two")
    q, kt, v = qkv(g)
    h = chain(g, q, kt, v)
    c = h.producer.inputs[0].producer.inputs[0].producer.inputs[1]
    s = g.op("Mul", g.op("MatMul", h, g.op("Transpose", h, perm=(0, 1, 3, 2))), c)
    g.outputs = [g.op("MatMul", g.op("Softmax", s, axis=3), h)]
    check_pass(attention, g, feeds_for(g))
    first, second = attention_nodes(g)
    assert second.inputs[0] is first.outputs[0] and second.inputs[2] is first.outputs[0]
    assert (first.name, second.name) == ("attention", "attention_1") and not g.initializers
    assert_layout(second, list(second.inputs), D ** -0.5, False)


def test_small_constant_mask_stays_a_node_input(check_pass):
    g = Graph("const_mask")
    q, kt, v = qkv(g, seq=4)
    mask = g.add_initializer("mask", np.triu(np.full((4, 4), -1e4, np.float32), 1))
    g.outputs = [chain(g, q, kt, v, mask=mask)]
    check_pass(attention, g, feeds_for(g))
    (node,) = attention_nodes(g)
    assert node.inputs[3] is mask and "mask" in g.initializers
    assert list(node.attrs["body"].initializers.values())[0].const.size == 1


def test_inside_an_if_branch(tmp_path):
    g = Graph("control")
    q, kt, v = qkv(g)
    cond = g.op("Greater", g.op("ReduceSum", q, keepdims=0), g.add_constant(np.array(0, np.float32), "zero"))
    then_b = g.subgraph("then")
    then_b.outputs = [chain(then_b, q, kt, v, scale="div")]
    else_b = g.subgraph("else")
    else_b.outputs = [else_b.op("Neg", v)]
    g.outputs = [g.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}).outputs[0]]
    infer_shapes(g)
    before = g.copy()
    assert fuse_attention(g) == 1 and fuse_attention(g) == 0
    verify(g)
    (node,) = attention_nodes(g)
    assert node.graph is then_b and list(node.inputs) == [q, kt, v]  # outer values as node inputs
    assert then_b.outputs == node.outputs
    program = kiln.load(kiln.save(g, tmp_path / "control.kiln"))
    for seed in range(4):  # both branches
        feeds = feeds_for(g, seed=seed)
        np.testing.assert_allclose(program.run(feeds, as_list=True)[0], evaluate(before, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- what does not fuse


def _scores_read_twice(g, q, kt, v):  # kiln's SDPA with a float mask: a safe softmax reads the scores twice
    s = g.op("Add", g.op("MatMul", q, kt), g.add_constant(np.zeros((5, 5), np.float32), "mask"))
    return [g.op("MatMul", g.op("Softmax", s, axis=-1), v), g.op("ReduceMax", s, keepdims=0)]


def _probs_read_twice(g, q, kt, v):
    s = g.op("MatMul", q, kt)
    p = g.op("Softmax", s, axis=-1)
    return [g.op("MatMul", p, v), g.op("ReduceSum", p, keepdims=0)]


def _scaled_is_an_output(g, q, kt, v):
    s = g.op("Mul", g.op("MatMul", q, kt), g.add_constant(np.array(0.5, np.float32), "c"))
    return [g.op("MatMul", g.op("Softmax", s, axis=-1), v), s]


def _softmax_over_lq(g, q, kt, v):
    return [chain(g, q, kt, v, softmax_axis=2)]


def _v_of_lower_rank(g, q, kt, v):
    return [chain(g, q, kt, g.add_constant(RNG.standard_normal((5, DV)).astype(np.float32), "v2"))]


def _broadcast_kt(g, q, kt, v):
    k1 = g.add_constant(RNG.standard_normal((1, H, D, 5)).astype(np.float32), "k1")
    return [chain(g, q, k1, v)]


def _computed_scale(g, q, kt, v):
    c = g.op("ReduceMean", q, keepdims=1)  # [batch, 1, 1, 1]
    s = g.op("Mul", g.op("MatMul", q, kt), c)
    return [g.op("MatMul", g.op("Softmax", s, axis=-1), v)]


def _finite_fill(g, q, kt, v):  # Where(cond, -1e9, s) is not s + Where(cond, -1e9, 0)
    cond = g.add_initializer("cond", np.triu(np.ones((5, 5), bool), 1))
    s = g.op("Where", cond, g.add_constant(np.array(-1e9, np.float32), "fill"), g.op("MatMul", q, kt))
    return [g.op("MatMul", g.op("Softmax", s, axis=-1), v)]


def _rank_two(g, q, kt, v):
    q2 = g.add_constant(RNG.standard_normal((5, D)).astype(np.float32), "q2")
    k2 = g.add_constant(RNG.standard_normal((D, 5)).astype(np.float32), "k2")
    v2 = g.add_constant(RNG.standard_normal((5, DV)).astype(np.float32), "v2")
    return [g.op("Relu", chain(g, g.op("Relu", q2), g.op("Relu", k2), g.op("Relu", v2)))]


@pytest.mark.parametrize("build", [_scores_read_twice, _probs_read_twice, _scaled_is_an_output, _softmax_over_lq,
                                   _v_of_lower_rank, _broadcast_kt, _computed_scale, _finite_fill, _rank_two])
def test_left_alone(check_pass, build):
    g = Graph("alone")
    q, kt, v = qkv(g, seq=5)
    g.outputs = build(g, q, kt, v)
    check_pass(attention, g, feeds_for(g), changes=False)


def test_unknown_dims_are_left_alone():
    g = Graph("unknown")
    q, kt, v = qkv(g, seq=None)
    g.outputs = [chain(g, q, kt, v)]
    infer_shapes(g)
    assert fuse_attention(g) == 0


# --------------------------------------------------------------------------- with the other passes


def bert_block() -> Graph:
    """A post-norm encoder layer: QKV projections (MatMul + bias), attention with a [B, 1, 1, S]
    mask, output projection + residual, a LayerNorm written out in elementwise ops."""
    g = Graph("block")
    d = H * D
    x = g.add_input("x", "float32", ("batch", "seq", d))
    mask = g.add_input("mask", "float32", ("batch", 1, 1, "seq"))
    shape = g.add_constant(np.array([0, 0, H, D], np.int64), "heads")

    def proj(h, name):
        w = g.add_constant(RNG.standard_normal((d, d)).astype(np.float32) * 0.3, f"w_{name}")
        return g.op("Add", g.op("MatMul", h, w), g.add_constant(RNG.standard_normal(d).astype(np.float32), f"b_{name}"))

    def heads(h, perm):
        return g.op("Transpose", g.op("Reshape", h, shape), perm=perm)

    q, kt, v = heads(proj(x, "q"), (0, 2, 1, 3)), heads(proj(x, "k"), (0, 2, 3, 1)), heads(proj(x, "v"), (0, 2, 1, 3))
    a = chain(g, q, kt, v, scale="div", mask=mask)
    a = g.op("Reshape", g.op("Transpose", a, perm=(0, 2, 1, 3)), g.add_constant(np.array([0, 0, d], np.int64), "merge"))
    r = g.op("Add", proj(a, "o"), x)
    axes = g.add_constant(np.array([-1], np.int64), "axes")
    centred = g.op("Sub", r, g.op("ReduceMean", r, axes))
    var = g.op("ReduceMean", g.op("Mul", centred, centred), axes)
    eps = g.add_constant(np.array(1e-5, np.float32), "eps")
    g.outputs = [g.op("Div", centred, g.op("Sqrt", g.op("Add", var, eps)))]
    infer_shapes(g)
    return g


def test_the_gpu_order_keeps_the_node_and_the_outputs(tmp_path):
    g = bert_block()
    before = g.copy()
    made = gpu_passes(g)
    verify(g)
    (node,) = attention_nodes(g)
    assert made[0] == 1 and made[1] >= 1 and made[2] >= 4  # the four projections got their epilogues
    assert node.graph is g and body_ops(node) == ["MatMul", "Div", "Add", "Softmax", "MatMul"]
    # No other fused body holds attention ops, and nothing read the node as an anchor or a consumer.
    for n in g.nodes:
        if n.domain == "kiln" and n is not node:
            assert not {"Softmax", "Div"} & set(body_ops(n)) or n.op == "FusedElementwise"
            assert node.outputs[0] not in [v for inner in n.attrs["body"].nodes for v in inner.outputs]
    text = str(g)
    assert gpu_passes(g) == (0, 0, 0) and str(g) == text
    program = kiln.load(kiln.save(g, tmp_path / "block.kiln"))
    unfused = kiln.load(before)
    for batch, seq in ((1, 3), (2, 6)):
        feeds = feeds_for(g, batch, seq, seed=seq)
        np.testing.assert_allclose(program.run(feeds, as_list=True)[0], unfused.run(feeds, as_list=True)[0],
                                   rtol=1e-5, atol=1e-5)


def test_fused_nodes_are_not_entered_and_the_other_order_breaks_the_chain():
    """Run first, fuse_epilogues takes the score MatMul and its scale (MatMul -> Div) as an
    epilogue and fuse_elementwise the scale and mask (Div -> Add) as a group: why attention goes first."""
    for first in (fuse_epilogues, fuse_elementwise):
        g = Graph("order")
        q, kt, v = qkv(g)
        mask = g.add_input("mask", "float32", ("batch", 1, 1, "seq"))
        g.outputs = [chain(g, q, kt, v, scale="div", mask=mask)]
        infer_shapes(g)
        assert first(g) == 1 and fuse_attention(g) == 0
    g = Graph("order")
    q, kt, v = qkv(g)
    g.outputs = [chain(g, q, kt, v, scale="div")]
    infer_shapes(g)
    assert fuse_attention(g) == 1
    body = attention_nodes(g)[0].attrs["body"]
    text = str(body)
    assert fuse_elementwise(g) == 0 and fuse_epilogues(g) == 0 and str(body) == text


# --------------------------------------------------------------------------- zoo, files, ONNX

torch = pytest.importorskip("torch")
import zoo  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402
import graph_feeds

TRANSFORMERS = [e for e in zoo.params() if e.values[0].name in ("transformer_encoder", "gpt", "sdpa", "hf_bert")]

# FusedAttention nodes the traced zoo models get: one per layer. transformer_encoder's keys' length
# is known since shape inference keeps the known pieces of a partly computed shape (a Concat of
# [batch * heads, seq, head_dim] pieces: it fused none while the whole shape came out unknown);
# gpt (masked_fill with -inf) and sdpa (is_causal) fuse through their Where masks.
EXPECTED = {"transformer_encoder": 2, "gpt": 2, "sdpa": 1}


def fused_zoo_graph(name: str):
    model, inputs, spec = zoo.by_name(name).factory()
    g = kiln.trace(model, inputs, dynamic=spec)
    before = g.copy()
    made = gpu_passes(g)
    return model, inputs, spec, before, g, made


@pytest.mark.parametrize("entry", TRANSFORMERS)
def test_zoo_models_compute_the_same_in_the_cpu_runtime(entry):
    model, inputs, spec, before, g, made = fused_zoo_graph(entry.name)
    verify(g)
    nodes = attention_nodes(g)
    print(f"{entry.name}: {len(nodes)} FusedAttention nodes")
    assert made[0] == len(nodes)
    if entry.name in EXPECTED:
        assert len(nodes) == EXPECTED[entry.name]
    for n in nodes:
        attention_parts(n.attrs["body"])
    assert gpu_passes(g) == (0, 0, 0)
    unfused, fused = kiln.load(before), kiln.load(g)
    for k, sizes in enumerate(entry.other_sizes):
        names, tensors = zoo.fresh_inputs(model, inputs, spec, sizes, seed=k)
        feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
        for w, o in zip(unfused.run(feeds, as_list=True), fused.run(feeds, as_list=True)):
            assert (o.dtype, o.shape) == (w.dtype, w.shape)
            # The reference evaluator gives the fused and unfused graphs bit for bit the same; the
            # CPU kernels of the two plans differ by an ulp (GPT's logits reach 13: atol).
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)


def test_bench_bert_gets_one_node_per_layer():
    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_models.py"
    spec = importlib.util.spec_from_file_location("gpu_models", path)
    gpu_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_models)
    model, inputs, dynamic = gpu_models.bert(batch=2, layers=2)
    g = kiln.trace(model, inputs, dynamic=dynamic)
    assert fuse_attention(g) == 2
    nodes = attention_nodes(g)
    assert len(nodes) == 2 and all(n.graph is g for n in nodes)
    for n in nodes:
        assert body_ops(n) == ["MatMul", "Mul", "Softmax", "MatMul"]
        assert attention_parts(n.attrs["body"]) == {"scale": pytest.approx(64 ** -0.5), "mask": False, "safe": False}
        assert n.outputs[0].type == TensorType("float32", ("batch", 12, 128, 64))


def test_save_load_round_trip(tmp_path):
    _, _, _, _, g, _ = fused_zoo_graph("gpt")
    loaded = kiln.load_graph(kiln.save(g, tmp_path / "fused.kiln"))
    verify(loaded)
    assert str(loaded) == str(g) and len(attention_nodes(loaded)) == 2
    feeds = {"idx": np.random.default_rng(1).integers(0, 64, (2, 7)).astype(np.int64)}
    for w, o in zip(evaluate(g, feeds), kiln.load(loaded).run(feeds, as_list=True)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "block"])
def test_fused_graph_exports_to_onnx(name):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer.onnx import to_onnx_model

    if name == "block":  # Div scale, [B, 1, 1, S] mask
        g = bert_block()
        gpu_passes(g)
        feeds = feeds_for(g, 2, 6)
    else:
        model, inputs, spec, _, g, _ = fused_zoo_graph(name)
        names, tensors = zoo.fresh_inputs(model, inputs, spec, {"batch": 2, "seq": 6}, seed=5)
        feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
    assert attention_nodes(g)
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    assert not {n.domain for n in proto.graph.node} - {"", "ai.onnx"}
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, o in zip(kiln.load(g).run(feeds, as_list=True), got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5)
