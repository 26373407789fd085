"""ai.onnx ``LinearAttention`` (27) and ``TensorScatter`` (24): each against ONNX's reference evaluator over its
attributes and input forms (update rules, per-head and per-key decay, scalar beta, GQA/MQA, past state, explicit
scale, 16-bit types; linear/circular modes, axes, omitted write indices), independent checks (linear attention is
causal q kᵀ v; a sequence run in pieces through present_state equals one run), edge cases (empty sequence and
batch), every backend through the op suite, import at the ops' opsets, the export's ONNX expansion with run-time
head sizes, and the named inference errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph, evaluate
from op_harness import build_single, check_op, inferred

la_ref = pytest.importorskip("onnx.reference.ops.op_linear_attention")
ts_ref = pytest.importorskip("onnx.reference.ops.op_tensor_scatter")
RNG = np.random.default_rng(27)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def onnx_linear_attention(query, key, value, past_state=None, decay=None, beta=None, **attrs):
    node = la_ref.LinearAttention.__new__(la_ref.LinearAttention)
    return node._run(query, key, value, past_state, decay, beta, chunk_size=attrs.get("chunk_size", 64),
                     kv_num_heads=attrs["kv_num_heads"], q_num_heads=attrs["q_num_heads"],
                     scale=attrs.get("scale", 0.0), update_rule=attrs.get("update_rule", "gated_delta"))


def onnx_tensor_scatter(past, update, write_indices=None, **attrs):
    node = ts_ref.TensorScatter.__new__(ts_ref.TensorScatter)
    return node._run(past, update, write_indices, mode=attrs.get("mode", "linear"), axis=attrs.get("axis", -2))[0]


def l2_normalized(x, heads):
    b, t, hd = x.shape
    x4 = x.reshape(b, t, heads, hd // heads)
    return (x4 / np.maximum(np.linalg.norm(x4, axis=-1, keepdims=True), 1e-6)).reshape(b, t, hd).astype(x.dtype)


def la_inputs(rule, hq=4, hkv=2, b=2, t=5, dk=4, dv=3, past=False, per_head_decay=False, scalar_beta=False,
              dtype=np.float32, state_dtype=None):
    """LinearAttention inputs (None where omitted) for one rule, as the node suite builds them."""
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    q, v = rand(b, t, hq * dk, dtype=dtype), rand(b, t, hkv * dv, dtype=dtype)
    k = rand(b, t, hkv * dk, dtype=dtype)
    if delta:
        k = l2_normalized(k, hkv)
    state = (rand(b, hkv, dk, dv) * 0.1).astype(state_dtype or dtype) if past else None
    decay = (-np.abs(rand(b, t, hkv if per_head_decay else hkv * dk)) * 0.1).astype(dtype) if gated else None
    beta = RNG.uniform(0, 1, (b, t, 1 if scalar_beta else hkv)).astype(dtype) if delta else None
    return [q, k, v, state, decay, beta]


def trimmed(inputs):
    inputs = list(inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs


# --------------------------------------------------------------------------- LinearAttention

@pytest.mark.parametrize("rule,heads,past", list(itertools.product(
    ["linear", "gated", "delta", "gated_delta"], [(4, 4), (4, 2), (4, 1)], [False, True])))
def test_linear_attention_matches_onnx_reference(rule, heads, past):
    hq, hkv = heads
    inputs = la_inputs(rule, hq, hkv, past=past)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "update_rule": rule}
    want = onnx_linear_attention(*inputs, **attrs)
    check_op("LinearAttention", trimmed(inputs), list(want), attrs, num_outputs=2, rtol=1e-5, atol=1e-5,
             symbolic_batch=True)


@pytest.mark.parametrize("per_head_decay,scalar_beta,scale", [(True, False, 0.0), (False, True, 0.0),
                                                              (True, True, 0.25), (False, False, -1.5)])
def test_decay_and_beta_forms_and_explicit_scale(per_head_decay, scalar_beta, scale):
    inputs = la_inputs("gated_delta", past=True, per_head_decay=per_head_decay, scalar_beta=scalar_beta)
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "scale": scale, "chunk_size": 2}
    want = onnx_linear_attention(*inputs, **attrs)
    check_op("LinearAttention", inputs, list(want), attrs, num_outputs=2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_16_bit_types_compute_in_float32_and_round_once(dtype):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    inputs = la_inputs("gated_delta", 8, 4, past=True, dtype=dt)
    attrs = {"q_num_heads": 8, "kv_num_heads": 4}
    want = onnx_linear_attention(*inputs, **attrs)
    out, state = check_op("LinearAttention", inputs, None, attrs, num_outputs=2)
    assert out.dtype == dt and state.dtype == dt
    # The same float32 computation rounded once: equal to ONNX's up to a float32 rounding that crosses a 16-bit step.
    step = 2.0 ** -10 if dtype == np.float16 else 2.0 ** -7
    for got, w in zip((out, state), want):
        np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), rtol=step, atol=step * 1e-2)


def test_state_type_may_differ_from_the_query_type():
    """T float16 with S float32: present_state keeps past_state's type; without past_state it takes query's."""
    inputs = la_inputs("gated", dtype=np.float16, past=True, state_dtype=np.float32)
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "update_rule": "gated"}
    want = onnx_linear_attention(*inputs, **attrs)
    out, state = check_op("LinearAttention", trimmed(inputs), list(want), attrs, num_outputs=2, rtol=1e-3, atol=1e-3)
    assert (out.dtype, state.dtype) == (np.float16, np.float32)
    inputs[3] = None
    assert inferred("LinearAttention", trimmed(inputs), attrs, num_outputs=2) == [("batch", 5, 12), ("batch", 2, 4, 3)]
    g, _ = build_single("LinearAttention", trimmed(inputs), attrs, num_outputs=2)
    assert g.outputs[1].type.dtype.numpy == np.float16


def test_linear_rule_is_causal_unnormalized_attention():
    """An independent oracle: with the linear rule, o_t = scale * sum_{s <= t} (q_t . k_s) v_s per head."""
    q, k, v, *_ = la_inputs("linear", 2, 2, b=1, t=6, dk=4, dv=5)
    (out, state) = check_op("LinearAttention", [q, k, v], None, {"q_num_heads": 2, "kv_num_heads": 2,
                                                                 "update_rule": "linear"}, num_outputs=2)
    q4, k4, v4 = (x.astype(np.float64).reshape(1, 6, 2, -1).transpose(0, 2, 1, 3) for x in (q, k, v))
    scores = q4 @ k4.transpose(0, 1, 3, 2) * np.tril(np.ones((6, 6))) / 2.0  # scale 1/sqrt(4)
    want = (scores @ v4).transpose(0, 2, 1, 3).reshape(1, 6, 10)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, k4.transpose(0, 1, 3, 2) @ v4, rtol=1e-5, atol=1e-5)


def test_a_sequence_in_pieces_through_present_state_equals_one_run():
    q, k, v, _, decay, beta = la_inputs("gated_delta", 4, 2, t=6)
    attrs = {"q_num_heads": 4, "kv_num_heads": 2}
    whole, final = check_op("LinearAttention", [q, k, v, None, decay, beta], None, attrs, num_outputs=2)
    state, pieces = None, []
    for lo, hi in ((0, 1), (1, 4), (4, 6)):  # a decode step, a prefill chunk, the rest
        out, state = check_op("LinearAttention", [x[:, lo:hi] if x.ndim == 3 else x for x in (q, k, v)]
                              + [state, decay[:, lo:hi], beta[:, lo:hi]], None, attrs, num_outputs=2)
        pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, final, rtol=1e-5, atol=1e-6)


def test_empty_sequence_and_empty_batch():
    attrs = {"q_num_heads": 4, "kv_num_heads": 2}
    inputs = la_inputs("gated_delta", t=0, past=True)
    out, state = check_op("LinearAttention", inputs, list(onnx_linear_attention(*inputs, **attrs)), attrs,
                          num_outputs=2)
    assert out.shape == (2, 0, 12)
    np.testing.assert_array_equal(state, inputs[3])  # no token: the past state as it was
    inputs = la_inputs("gated_delta", b=0)
    out, state = check_op("LinearAttention", inputs, None, attrs, num_outputs=2)
    assert out.shape == (0, 5, 12) and state.shape == (0, 2, 4, 3)


def _la_model(opset: int):
    from onnx import TensorProto, helper
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, f, s) for n, s in (("q", [1, 3, 8]), ("k", [1, 3, 8]), ("v", [1, 3, 4]),
                                                                ("beta", [1, 3, 2]))]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "s")]
    node = helper.make_node("LinearAttention", ["q", "k", "v", "", "", "beta"], ["y", "s"], update_rule="delta",
                            q_num_heads=2, kv_num_heads=2)
    return helper.make_model(helper.make_graph([node], "la", ins, outs), opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [27, 28])
def test_linear_attention_imports_and_runs(opset):
    p = kiln.load(kiln.import_onnx(_la_model(opset)))
    q, k, v, _, _, beta = la_inputs("delta", 2, 2, b=1, t=3, dk=4, dv=2)
    want = onnx_linear_attention(q, k, v, beta=beta, q_num_heads=2, kv_num_heads=2, update_rule="delta")
    got = p.run({"q": q, "k": k, "v": v, "beta": beta})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["s"], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,steps", [(2, 3), (2, 0), (0, 3)])
def test_export_with_sizes_known_only_at_run_time(tmp_path, batch, steps):
    """The expansion reads dk and dv from the inputs' shapes when they are not static (the state's zeros, the
    per-head reshapes and the default scale), takes a run-time sequence length of 0 (an If around the Scan), and
    runs in onnxruntime as kiln does, empty batch included."""
    ort = pytest.importorskip("onnxruntime")
    g = Graph("la")
    q, k, v = (g.add_input(n, "float32", ["b", "t", None]) for n in "qkv")
    decay = g.add_input("decay", "float32", ["b", "t", 2])
    y, s = g.op("LinearAttention", q, k, v, None, decay, q_num_heads=4, kv_num_heads=2, update_rule="gated",
                outputs=2)
    g.outputs = [y, s]
    path = tmp_path / "la.onnx"
    kiln.export_onnx(g, path, opset=18)
    feeds = {"q": rand(batch, steps, 16), "k": rand(batch, steps, 8), "v": rand(batch, steps, 6),
             "decay": -np.abs(rand(batch, steps, 2))}
    want = evaluate(g, list(feeds.values()))
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)


_Q, _K, _V = (2, 3, 8), (2, 3, 8), (2, 3, 6)


@pytest.mark.parametrize("shapes,attrs,match", [
    ([_Q, _K, _V], {"update_rule": "fast"}, "update_rule must be one of"),
    ([_Q, _K, _V], {"q_num_heads": 3}, r"q_num_heads \(3\) must be a positive multiple of kv_num_heads \(2\)"),
    ([_Q, _K, _V], {"kv_num_heads": 0}, "must be a positive multiple"),
    ([_Q, _K, _V], {}, "'gated_delta' needs decay input"),
    ([_Q, _K, _V, None, (2, 3, 2)], {"update_rule": "linear"}, "'linear' takes no decay input"),
    ([_Q, _K, _V, None, None, (2, 3, 2)], {"update_rule": "gated"}, "'gated' needs decay input"),
    ([_Q, _K, _V, None, (2, 3, 2), (2, 3, 2)], {"update_rule": "gated"}, "'gated' takes no beta input"),
    ([_Q, _K, _V, None, (2, 3, 3), (2, 3, 2)], {}, "decay's last dim must be kv_num_heads"),
    ([_Q, _K, _V, None, (2, 3, 2), (2, 3, 3)], {}, "beta's last dim must be kv_num_heads"),
    ([(2, 3, 8), (2, 3, 6), _V], {"update_rule": "linear"}, "query's head size is 4 .* but key's is 3"),
    ([(2, 3, 9), _K, _V], {"update_rule": "linear"}, "query's last dim 9 is not a multiple of its 2 heads"),
    ([_Q, _K, (2, 3, 5)], {"update_rule": "linear"}, "value's last dim 5 is not a multiple"),
    ([_Q, _K, (2, 4, 6)], {"update_rule": "linear"}, "the sequence length differs"),
    ([_Q, (3, 3, 4), _V], {"update_rule": "linear"}, "the batch size differs"),
    ([_Q, _K, _V, (2, 2, 2, 3)], {"update_rule": "linear"}, "dim 2 must be the dk 4, not 2"),
    ([_Q, _K, _V, (2, 2, 4)], {"update_rule": "linear"}, "past_state must be 4-D"),
    ([(2, 8), _K, _V], {"update_rule": "linear"}, "query must be 3-D"),
])
def test_linear_attention_inference_names_what_is_wrong(shapes, attrs, match):
    attrs = {"q_num_heads": 2, "kv_num_heads": 2, **attrs}
    inputs = trimmed([None if s is None else rand(*s) for s in shapes])
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("LinearAttention", inputs, attrs, num_outputs=2)


def test_linear_attention_type_errors():
    with pytest.raises(ShapeInferenceError, match="key is float16 but query is float32"):
        build_single("LinearAttention", [rand(*_Q), rand(*_K, dtype=np.float16), rand(*_V)],
                     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"}, num_outputs=2)
    with pytest.raises(KilnError, match="float64"):  # ONNX's types: float16, bfloat16, float32
        build_single("LinearAttention", [rand(*_Q, dtype=np.float64)] * 3,
                     {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"}, num_outputs=2)
    with pytest.raises(KilnError, match="needs attribute 'q_num_heads'"):
        build_single("LinearAttention", [rand(*_Q), rand(*_K), rand(*_V)], {"kv_num_heads": 2}, num_outputs=2)


# --------------------------------------------------------------------------- TensorScatter

@pytest.mark.parametrize("mode,axis,writes", list(itertools.product(
    ["linear", "circular"], [1, 2, -2, -1], [True, False])))
def test_tensor_scatter_matches_onnx_reference(mode, axis, writes):
    shape = [3, 4, 5, 2]
    update_shape = list(shape)
    update_shape[axis] = 2
    past, update = rand(*shape), rand(*update_shape)
    length = shape[axis]
    w = None
    if writes:  # circular mode wraps past the end; linear mode stays inside
        w = np.array([length - 1, 0, 1] if mode == "circular" else [length - 2, 0, (length - 2) // 2], np.int64)
    attrs = {"mode": mode, "axis": axis}
    check_op("TensorScatter", trimmed([past, update, w]), onnx_tensor_scatter(past, update, w, **attrs), attrs,
             symbolic_batch=True)


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.float16, np.bool_, np.float64])
def test_tensor_scatter_keeps_any_type(dtype):
    past = RNG.integers(0, 2, (2, 5, 3)).astype(dtype)
    update = RNG.integers(0, 2, (2, 3, 3)).astype(dtype)
    w = np.array([4, 2], np.int64)
    check_op("TensorScatter", [past, update, w], onnx_tensor_scatter(past, update, w, mode="circular"),
             {"mode": "circular"})


def test_tensor_scatter_node_suite_example():
    past = np.tile(np.array([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9], [8, 7, 6, 5, 4], [4, 3, 2, 1, 0]], np.float32),
                   (2, 1, 1, 1))
    update = np.array([[[[5, 5, 5, 5, 5], [6, 6, 6, 6, 6]]], [[[1, 1, 1, 1, 1], [2, 2, 2, 2, 2]]]], np.float32)
    (got,) = check_op("TensorScatter", [past, update, np.array([1, 3], np.int64)], None, {"mode": "circular"})
    np.testing.assert_array_equal(got[0, 0, 1:3], update[0, 0])
    np.testing.assert_array_equal(got[1, 0, [3, 0]], update[1, 0])  # wraps to the start
    np.testing.assert_array_equal(got[1, 0, 1:3], past[1, 0, 1:3])


def test_tensor_scatter_edges():
    past = rand(2, 4, 3)
    # nothing to write
    check_op("TensorScatter", [past, rand(2, 0, 3), np.array([4, 1], np.int64)], past)
    # the whole cache rewritten, rotated in circular mode
    update = rand(2, 4, 3)
    want = np.stack([np.roll(update[0], 1, axis=0), np.roll(update[1], 3, axis=0)])
    check_op("TensorScatter", [past, update, np.array([1, 3], np.int64)], want, {"mode": "circular"})
    # a negative write index counts from the end in circular mode (modulo the length)
    check_op("TensorScatter", [past, update[:, :1], np.array([-1, -6], np.int64)],
             onnx_tensor_scatter(past, update[:, :1], np.array([-1, -6]), mode="circular"), {"mode": "circular"})
    # an empty batch
    check_op("TensorScatter", [rand(0, 4, 3), rand(0, 2, 3)], np.zeros((0, 4, 3), np.float32))


@pytest.mark.parametrize("writes,match", [(np.array([3, 0]), "batch entry 0 writes 2 positions from 3, outside the 4"),
                                          (np.array([0, -1]), "batch entry 1 writes 2 positions from -1")])
def test_tensor_scatter_linear_mode_refuses_writes_outside_the_cache(writes, match):
    g, feeds = build_single("TensorScatter", [rand(2, 4, 3), rand(2, 2, 3), writes.astype(np.int64)])
    with pytest.raises(KilnError, match=match):
        evaluate(g, feeds)


def _ts_model(opset: int):
    from onnx import TensorProto, helper
    ins = [helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 4, 3]),
           helper.make_tensor_value_info("update", TensorProto.FLOAT, [2, 1, 3]),
           helper.make_tensor_value_info("w", TensorProto.INT64, [2])]
    node = helper.make_node("TensorScatter", ["past", "update", "w"], ["y"], mode="circular")
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph([node], "ts", ins, [out]),
                             opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [24, 28])
def test_tensor_scatter_imports_and_runs(opset):
    p = kiln.load(kiln.import_onnx(_ts_model(opset)))
    past, update, w = rand(2, 4, 3), rand(2, 1, 3), np.array([3, 5], np.int64)
    np.testing.assert_array_equal(p.run({"past": past, "update": update, "w": w})["y"],
                                  onnx_tensor_scatter(past, update, w, mode="circular"))


@pytest.mark.parametrize("shapes,attrs,match", [
    ([(2, 4, 3), (2, 2, 3)], {"axis": 0}, r"axis 0 is the batch dimension"),
    ([(2, 4, 3), (2, 2, 3)], {"axis": -3}, r"axis -3 is the batch dimension"),
    ([(2, 4, 3), (2, 2, 3)], {"axis": 3}, "axis 3 is out of range for rank 3"),
    ([(2, 4, 3), (2, 2, 3)], {"mode": "wrap"}, "mode must be one of linear, circular"),
    ([(2, 4, 3), (2, 5, 3)], {}, "update's sequence length 5 .* exceeds past_cache's 4"),
    ([(2, 4, 3), (2, 2, 4)], {}, "they may differ on axis 1 only, not on 2"),
    ([(2, 4, 3), (2, 2)], {}, "update has rank 2"),
    ([(2, 4, 3), (2, 2, 3), (3,)], {}, "write_indices has 3 entries for a batch of 2"),
])
def test_tensor_scatter_inference_names_what_is_wrong(shapes, attrs, match):
    inputs = [rand(*shapes[0]), rand(*shapes[1])] + ([np.zeros(shapes[2], np.int64)] if len(shapes) > 2 else [])
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("TensorScatter", inputs, attrs)


def test_tensor_scatter_type_errors():
    with pytest.raises(ShapeInferenceError, match="update is float16 but past_cache is float32"):
        build_single("TensorScatter", [rand(2, 4, 3), rand(2, 2, 3, dtype=np.float16)])
    with pytest.raises(KilnError, match="write_indices"):  # int64 only
        build_single("TensorScatter", [rand(2, 4, 3), rand(2, 2, 3), np.zeros(2, np.int32)])


def test_tensor_scatter_inference_keeps_symbols():
    assert inferred("TensorScatter", [rand(2, 4, 3), rand(2, 2, 3)]) == [("batch", 4, 3)]
    assert inferred("TensorScatter", [rand(2, 4, 3), rand(2, 2, 3), np.zeros(2, np.int64)]) == [(2, 4, 3)]


def test_shapes_known_only_at_run_time_are_checked_there():
    g = Graph("la")
    q, k, v = (g.add_input(n, "float32", ["b", "t", 8]) for n in "qkv")
    past = g.add_input("past", "float32", None)
    y, s = g.op("LinearAttention", q, k, v, past, q_num_heads=2, kv_num_heads=2, update_rule="linear", outputs=2)
    g.outputs = [y, s]
    with pytest.raises(KilnError, match=r"past_state has shape \[1, 2, 4, 4\], for query \[2, 3, 8\] it must be "
                                        r"\[2, 2, 4, 4\]"):
        evaluate(g, [rand(2, 3, 8), rand(2, 3, 8), rand(2, 3, 8), rand(1, 2, 4, 4)])
    g = Graph("ts")
    cache, update = g.add_input("cache", "float32", [2, 4, 3]), g.add_input("update", "float32", None)
    g.outputs = [g.op("TensorScatter", cache, update)]
    with pytest.raises(KilnError, match=r"update \[2, 2, 1\] must match past_cache \[2, 4, 3\] except on axis 1"):
        evaluate(g, [rand(2, 4, 3), rand(2, 2, 1)])
