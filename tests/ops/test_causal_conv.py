"""CausalConvWithState (ai.onnx 27): every activation with and without bias and past_state against ONNX's reference
evaluator; kernel size 1, inputs shorter than the state, empty length and batch; 16-bit types rounded once; a
decode step by step equals the whole sequence; symbolic dims; named inference errors; the opset-18 export (a
run-time kernel size, and a channel count unknown at export refused by name)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir import Graph, evaluate
from op_harness import build_single, check_op, inferred

RNG = np.random.default_rng(27)
OP = "CausalConvWithState"


def _f(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def onnx_causal_conv(x, w, bias=None, past=None, **attrs):
    """Both outputs of ONNX's reference evaluator on a one-node CausalConvWithState-27 model."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    inputs = [("input", x), ("weight", w), ("bias", bias), ("past_state", past)]
    names = [n if a is not None else "" for n, a in inputs]
    while names[-1] == "":
        names.pop()
    given = [(n, a) for n, a in inputs if a is not None]
    node = helper.make_node(OP, names, ["output", "present_state"], **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                      for n, a in given],
        [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in ("output", "present_state")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])
    return ReferenceEvaluator(model).run(None, dict(given))


def f64_causal_conv(x, w, bias=None, past=None, activation="none"):
    """The definition in float64, position by position (an independent oracle for the 16-bit types)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, length = x.shape
    k = w.shape[2]
    past = np.zeros((n, c, k - 1)) if past is None else past.astype(np.float64)
    padded = np.concatenate([past, x], axis=2)
    y = np.zeros((n, c, length))
    for t in range(length):
        y[:, :, t] = (padded[:, :, t:t + k] * w[:, 0, :]).sum(-1)
    if bias is not None:
        y += bias.astype(np.float64)[:, None]
    if activation != "none":
        y = y / (1 + np.exp(-y))
    return y, padded[:, :, length:]


def _inputs(args):
    """Inputs for build_single/check_op: trailing omitted optional inputs dropped."""
    args = list(args)
    while args[-1] is None:
        args.pop()
    return args


@pytest.mark.parametrize("activation,with_bias,with_past",
                         list(itertools.product(["none", "silu", "swish"], [False, True], [False, True])))
def test_matches_onnx_reference(activation, with_bias, with_past):
    x, w = _f(2, 4, 7), _f(4, 1, 4)
    bias = _f(4) if with_bias else None
    past = _f(2, 4, 3) if with_past else None
    attrs = {"activation": activation}
    want = onnx_causal_conv(x, w, bias, past, **attrs)
    check_op(OP, _inputs([x, w, bias, past]), want, attrs, rtol=1e-5, atol=1e-6, symbolic_batch=True)


@pytest.mark.parametrize("length,k", [(8, 1), (2, 5), (1, 4), (3, 2)])
def test_kernel_sizes_and_inputs_shorter_than_the_state(length, k):
    x, w, bias = _f(2, 3, length), _f(3, 1, k), _f(3)
    for past in (None, _f(2, 3, k - 1)):
        want = onnx_causal_conv(x, w, bias, past, activation="silu")
        outs = check_op(OP, _inputs([x, w, bias, past]), want, {"activation": "silu"}, rtol=1e-5, atol=1e-6)
        assert outs[1].shape == (2, 3, k - 1)


def test_present_state_is_copied_exactly_from_past_and_input():
    x, past = _f(1, 2, 2), _f(1, 2, 4)
    _, state = check_op(OP, [x, _f(2, 1, 5), None, past])
    np.testing.assert_array_equal(state, np.concatenate([past, x], axis=2)[:, :, 2:])
    _, state = check_op(OP, [x, _f(2, 1, 5)])  # no past_state: zeros, then the input
    np.testing.assert_array_equal(state, np.concatenate([np.zeros((1, 2, 2), np.float32), x], axis=2))


def test_decoding_step_by_step_equals_the_whole_sequence():
    x, w, bias = _f(2, 3, 9), _f(3, 1, 4), _f(3)
    whole, whole_state = check_op(OP, [x, w, bias], attrs={"activation": "silu"})
    state, steps = np.zeros((2, 3, 3), np.float32), []
    for t in range(9):
        y, state = check_op(OP, [x[:, :, t:t + 1], w, bias, state], attrs={"activation": "silu"})
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=2), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state, whole_state)


def test_bias_and_weight_given_as_constants():
    x, w, bias, past = _f(2, 4, 6), _f(4, 1, 3), _f(4), _f(2, 4, 2)
    check_op(OP, [x, w, bias, past], onnx_causal_conv(x, w, bias, past), const_inputs=(1, 2))


def test_empty_length_and_batch():
    w, past = _f(3, 1, 4), _f(2, 3, 3)
    y, state = check_op(OP, [np.zeros((2, 3, 0), np.float32), w, None, past], attrs={"activation": "silu"})
    assert y.shape == (2, 3, 0)
    np.testing.assert_array_equal(state, past)
    y, state = check_op(OP, [np.zeros((0, 3, 5), np.float32), w, _f(3)])
    assert y.shape == (0, 3, 5) and state.shape == (0, 3, 3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_half_types_compute_wide_and_round_once(dtype, activation):
    dt = kiln.ir.dtype(dtype).numpy
    x, w, bias, past = _f(2, 4, 6).astype(dt), _f(4, 1, 4).astype(dt), _f(4).astype(dt), _f(2, 4, 3).astype(dt)
    y, state = check_op(OP, [x, w, bias, past], attrs={"activation": activation})
    want, want_state = f64_causal_conv(x, w, bias, past, activation)
    assert y.dtype == dt and state.dtype == dt
    # one rounding of a float32 result: at most half an ulp of the type, plus float32's own error
    ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=ulp / 2 * 1.01, atol=1e-6)
    np.testing.assert_array_equal(state, want_state.astype(dt))


def test_float16_matches_onnx_reference_within_its_rounding():
    x, w = _f(2, 4, 8, dtype=np.float16), _f(4, 1, 4, dtype=np.float16)
    want = onnx_causal_conv(x, w, activation="silu")
    check_op(OP, [x, w], want, {"activation": "silu"}, rtol=2e-3, atol=1e-3)


def test_inference_keeps_symbolic_dims():
    x, w, past = _f(2, 4, 6), _f(4, 1, 3), _f(2, 4, 2)
    assert inferred(OP, [x, w, None, past]) == [("batch", 4, 6), ("batch", 4, 2)]
    g = Graph("sym")
    xv = g.add_input("x", "float32", ["n", "c", "t"])
    wv = g.add_input("w", "float32", [None, 1, None])
    pv = g.add_input("p", "float32", ["n", None, "k1"])
    y, state = g.op(OP, xv, wv, None, pv)
    assert y.type.shape == ("n", "c", "t") and state.type.shape == ("n", "c", "k1")
    y, state = g.op(OP, xv, g.add_input("w2", "float32", [8, 1, 5]))
    assert y.type.shape == ("n", 8, "t") and state.type.shape == ("n", 8, 4)


@pytest.mark.parametrize("shapes,attrs,match", [
    (((2, 4), (4, 1, 3)), {}, r"input must have rank 3 \(\[batch, channels, length\]\)"),
    (((2, 4, 6), (4, 3)), {}, r"weight must have rank 3"),
    (((2, 4, 6), (4, 2, 3)), {}, r"dim 1 must be 1"),
    (((2, 4, 6), (4, 1, 0)), {}, r"kernel size \(dim 2\) must be at least 1"),
    (((2, 4, 6), (5, 1, 3)), {}, r"weight \[5, 1, 3\] has 5 channels \(dim 0\) but input \[2, 4, 6\] has 4"),
    (((2, 4, 6), (4, 1, 3), (3,)), {}, r"bias \[3\] must have one value per channel \(4\)"),
    (((2, 4, 6), (4, 1, 3), (4, 1)), {}, r"bias must have rank 1"),
    (((2, 4, 6), (4, 1, 3), None, (2, 4, 3)), {}, r"its k - 1 \(dim 2\) is 3, not 2"),
    (((2, 4, 6), (4, 1, 3), None, (3, 4, 2)), {}, r"its batch \(dim 0\) is 3, not 2"),
    (((2, 4, 6), (4, 1, 3), None, (2, 5, 2)), {}, r"its channels \(dim 1\) is 5, not 4"),
    (((2, 4, 6), (4, 1, 3)), {"activation": "relu"}, r"activation must be one of \['none', 'silu', 'swish'\]"),
])
def test_inference_names_what_is_wrong(shapes, attrs, match):
    inputs = [None if s is None else np.zeros(s, np.float32) for s in shapes]
    with pytest.raises(ShapeInferenceError, match=match):
        build_single(OP, inputs, attrs)


def test_inputs_of_different_types_are_refused():
    with pytest.raises(ShapeInferenceError, match="weight is float16 but input is float32"):
        build_single(OP, [np.zeros((1, 2, 3), np.float32), np.zeros((2, 1, 2), np.float16)])
    with pytest.raises(ShapeInferenceError, match="past_state is float16 but input is float32"):
        build_single(OP, [np.zeros((1, 2, 3), np.float32), np.zeros((2, 1, 2), np.float32), None,
                          np.zeros((1, 2, 1), np.float16)])


def test_shapes_known_only_at_run_time_are_checked_there():
    g = Graph("r")
    xv, wv = g.add_input("x", "float32", [1, 2, 3]), g.add_input("w", "float32", [2, 1, "k"])
    g.outputs = list(g.op(OP, xv, wv, None, g.add_input("p", "float32", [1, 2, "k1"])))
    with pytest.raises(KilnError, match=r"past_state has shape \[1, 2, 2\], expected \[1, 2, 3\] for input "
                                        r"\[1, 2, 3\] and kernel size 4"):
        evaluate(g, [_f(1, 2, 3), _f(2, 1, 4), _f(1, 2, 2)])


def test_float64_is_not_one_of_its_types():
    with pytest.raises(KilnError, match="allowed: bfloat16, float16, float32"):
        build_single(OP, [np.zeros((1, 2, 3)), np.zeros((2, 1, 2))])


# ------------------------------------------------------------------------- ONNX export (opsets 18..22)


def _run_exported(g: Graph, feeds: dict) -> list:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from kiln.serializer import onnx as kx
    proto = kx.to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_export_with_a_kernel_size_known_only_at_run_time():
    g = Graph("k")
    xv = g.add_input("x", "float32", [2, 3, 5])
    wv = g.add_input("w", "float32", [3, 1, "k"])
    g.outputs = list(g.op(OP, xv, wv, activation="silu"))
    x, w = _f(2, 3, 5), _f(3, 1, 4)
    got = _run_exported(g, {"x": x, "w": w})
    for a, b in zip(got, evaluate(g, [x, w])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_export_refuses_a_channel_count_unknown_at_export_by_name(tmp_path):
    g = Graph("c")
    xv = g.add_input("x", "float32", [2, "c", 5])
    wv = g.add_input("w", "float32", ["c", 1, 4])
    g.outputs = list(g.op(OP, xv, wv))
    with pytest.raises(KilnError, match="CausalConvWithState exists in ai.onnx from opset 27 on.*group is the "
                                        "channel count"):
        kiln.export_onnx(g, tmp_path / "c.onnx")


def test_imports_from_onnx_and_runs():
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    from kiln.serializer.onnx_import import import_onnx
    node = helper.make_node(OP, ["x", "w", "", "p"], ["y", "s"], activation="swish")
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", f, ["n", 2, 3]),
                                            helper.make_tensor_value_info("w", f, [2, 1, 3]),
                                            helper.make_tensor_value_info("p", f, ["n", 2, 2])],
                              [helper.make_tensor_value_info("y", f, None), helper.make_tensor_value_info("s", f, None)])
    g = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)]))
    assert [n.op for n in g.nodes] == [OP]
    assert g.outputs[0].type.shape == ("n", 2, 3) and g.outputs[1].type.shape == ("n", 2, 2)
    x, w, p = _f(1, 2, 3), _f(2, 1, 3), _f(1, 2, 2)
    for a, b in zip(evaluate(g, [x, w, p]), onnx_causal_conv(x, w, None, p, activation="swish")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
