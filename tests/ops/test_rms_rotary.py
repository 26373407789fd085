"""ai.onnx ``RMSNormalization`` (23), ``RotaryEmbedding`` (23), ``LpNormalization`` (1/22) and
``MeanVarianceNormalization`` (9/13): inference (and its errors, by name), the reference against an independent
numpy formula and against ONNX's own reference evaluator over the ops' attributes and optional inputs, every
backend through the op suite, and the ONNX export: RMSNormalization and RotaryEmbedding (newer than the opsets
kiln writes) as their expansions into opset-18 ops, run in onnxruntime."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from kiln.ir import Graph, evaluate
from op_harness import build_single, check_op, onnx_reference

RNG = np.random.default_rng(2023)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def inference_fails(op: str, inputs: list, attrs: dict, match: str, **kw) -> None:
    with pytest.raises(ShapeInferenceError, match=match):
        build_single(op, inputs, attrs, **kw)


# =========================================================================== RMSNormalization


def rms_formula(x, scale, axis=-1, epsilon=1e-5):
    """x / sqrt(mean(x^2 over axis..) + eps) * scale in float64."""
    x64 = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x64 / np.sqrt(np.mean(x64 ** 2, axis=axes, keepdims=True) + epsilon) * scale.astype(np.float64)


@pytest.mark.parametrize("shape,axis,scale_shape", [
    ((2, 3, 8), -1, (8,)), ((2, 3, 8), 1, (3, 8)), ((2, 3, 8), 0, (2, 3, 8)), ((4, 5), -2, (4, 5)),
    ((2, 3, 4, 5), 2, (1, 5)), ((2, 3, 4, 5), -3, (3, 1, 1)), ((7,), 0, (1,))])
def test_rms_norm_matches_formula_over_axes_and_broadcast_scales(shape, axis, scale_shape):
    x, scale = rand(*shape), rand(*scale_shape)
    want = rms_formula(x, scale, axis).astype(np.float32)
    check_op("RMSNormalization", [x, scale], want, {"axis": axis}, rtol=2e-6, atol=1e-6)
    check_op("RMSNormalization", [x, scale], want, {"axis": axis}, const_inputs=(1,), rtol=2e-6, atol=1e-6,
             symbolic_batch=True)


def test_rms_norm_epsilon():
    x, scale = rand(3, 4) * 1e-2, rand(4)
    for eps in (1e-5, 0.1, 2.0):
        check_op("RMSNormalization", [x, scale], rms_formula(x, scale, epsilon=eps).astype(np.float32),
                 {"epsilon": eps}, rtol=2e-6, atol=1e-7)
    zeros = np.zeros((2, 4), np.float32)
    (y,) = check_op("RMSNormalization", [zeros, scale])
    assert np.all(y == 0)


def test_rms_norm_stash_type_sets_the_precision_of_the_normalization():
    x, scale = rand(3, 64, dtype=np.float64), rand(64, dtype=np.float64)
    exact = rms_formula(x, scale)
    # stash_type 1 (the default): X is cast to float32 for the normalization even when it is double.
    x32 = x.astype(np.float32)
    rms32 = np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(1e-5))
    want32 = (x32 / rms32).astype(np.float64) * scale
    (y,) = check_op("RMSNormalization", [x, scale], want32, rtol=1e-12, atol=0)
    assert y.dtype == np.float64 and not np.allclose(y, exact, rtol=1e-12, atol=0)
    np.testing.assert_allclose(y, exact, rtol=1e-6)
    (y,) = check_op("RMSNormalization", [x, scale], None, {"stash_type": 11})
    np.testing.assert_allclose(y, (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + float(np.float32(1e-5)))) * scale,
                               rtol=1e-14)
    # float32 X in a double stash, and in a float16 one (a float16-sized error).
    xf, sf = rand(3, 64), rand(64)
    check_op("RMSNormalization", [xf, sf], rms_formula(xf, sf).astype(np.float32), {"stash_type": 11}, rtol=1e-6)
    (y16,) = check_op("RMSNormalization", [xf, sf], None, {"stash_type": 10})
    np.testing.assert_allclose(y16, rms_formula(xf, sf), rtol=4e-3, atol=4e-3)
    assert not np.allclose(y16, rms_formula(xf, sf), rtol=1e-5, atol=1e-6)
    (ybf,) = check_op("RMSNormalization", [xf, sf], None, {"stash_type": 16})
    np.testing.assert_allclose(ybf, rms_formula(xf, sf), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_narrow_floats(dtype):
    from kiln.ir import DType
    npd = DType[dtype.upper()].numpy
    x, scale = rand(2, 3, 16).astype(npd), rand(16).astype(npd)
    want = rms_formula(x, scale)
    (y,) = check_op("RMSNormalization", [x, scale], None, {"axis": 1})
    assert y.dtype == npd
    np.testing.assert_allclose(y.astype(np.float64), rms_formula(x, scale, 1), rtol=2e-2, atol=2e-2)
    assert want.shape == y.shape


@pytest.mark.parametrize("axis,epsilon", [(-1, 1e-5), (0, 1e-5), (1, 0.5), (-2, 1e-3), (2, 1e-5)])
def test_rms_norm_matches_onnx_reference(axis, epsilon):
    x = rand(2, 3, 5)
    scale = rand(*x.shape[axis % 3:])
    want = onnx_reference("RMSNormalization", [x, scale], {"axis": axis, "epsilon": epsilon}, 23)
    check_op("RMSNormalization", [x, scale], want, {"axis": axis, "epsilon": epsilon}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inputs,attrs,match", [
    ([rand(2, 3), rand(3)], {"axis": 2}, "axis 2 is out of range for rank 2"),
    ([rand(2, 3), rand(3)], {"axis": -3}, "out of range"),
    ([rand(2, 3), rand(3, dtype=np.float64)], {}, "scale is float64 but X is float32"),
    ([rand(2, 3), rand(2)], {}, r"scale of shape \[2\] does not broadcast"),
    ([rand(2, 3), rand(1, 2, 3)], {}, "does not broadcast"),
    ([rand(2, 3), rand(3)], {"stash_type": 7}, "stash_type must be a float type"),
    ([rand(2, 3), rand(3)], {"stash_type": 99}, "stash_type 99 is not a dtype code"),
    ([np.float32(1.0), np.ones((), np.float32)], {}, "X must have rank >= 1"),
])
def test_rms_norm_bad_inputs_fail(inputs, attrs, match):
    inference_fails("RMSNormalization", inputs, attrs, match)


# =========================================================================== RotaryEmbedding


def rope_formula(x, cos, sin, position_ids=None, interleaved=0, rotary_embedding_dim=0, num_heads=None):
    """RoPE as complex multiplication in float64: each rotated pair (a, b) is a + ib times cos + i sin."""
    x = x.astype(np.float64)
    four = x.ndim == 4
    if not four:
        b, s, hidden = x.shape
        x = x.reshape(b, s, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)
    # x: [B, H, S, D]
    d = x.shape[-1]
    rd = rotary_embedding_dim or d
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    angle = (cos.astype(np.float64) + 1j * sin.astype(np.float64))[:, None]  # [B, 1, S, rd/2]
    idx = np.arange(rd)
    first, second = (idx[0::2], idx[1::2]) if interleaved else (idx[:rd // 2], idx[rd // 2:])
    z = (x[..., first] + 1j * x[..., second]) * angle
    y = x.copy()
    y[..., first], y[..., second] = z.real, z.imag
    if not four:
        y = y.transpose(0, 2, 1, 3).reshape(b, s, -1)
    return y


def _rope_case(rank, interleaved, rd, with_pos, b=2, h=3, s=4, d=8, dtype=np.float32):
    half = (rd or d) // 2
    x = rand(b, h, s, d, dtype=dtype) if rank == 4 else rand(b, s, h * d, dtype=dtype)
    attrs = {}
    if interleaved:
        attrs["interleaved"] = 1
    if rd:
        attrs["rotary_embedding_dim"] = rd
    if rank == 3:
        attrs["num_heads"] = h
    if with_pos:
        cos, sin = rand(11, half, dtype=dtype), rand(11, half, dtype=dtype)
        pos = RNG.integers(0, 11, (b, s)).astype(np.int64)
        return [x, cos, sin, pos], attrs
    return [x, rand(b, s, half, dtype=dtype), rand(b, s, half, dtype=dtype)], attrs


CASES = list(itertools.product([4, 3], [0, 1], [0, 4], [True, False]))


@pytest.mark.parametrize("rank,interleaved,rd,with_pos", CASES)
def test_rope_matches_complex_rotation(rank, interleaved, rd, with_pos):
    inputs, attrs = _rope_case(rank, interleaved, rd, with_pos)
    want = rope_formula(*inputs, **attrs).astype(np.float32)
    (y,) = check_op("RotaryEmbedding", inputs, want, attrs, rtol=1e-6, atol=1e-6)
    if rd:  # the features past rotary_embedding_dim pass through untouched
        x = inputs[0] if rank == 4 else inputs[0].reshape(2, 4, 3, 8)
        yy = y if rank == 4 else y.reshape(2, 4, 3, 8)
        np.testing.assert_array_equal(yy[..., rd:], x[..., rd:])
    check_op("RotaryEmbedding", inputs, want, attrs, const_inputs=(1, 2), symbolic_batch=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rank,interleaved,rd,with_pos", CASES)
def test_rope_matches_onnx_reference(rank, interleaved, rd, with_pos):
    inputs, attrs = _rope_case(rank, interleaved, rd, with_pos)
    want = onnx_reference("RotaryEmbedding", inputs, attrs, 23)
    check_op("RotaryEmbedding", inputs, want, attrs, rtol=1e-6, atol=1e-6)


def test_rope_position_ids_pick_cache_rows_and_negative_ids_count_from_the_end():
    x = rand(1, 1, 3, 4)
    cos, sin = rand(5, 2), rand(5, 2)
    pos = np.array([[4, -1, 0]], np.int64)
    (y,) = check_op("RotaryEmbedding", [x, cos, sin, pos])
    want = rope_formula(x, cos[[4, 4, 0]][None], sin[[4, 4, 0]][None]).astype(np.float32)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    g, feeds = build_single("RotaryEmbedding", [x, cos, sin, np.array([[0, 5, 1]], np.int64)])
    with pytest.raises(Exception, match="outside cos_cache's 5 positions"):
        evaluate(g, feeds)


def test_rope_num_heads_is_ignored_on_4d_input():
    inputs, attrs = _rope_case(4, 0, 0, True)
    want = rope_formula(*inputs).astype(np.float32)
    check_op("RotaryEmbedding", inputs, want, {"num_heads": 5}, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rope_narrow_floats_compute_in_float32_and_round_once(dtype):
    from kiln.ir import DType
    npd = DType[dtype.upper()].numpy
    inputs, attrs = _rope_case(4, 1, 4, True, dtype=npd)
    (y,) = check_op("RotaryEmbedding", inputs, None, attrs)
    assert y.dtype == npd
    want = rope_formula(*[a.astype(np.float32) if a.dtype == npd else a for a in inputs], **attrs)
    ulp = 2.0 ** -10 if dtype == "float16" else 2.0 ** -7
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=ulp, atol=ulp)


@pytest.mark.parametrize("inputs,attrs,match", [
    ([rand(2, 4, 24), rand(2, 4, 4), rand(2, 4, 4)], {}, r"3-D X \(\[2, 4, 24\]\) needs the num_heads attribute"),
    ([rand(2, 4, 24), rand(2, 4, 4), rand(2, 4, 4)], {"num_heads": 5},
     "hidden size 24 is not a multiple of num_heads=5"),
    ([rand(2, 4, 24), rand(2, 4, 4), rand(2, 4, 4)], {"num_heads": 0}, "num_heads must be positive"),
    ([rand(1, 2, 3, 8), rand(1, 3, 2), rand(1, 3, 2)], {"rotary_embedding_dim": 3}, "rotary_embedding_dim must be"),
    ([rand(1, 2, 3, 8), rand(1, 3, 5), rand(1, 3, 5)], {"rotary_embedding_dim": 10}, "exceeds the head size 8"),
    ([rand(1, 2, 3, 7), rand(1, 3, 3), rand(1, 3, 3)], {}, "head size 7 is odd"),
    ([rand(1, 2, 3, 8), rand(1, 3, 3), rand(1, 3, 4)], {}, r"cos_cache \(without position_ids\) must have shape "
                                                            r"\[1, 3, 4\], got \[1, 3, 3\]"),
    ([rand(1, 2, 3, 8), rand(1, 5, 4), rand(1, 5, 4)], {}, r"must have shape \[1, 3, 4\], got \[1, 5, 4\]"),
    ([rand(1, 2, 3, 8), rand(9, 2), rand(9, 2), np.zeros((1, 3), np.int64)], {},
     r"cos_cache \(indexed by position_ids\) must have shape \[\?, 4\], got \[9, 2\]"),
    ([rand(1, 2, 3, 8), rand(1, 9, 4), rand(1, 9, 4), np.zeros((1, 3), np.int64)], {}, "indexed by position_ids"),
    ([rand(1, 2, 3, 8), rand(9, 4), rand(9, 4), np.zeros((1, 4), np.int64)], {},
     r"position_ids must have shape \[1, 3\]"),
    ([rand(1, 2, 3, 8), rand(1, 3, 4, dtype=np.float16), rand(1, 3, 4)], {}, "cos_cache is float16 but X is float32"),
    ([rand(1, 2, 3, 8), rand(1, 3, 4), rand(1, 3, 4)], {"interleaved": 2}, "interleaved must be 0 or 1"),
    ([rand(2, 8), rand(2, 4), rand(2, 4)], {}, r"X must be 3-D \[batch, seq, hidden\] or 4-D .*got \[2, 8\]"),
])
def test_rope_bad_inputs_fail(inputs, attrs, match):
    inference_fails("RotaryEmbedding", inputs, attrs, match)


# =========================================================================== LpNormalization


def lp_formula(x, axis, p):
    x64 = x.astype(np.float64)
    norm = (np.abs(x64) ** p).sum(axis=axis, keepdims=True) ** (1.0 / p)
    return np.where(norm == 0, 0.0, x64 / np.where(norm == 0, 1, norm))


@pytest.mark.parametrize("shape,axis,p", [((3, 4), -1, 2), ((3, 4), 0, 1), ((2, 3, 4), 1, 2), ((2, 3, 4), -1, 1),
                                          ((5,), 0, 2)])
def test_lp_norm_matches_formula(shape, axis, p):
    x = rand(*shape)
    check_op("LpNormalization", [x], lp_formula(x, axis, p).astype(np.float32), {"axis": axis, "p": p},
             rtol=2e-6, atol=1e-7, symbolic_batch=True)


def test_lp_norm_defaults_zero_norm_and_narrow_floats():
    x = np.array([[3.0, -4.0], [0.0, 0.0]], np.float32)
    check_op("LpNormalization", [x], np.array([[0.6, -0.8], [0, 0]], np.float32))
    check_op("LpNormalization", [x], np.array([[3 / 7, -4 / 7], [0, 0]], np.float32), {"p": 1})
    for npd in (np.float16, np.float64):
        xx = rand(3, 5).astype(npd)
        (y,) = check_op("LpNormalization", [xx], None, {"axis": 0})
        assert y.dtype == npd
        np.testing.assert_allclose(y.astype(np.float64), lp_formula(xx, 0, 2),
                                   rtol=1e-3 if npd == np.float16 else 1e-12)


@pytest.mark.parametrize("axis,p", [(0, 2), (1, 2), (-1, 2), (1, 1)])
def test_lp_norm_matches_onnx_reference(axis, p):
    # ONNX's reference sums x**p, not |x|**p: for p = 1 it is only right for nonnegative x (the spec, the node
    # tests and onnxruntime take |x|), so the p = 1 comparison uses nonnegative data.
    x = rand(2, 3, 4)
    if p == 1:
        x = np.abs(x)
    for opset in (18, 22):
        want = onnx_reference("LpNormalization", [x], {"axis": axis, "p": p}, opset)
        check_op("LpNormalization", [x], want, {"axis": axis, "p": p}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inputs,attrs,match", [
    ([rand(2, 3)], {"p": 3}, "p must be 1 or 2, got 3"),
    ([rand(2, 3)], {"p": 0}, "p must be 1 or 2"),
    ([rand(2, 3)], {"axis": 2}, "axis 2 is out of range for rank 2"),
    ([np.float32(2.0)], {}, "rank >= 1"),
])
def test_lp_norm_bad_inputs_fail(inputs, attrs, match):
    inference_fails("LpNormalization", inputs, attrs, match)


# =========================================================================== MeanVarianceNormalization


def mvn_formula(x, axes):
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    return (x64 - mean) / (np.sqrt(((x64 - mean) ** 2).mean(axis=axes, keepdims=True)) + 1e-9)


@pytest.mark.parametrize("shape,axes", [((2, 3, 4, 5), None), ((2, 3, 4, 5), [1]), ((2, 3, 4), [0, -1]),
                                        ((3, 4), [0, 1]), ((2, 3, 4, 5), [2, 3])])
def test_mvn_matches_formula(shape, axes):
    x = rand(*shape) * 3 + 1
    attrs = {} if axes is None else {"axes": axes}
    norm_axes = tuple(a % len(shape) for a in (axes or [0, 2, 3]))
    check_op("MeanVarianceNormalization", [x], mvn_formula(x, norm_axes).astype(np.float32), attrs, rtol=1e-5,
             atol=2e-6, symbolic_batch=True)


def test_mvn_constant_input_gives_zeros_and_narrow_floats():
    (y,) = check_op("MeanVarianceNormalization", [np.full((2, 3, 2, 2), 3.7, np.float32)])
    assert np.all(y == 0)  # E[X^2] - E[X]^2 would round to a tiny nonzero (or negative: NaN) variance here
    for npd in (np.float16, np.float64):
        x = rand(2, 3, 2, 2).astype(npd)
        (y,) = check_op("MeanVarianceNormalization", [x])
        assert y.dtype == npd
        np.testing.assert_allclose(y.astype(np.float64), mvn_formula(x, (0, 2, 3)),
                                   rtol=2e-3 if npd == np.float16 else 1e-12, atol=2e-3 if npd == np.float16 else 0)


@pytest.mark.parametrize("axes,opset", [(None, 13), ([0, 2, 3], 9), ([1, 2], 18), ([-1], 18)])
def test_mvn_matches_onnx_reference(axes, opset):
    # ONNX's function body takes the variance as E[X^2] - E[X]^2: it loses digits where the variance is small next
    # to the mean's square, so the data are centred and each reduction spans at least 6 values.
    x = rand(3, 3, 4, 6)
    attrs = {} if axes is None else {"axes": axes}
    want = onnx_reference("MeanVarianceNormalization", [x], attrs, opset)
    check_op("MeanVarianceNormalization", [x], want, attrs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inputs,attrs,match", [
    ([rand(2, 3)], {}, r"axes entry 2 is out of range for rank 2 \(axes=\[0, 2, 3\]\)"),
    ([rand(2, 3, 4)], {"axes": [0, 3]}, "axes entry 3 is out of range"),
    ([rand(2, 3, 4)], {"axes": [1, -2]}, r"axes \[1, -2\] name an axis twice"),
])
def test_mvn_bad_inputs_fail(inputs, attrs, match):
    inference_fails("MeanVarianceNormalization", inputs, attrs, match)


# =========================================================================== ONNX export

def _export_and_run(g: Graph, feeds: list, opsets=(18, 22)) -> list:
    """The graph exported at each opset (checked by onnx's full checker where every interface type has a
    shape) and run in onnxruntime."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")

    from kiln.serializer import onnx as kx
    outs = []
    for opset in opsets:
        model = kx.to_onnx_model(g, opset=opset)
        if all(v.type is not None and v.type.shape is not None for v in [*g.inputs, *g.outputs]):
            onnx.checker.check_model(model, full_check=True)
        assert not any(n.op_type in ("RMSNormalization", "RotaryEmbedding") for n in model.graph.node)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), feeds)})[0])
    return outs


@pytest.mark.parametrize("shape,axis,scale_shape,attrs,dtype", [
    ((2, 3, 4), -1, (4,), {}, np.float32),
    ((2, 3, 4), 1, (3, 4), {"epsilon": 1e-3}, np.float32),
    ((2, 3, 4, 5), 0, (1, 4, 5), {}, np.float32),
    ((2, 3, 4), -2, (1, 4), {"stash_type": 11}, np.float32),
    ((2, 3, 16), -1, (16,), {"stash_type": 1}, np.float64),
    ((2, 3, 16), -1, (16,), {}, np.float16),
    ((2, 3, 16), 1, (16,), {"stash_type": 10}, np.float32),
])
def test_rms_norm_exports_as_opset_18_ops_that_onnxruntime_runs(shape, axis, scale_shape, attrs, dtype):
    x, scale = rand(*shape, dtype=dtype), rand(*scale_shape, dtype=dtype)
    for const in ((), (1,)):
        g, feeds = build_single("RMSNormalization", [x, scale], {"axis": axis, **attrs}, const_inputs=const,
                                symbolic_batch=True)
        (want,) = evaluate(g, feeds)
        # float32: a ReduceMean summed in another order (1 float32 ulp); float16: onnxruntime, having no float16
        # kernels on CPU, computes float16 ops in float32 and drops the Cast pairs between them, skipping the
        # function's rounding of the normalized X to float16 before the scale (1 float16 ulp).
        narrow = dtype == np.float16 or attrs.get("stash_type") == 10
        tol = 4e-3 if narrow else 1e-6
        for got in _export_and_run(g, feeds):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_rms_norm_export_of_unknown_rank_takes_the_axes_at_run_time():
    g = Graph("r")
    x = g.add_input("x", "float32", None)
    s = g.add_initializer("s", rand(4))
    g.outputs = [g.op("RMSNormalization", x, s, axis=-2)]
    feed = rand(2, 3, 4)
    (want,) = evaluate(g, [feed])
    for got in _export_and_run(g, [feed]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rank,interleaved,rd,with_pos", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rope_exports_as_opset_18_ops_that_compute_exactly_what_kiln_does(rank, interleaved, rd, with_pos, dtype):
    inputs, attrs = _rope_case(rank, interleaved, rd, with_pos, dtype=dtype)
    g, feeds = build_single("RotaryEmbedding", inputs, attrs, const_inputs=(1, 2), symbolic_batch=True)
    (want,) = evaluate(g, feeds)
    for got in _export_and_run(g, feeds):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_mvn_export_writes_its_default_axes():
    from kiln.serializer import onnx as kx
    x = rand(2, 3, 4, 5)
    g, feeds = build_single("MeanVarianceNormalization", [x], {}, symbolic_batch=True)
    node = kx.to_onnx_model(g).graph.node[-1]
    assert node.op_type == "MeanVarianceNormalization" and list(node.attribute[0].ints) == [0, 2, 3]
    (want,) = evaluate(g, feeds)
    for got in _export_and_run(g, feeds):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
