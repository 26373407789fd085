"""ai.onnx ``Attention`` (23..25): inference, the reference against a plain numpy attention and against ONNX's
own reference evaluator over the op's options, every backend through the op suite, import of each version, and
the export refusal (the op is newer than the opsets kiln writes)."""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph
from op_harness import build_single, check_op

RNG = np.random.default_rng(23)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def plain(q, k, v, scale=None, bias=None):
    """softmax(q kᵀ * scale + bias) v in float64, 4-D."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if bias is not None:
        s = s + bias
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) @ v


def test_4d_attention_is_softmax_of_scaled_scores_times_v():
    q, k, v = rand(2, 3, 4, 8), rand(2, 3, 5, 8), rand(2, 3, 5, 6)
    (y,) = check_op("Attention", [q, k, v], plain(q, k, v).astype(np.float32), rtol=1e-5, atol=1e-6)
    assert y.shape == (2, 3, 4, 6)
    check_op("Attention", [q, k, v], plain(q, k, v, scale=0.3).astype(np.float32), {"scale": 0.3}, rtol=1e-5,
             atol=1e-6)


def test_3d_inputs_split_heads_and_gqa_repeats_each_kv_head():
    q, k, v = rand(2, 4, 4 * 8), rand(2, 5, 2 * 8), rand(2, 5, 2 * 6)
    q4 = q.reshape(2, 4, 4, 8).transpose(0, 2, 1, 3)
    k4 = np.repeat(k.reshape(2, 5, 2, 8).transpose(0, 2, 1, 3), 2, axis=1)  # kv heads [h0, h0, h1, h1]
    v4 = np.repeat(v.reshape(2, 5, 2, 6).transpose(0, 2, 1, 3), 2, axis=1)
    want = plain(q4, k4, v4).transpose(0, 2, 1, 3).reshape(2, 4, 24).astype(np.float32)
    check_op("Attention", [q, k, v], want, {"q_num_heads": 4, "kv_num_heads": 2}, rtol=1e-5, atol=1e-6)


def test_a_fully_masked_query_row_gives_zeros():
    q, k, v = rand(1, 1, 2, 4), rand(1, 1, 3, 4), rand(1, 1, 3, 4)
    mask = np.array([[True, True, False], [False, False, False]])
    (y,) = check_op("Attention", [q, k, v, mask])
    np.testing.assert_allclose(y[0, 0, 0], plain(q, k, v, bias=np.where(mask, 0, -np.inf)[:1])[0, 0, 0], rtol=1e-5)
    assert np.all(y[0, 0, 1] == 0)


onnx_ref = pytest.importorskip("onnx.reference.ops.op_attention")

OPTIONS = {
    "mask": [None, "bool", "float", "short"],      # short: a float mask narrower than the keys (padded with -inf)
    "cache": [None, "past", "nonpad"],
    "is_causal": [0, 1],
    "heads": [(2, 2), (4, 2)],                      # (q heads, kv heads): GQA in the second
    "extra": [{}, {"softcap": 2.0}, {"qk_matmul_output_mode": 2}, {"qk_matmul_output_mode": 3},
              {"left_window_size": 1}, {"scale": 0.5, "softmax_precision": 1}],
}


def _case(mask, cache, is_causal, heads, extra):
    hq, hk = heads
    b, sq, skv, d = 2, 3, 4, 4
    past = 2 if cache == "past" else 0
    q, k, v = rand(b, hq, sq, d), rand(b, hk, skv, d), rand(b, hk, skv, d)
    inputs = [q, k, v, None, None, None, None]
    total = skv + past
    if mask == "bool":
        inputs[3] = RNG.random((sq, total)) > 0.3
    elif mask == "float":
        inputs[3] = rand(b, 1, sq, total)
    elif mask == "short":
        inputs[3] = rand(sq, total - 1)
    if cache == "past":
        inputs[4], inputs[5] = rand(b, hk, past, d), rand(b, hk, past, d)
    elif cache == "nonpad":
        inputs[6] = np.array([skv, 3], np.int64)
    attrs = {"is_causal": is_causal, **extra}
    return inputs, attrs


@pytest.mark.parametrize("mask,cache,is_causal,heads,extra", [
    combo for combo in itertools.product(*OPTIONS.values())
    # a sample of the product: every option value, in varied company
    if zlib.crc32(repr(combo).encode()) % 7 == 0 or (combo[0] is None and combo[1] is None)])
def test_matches_onnx_reference_evaluator(mask, cache, is_causal, heads, extra):
    inputs, attrs = _case(mask, cache, is_causal, heads, extra)
    want = onnx_ref._compute_attention(*inputs, scale=attrs.get("scale"), is_causal=bool(is_causal),
                                       softcap=attrs.get("softcap"), qk_matmul_output_mode=attrs.get("qk_matmul_output_mode"),
                                       softmax_precision=attrs.get("softmax_precision"),
                                       left_window_size=attrs.get("left_window_size"), _validate_attention25=True)
    while inputs[-1] is None:
        inputs.pop()
    outs = check_op("Attention", inputs, list(want), attrs, num_outputs=4, rtol=1e-5, atol=1e-5)
    assert [o.shape for o in outs] == [w.shape for w in want]


def test_float16_computes_in_float16_as_onnx_does():
    q, k, v = rand(1, 2, 3, 4, dtype=np.float16), rand(1, 2, 3, 4, dtype=np.float16), rand(1, 2, 3, 4, dtype=np.float16)
    want = onnx_ref._compute_attention(q, k, v, is_causal=True)[0]
    (y,) = check_op("Attention", [q, k, v], want, {"is_causal": 1}, rtol=1e-3, atol=1e-3)
    assert y.dtype == np.float16


@pytest.mark.parametrize("inputs,attrs,match", [
    ([(2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6)], {"q_num_heads": 2}, "q_num_heads=2 but Q has 3 heads"),
    ([(2, 4, 12), (2, 5, 8), (2, 5, 8)], {"kv_num_heads": 2}, "needs the q_num_heads attribute"),
    ([(2, 4, 12), (2, 5, 8), (2, 5, 8)], {"q_num_heads": 5, "kv_num_heads": 2}, "not a multiple of q_num_heads"),
    ([(2, 3, 4, 8), (2, 2, 5, 8), (2, 2, 5, 6)], {}, "3 query heads are not a multiple of 2"),
    ([(2, 3, 4, 8), (2, 3, 5, 4), (2, 3, 5, 6)], {}, "head size 8 differs from K's 4"),
    ([(2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6)], {"qk_matmul_output_mode": 4}, "qk_matmul_output_mode must be"),
])
def test_inference_names_what_is_wrong(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("Attention", [rand(*s) for s in inputs], attrs)


def _onnx_attention(opset: int, **attrs):
    from onnx import TensorProto, helper
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 2, 3, 4])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 2, 5, 4])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2, 5, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], **attrs)
    return helper.make_model(helper.make_graph([node], "a", [q, k, v], [y]),
                             opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_every_attention_version_imports_and_runs(opset):
    p = kiln.load(kiln.import_onnx(_onnx_attention(opset, is_causal=1)))
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4)
    want = onnx_ref._compute_attention(q, k, v, is_causal=True)[0]
    np.testing.assert_allclose(p.run({"q": q, "k": k, "v": v})["y"], want, rtol=1e-5, atol=1e-6)


def test_export_refuses_attention_by_name(tmp_path):
    g = Graph("a")
    q, k, v = (g.add_input(n, "float32", [1, 2, 3, 4]) for n in "qkv")
    g.outputs = [g.op("Attention", q, k, v)]
    with pytest.raises(KilnError, match="Attention exists from opset 23 on"):
        kiln.export_onnx(g, tmp_path / "a.onnx")
