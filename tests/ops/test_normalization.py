"""BatchNormalization, LayerNormalization, InstanceNormalization, Softmax and LogSoftmax:
references against torch (float64), numerical stability, inference and its failures."""
import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL = {np.float16: dict(rtol=1e-2, atol=1e-2), np.float32: dict(rtol=1e-5, atol=1e-5),
       np.float64: dict(rtol=1e-12, atol=1e-12)}


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def t64(a):
    return None if a is None else torch.from_numpy(np.asarray(a, np.float64))


def out_types(op, inputs, attrs=None, **kw):
    g, _ = build_single(op, inputs, attrs, **kw)
    return [v.type for v in g.outputs]


# --------------------------------------------------------------------------- BatchNormalization

@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5), (1, 3, 2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_batch_norm_matches_torch(rng, shape, dtype):
    c = shape[1]
    x = rand(rng, shape, dtype)
    scale, b, mean = rand(rng, (c,), dtype), rand(rng, (c,), dtype), rand(rng, (c,), dtype)
    var = (rng.random(c) + 0.5).astype(dtype)
    expected = F.batch_norm(t64(x), t64(mean), t64(var), t64(scale), t64(b), training=False, eps=1e-3).numpy()
    check_op("BatchNormalization", [x, scale, b, mean, var], expected, dict(epsilon=1e-3, momentum=0.1),
             const_inputs=[1, 2, 3, 4], symbolic_batch=True, **TOL[dtype])


def test_batch_norm_float16_data_float32_params(rng):
    x = rand(rng, (2, 3, 4), np.float16)
    params = [rand(rng, (3,)) for _ in range(3)] + [np.full(3, 2.0, np.float32)]
    expected = F.batch_norm(t64(x), t64(params[2]), t64(params[3]), t64(params[0]), t64(params[1])).numpy()
    check_op("BatchNormalization", [x] + params, expected, **TOL[np.float16])


@pytest.mark.parametrize("attrs,num_outputs,param_shape,match", [
    (dict(training_mode=2), None, (3,), "training_mode must be 0 or 1"),
    ({}, 3, (3,), "only in training mode"),
    ({}, None, (4,), r"scale must have shape \[3\]"),
    ({}, None, (3, 1), r"scale must have shape \[3\]"),
])
def test_batch_norm_bad_inputs_fail(attrs, num_outputs, param_shape, match):
    p = np.ones(param_shape, np.float32)
    inputs = [np.zeros((2, 3, 4), np.float32), p] + [np.ones(3, np.float32)] * 3
    with pytest.raises(ShapeInferenceError, match=rf"\(BatchNormalization\).*{match}"):
        build_single("BatchNormalization", inputs, attrs, num_outputs=num_outputs)


# --------------------------------------------------------------------------- LayerNormalization

@pytest.mark.parametrize("shape,axis", [((4, 8), -1), ((2, 5, 8), -1), ((2, 5, 8), 1), ((2, 3, 4, 5), -2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_layer_norm_matches_torch(rng, shape, axis, bias, dtype):
    x = rand(rng, shape, dtype)
    normalized = shape[axis:]
    scale = rand(rng, normalized, dtype)
    b = rand(rng, normalized, dtype) if bias else None
    expected = F.layer_norm(t64(x), normalized, t64(scale), t64(b), eps=1e-5).numpy()
    check_op("LayerNormalization", [x, scale, b], expected, dict(axis=axis), const_inputs=[1, 2],
             symbolic_batch=True, **TOL[dtype])


def test_layer_norm_mean_and_inv_std_outputs(rng):
    x = rand(rng, (2, 3, 6), np.float16)
    scale = np.ones((3, 6), np.float16)
    x64 = x.astype(np.float64)
    mean = x64.reshape(2, -1).mean(axis=1).reshape(2, 1, 1)
    inv_std = 1 / np.sqrt(x64.reshape(2, -1).var(axis=1).reshape(2, 1, 1) + 1e-5)
    y = (x64 - mean) * inv_std
    outs = check_op("LayerNormalization", [x, scale], [y, mean, inv_std], dict(axis=1), num_outputs=3,
                    symbolic_batch=True, rtol=2e-3, atol=2e-3)
    assert [o.dtype for o in outs] == [np.float16, np.float32, np.float32]
    types = out_types("LayerNormalization", [x, scale], dict(axis=1), num_outputs=3, symbolic_batch=True)
    assert [t.shape for t in types] == [("batch", 3, 6), ("batch", 1, 1), ("batch", 1, 1)]


def test_layer_norm_broadcast_scale(rng):
    x, scale = rand(rng, (2, 4, 6)), rand(rng, (6,))
    expected = F.layer_norm(t64(x), (4, 6)).numpy() * scale
    check_op("LayerNormalization", [x, scale], expected, dict(axis=1), **TOL[np.float32])


@pytest.mark.parametrize("attrs,scale_shape,match", [
    (dict(axis=3), (8,), "axis 3 is out of range for rank 3"),
    ({}, (7,), "does not broadcast to the normalized dims"),
    (dict(axis=1), (5, 8, 1), "does not broadcast"),
    (dict(stash_type=7), (8,), "stash_type must be a float type"),
])
def test_layer_norm_bad_inputs_fail(attrs, scale_shape, match):
    inputs = [np.zeros((2, 5, 8), np.float32), np.ones(scale_shape, np.float32)]
    with pytest.raises(ShapeInferenceError, match=rf"\(LayerNormalization\).*{match}"):
        build_single("LayerNormalization", inputs, attrs)


# --------------------------------------------------------------------------- InstanceNormalization

@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_instance_norm_matches_torch(rng, shape, dtype):
    x = rand(rng, shape, dtype) * 3 + 1
    scale, b = rand(rng, (3,), dtype), rand(rng, (3,), dtype)
    expected = F.instance_norm(t64(x), weight=t64(scale), bias=t64(b), eps=1e-4).numpy()
    check_op("InstanceNormalization", [x, scale, b], expected, dict(epsilon=1e-4), const_inputs=[1, 2],
             symbolic_batch=True, **TOL[dtype])


def test_instance_norm_bad_scale_fails():
    with pytest.raises(ShapeInferenceError, match=r"\(InstanceNormalization\).*scale must have shape \[3\]"):
        build_single("InstanceNormalization", [np.zeros((1, 3, 4), np.float32), np.ones(4, np.float32),
                                               np.ones(3, np.float32)])


# --------------------------------------------------------------------------- Softmax, LogSoftmax

@pytest.mark.parametrize("op,oracle", [("Softmax", torch.softmax), ("LogSoftmax", torch.log_softmax)])
@pytest.mark.parametrize("shape,axis", [((5,), 0), ((3, 7), -1), ((2, 3, 4), 1), ((2, 3, 4, 5), 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_softmax_matches_torch(rng, op, oracle, shape, axis, dtype):
    x = rand(rng, shape, dtype) * 4
    expected = oracle(t64(x), dim=axis).numpy()
    check_op(op, [x], expected, dict(axis=axis), symbolic_batch=len(shape) > 1, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_softmax_is_stable_for_large_inputs(dtype):
    x = np.array([[1000, 1001, 1002], [-1000, -1000, -1000]], np.float32).astype(dtype)
    e = np.exp([0.0, 1.0, 2.0])
    check_op("Softmax", [x], np.stack([e / e.sum(), np.full(3, 1 / 3)]), rtol=1e-3, atol=1e-3)
    check_op("LogSoftmax", [x], np.stack([np.log(e / e.sum()), np.full(3, -np.log(3))]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_bad_axis_fails(op):
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*axis -3 is out of range for rank 2"):
        build_single(op, [np.zeros((2, 3), np.float32)], dict(axis=-3))


# --------------------------------------------------------------------------- shared: ONNX models of one node


def onnx_outputs(op, inputs, attrs, num_outputs=1, opset=18):
    """Every output of ONNX's reference evaluator on a one-node ``op`` model."""
    reference = pytest.importorskip("onnx.reference")
    ReferenceEvaluator = reference.ReferenceEvaluator
    model = one_node_model(op, inputs, attrs, num_outputs, opset)
    return ReferenceEvaluator(model).run(None, {f"i{k}": a for k, a in enumerate(inputs)})


def one_node_model(op, inputs, attrs, num_outputs=1, opset=18, *, dims=None, initializers=()):
    """``op`` on graph inputs i0, i1, ... (those in ``initializers`` are initializers); ``dims`` overrides the
    declared shape of i0."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper
    names = [f"i{k}" for k in range(len(inputs))]
    outs = [f"o{k}" for k in range(num_outputs)]
    node = helper.make_node(op, names, outs, **attrs)
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                        dims if k == 0 and dims is not None else a.shape)
          for k, (n, a) in enumerate(zip(names, inputs)) if k not in initializers]
    inits = [numpy_helper.from_array(inputs[k], names[k]) for k in initializers]
    ov = [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in outs]
    return helper.make_model(helper.make_graph([node], "g", vi, ov, initializer=inits),
                             opset_imports=[helper.make_opsetid("", opset)])


# --------------------------------------------------------------------------- BatchNormalization, training mode


def bn_inputs(rng, shape, dtype=np.float32, stats_dtype=None):
    c = shape[1]
    sd = stats_dtype or dtype
    return [rand(rng, shape, dtype), rand(rng, (c,), dtype), rand(rng, (c,), dtype), rand(rng, (c,), sd),
            (rng.random(c) + 0.5).astype(sd)]


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5), (1, 3, 2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum", [0.875, 0.25])  # float32 values, as ONNX's attributes hold them
def test_batch_norm_training_matches_onnx_reference(rng, shape, dtype, momentum):
    ins = bn_inputs(rng, shape, dtype)
    attrs = dict(training_mode=1, momentum=momentum, epsilon=2.0 ** -10)  # ONNX's attributes are float32
    want = onnx_outputs("BatchNormalization", ins, attrs, 3, opset=15)
    check_op("BatchNormalization", ins, want, attrs, num_outputs=3, symbolic_batch=True, **TOL[dtype])
    # the statistics as constants (the CPU runtime's folded inference kernel must not take the node)
    check_op("BatchNormalization", ins, want, attrs, num_outputs=3, const_inputs=[1, 2, 3, 4], **TOL[dtype])
    check_op("BatchNormalization", ins, want[:1], attrs, const_inputs=[1, 2, 3, 4], **TOL[dtype])


def test_batch_norm_training_statistics_are_the_batch_mean_and_population_variance(rng):
    x, scale, b, mean, var = bn_inputs(rng, (3, 2, 4), np.float64)
    y, run_mean, run_var = check_op("BatchNormalization", [x, scale, b, mean, var], None,
                                    dict(training_mode=1, momentum=0.75), num_outputs=3)
    m, v = x.mean(axis=(0, 2)), x.var(axis=(0, 2))  # ddof=0: divided by the count
    np.testing.assert_allclose(run_mean, 0.75 * mean + 0.25 * m, rtol=1e-12)
    np.testing.assert_allclose(run_var, 0.75 * var + 0.25 * v, rtol=1e-12)
    want = (x - m[:, None]) / np.sqrt(v[:, None] + 1e-5) * scale[:, None] + b[:, None]
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_batch_norm_training_half_data_float32_stats(rng):
    ins = bn_inputs(rng, (2, 3, 4), np.float16, stats_dtype=np.float32)
    y, run_mean, run_var = check_op("BatchNormalization", ins, None, dict(training_mode=1), num_outputs=3)
    assert (y.dtype, run_mean.dtype, run_var.dtype) == (np.float16, np.float32, np.float32)
    want = onnx_outputs("BatchNormalization", [ins[0].astype(np.float32)] + ins[1:], dict(training_mode=1), 3, 15)
    np.testing.assert_allclose(y.astype(np.float32), want[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(run_mean, want[1], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(run_var, want[2], rtol=1e-3, atol=1e-3)


def test_batch_norm_training_of_an_empty_batch_has_nan_statistics(rng):
    ins = bn_inputs(rng, (0, 3, 4))
    y, run_mean, _ = check_op("BatchNormalization", ins, None, dict(training_mode=1), num_outputs=3)
    assert y.shape == (0, 3, 4) and np.isnan(run_mean).all()


def test_batch_norm_training_is_not_folded_into_conv(rng):
    import kiln
    from kiln.ir import Graph, evaluate
    g = Graph()
    x = g.add_input("x", "float32", [2, 2, 5, 5])
    w = g.add_initializer("w", rand(rng, (3, 2, 3, 3)))
    stats = [g.add_initializer(n, a) for n, a in zip("sbmv", bn_inputs(rng, (2, 3))[1:])]
    g.outputs = [g.op("BatchNormalization", g.op("Conv", x, w), *stats, training_mode=1)]
    feed = rand(rng, (2, 2, 5, 5))
    np.testing.assert_allclose(kiln.load(g).run([feed], as_list=True)[0], evaluate(g, [feed])[0], rtol=1e-5,
                               atol=1e-5)


def test_batch_norm_training_model_imports(rng):
    import kiln
    ins = bn_inputs(rng, (2, 3, 4, 5))
    model = one_node_model("BatchNormalization", ins, dict(training_mode=1, momentum=0.5), 3, opset=15,
                           initializers=(1, 2, 3, 4))
    got = kiln.load(kiln.import_onnx(model)).run([ins[0]], as_list=True)
    want = onnx_outputs("BatchNormalization", ins, dict(training_mode=1, momentum=0.5), 3, opset=15)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attrs,num_outputs,match", [
    (dict(training_mode=2), None, "training_mode must be 0 or 1, got 2"),
    (dict(training_mode=0), 2, "only in training mode"),
])
def test_batch_norm_training_mode_errors(attrs, num_outputs, match):
    inputs = [np.zeros((2, 3, 4), np.float32)] + [np.ones(3, np.float32)] * 4
    with pytest.raises(ShapeInferenceError, match=rf"\(BatchNormalization\).*{match}"):
        build_single("BatchNormalization", inputs, attrs, num_outputs=num_outputs)


# --------------------------------------------------------------------------- GroupNormalization


def gn_inputs(rng, shape, dtype=np.float32):
    c = shape[1]
    return [rand(rng, shape, dtype) * 2 + 1, rand(rng, (c,), dtype), rand(rng, (c,), dtype)]


@pytest.mark.parametrize("shape,groups", [((3, 4, 2, 2), 2), ((2, 6, 5), 3), ((2, 6, 5), 6), ((2, 6, 5), 1),
                                          ((2, 4), 2), ((1, 4, 2, 3, 2), 4)])
@pytest.mark.parametrize("dtype,stash", [(np.float32, 1), (np.float64, 11), (np.float64, 1)])
def test_group_norm_matches_onnx_reference(rng, shape, groups, dtype, stash):
    ins = gn_inputs(rng, shape, dtype)
    attrs = dict(num_groups=groups, epsilon=2.0 ** -10, stash_type=stash)
    want = onnx_outputs("GroupNormalization", ins, attrs, opset=21)
    tol = TOL[np.float64 if stash == 11 else np.float32]  # a float32 stash: float32 rounding
    check_op("GroupNormalization", ins, want, attrs, symbolic_batch=True, **tol)


def test_group_norm_matches_torch(rng):
    ins = gn_inputs(rng, (2, 6, 3, 4), np.float64)
    expected = F.group_norm(t64(ins[0]), 3, t64(ins[1]), t64(ins[2]), eps=1e-5).numpy()
    check_op("GroupNormalization", ins, expected, dict(num_groups=3, stash_type=11), const_inputs=[1, 2],
             **TOL[np.float64])


@pytest.mark.parametrize("dtype,stash", [(np.float16, 1), (np.float16, 10), (np.float32, 10), (np.float32, 11),
                                         ("bfloat16", 1)])
def test_group_norm_stash_type(rng, dtype, stash):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ins = [a.astype(dt) for a in gn_inputs(rng, (2, 4, 3, 3))]
    attrs = dict(num_groups=2, stash_type=stash)
    wide = [a.astype(np.float32) for a in ins]
    # the oracle: ONNX's function body on float32 data with the same stash (only the last rounding differs)
    want = onnx_outputs("GroupNormalization", wide, attrs, opset=21)[0]
    (y,) = check_op("GroupNormalization", ins, None, attrs)
    assert y.dtype == dt
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_group_norm_of_a_constant_group_is_the_bias(rng):
    x = np.full((1, 2, 3, 3), 1421.955, np.float32)
    scale, bias = rand(rng, (2,)), rand(rng, (2,))
    # ONNX's function body takes the variance as E[x^2] - E[x]^2, which rounds below -epsilon here: NaN
    assert np.isnan(onnx_outputs("GroupNormalization", [x, scale, bias], dict(num_groups=1), opset=21)[0]).all()
    check_op("GroupNormalization", [x, scale, bias], np.broadcast_to(bias[None, :, None, None], x.shape),
             dict(num_groups=1), rtol=1e-6, atol=1e-6)


def test_group_norm_empty_input():
    ins = [np.zeros((0, 4, 3), np.float32), np.ones(4, np.float32), np.zeros(4, np.float32)]
    (y,) = check_op("GroupNormalization", ins, None, dict(num_groups=2))
    assert y.shape == (0, 4, 3)


@pytest.mark.parametrize("x_shape,c,attrs,match", [
    ((2, 6, 3), 6, dict(num_groups=4), "num_groups 4 does not divide the 6 channels"),
    ((2, 6, 3), 6, dict(num_groups=0), "num_groups must be >= 1"),
    ((2, 6, 3), 3, dict(num_groups=3), r"scale must have shape \[6\]"),
    ((6,), 6, dict(num_groups=3), "rank >= 2"),
    ((2, 6, 3), 6, dict(num_groups=3, stash_type=7), "stash_type must be a float type"),
])
def test_group_norm_bad_inputs_fail(x_shape, c, attrs, match):
    ins = [np.zeros(x_shape, np.float32), np.ones(c, np.float32), np.ones(6, np.float32)]
    with pytest.raises(ShapeInferenceError, match=rf"\(GroupNormalization\).*{match}"):
        build_single("GroupNormalization", ins, attrs)


@pytest.mark.parametrize("opset", [18, 20])
@pytest.mark.parametrize("const", [True, False])
def test_group_norm_18_imports_with_scale_and_bias_per_channel(rng, opset, const):
    import kiln
    x = rand(rng, (2, 6, 3, 2)) * 2 + 1
    scale, bias = rand(rng, (3,)), rand(rng, (3,))  # GroupNormalization-18: one value per group
    attrs = dict(num_groups=3, epsilon=1e-3)
    model = one_node_model("GroupNormalization", [x, scale, bias], attrs, opset=opset,
                           initializers=(1, 2) if const else ())
    graph = kiln.import_onnx(model)
    gn = next(n for n in graph.nodes if n.op == "GroupNormalization")
    assert gn.attrs["stash_type"] == 1 and gn.inputs[1].type.shape == (6,)
    assert [n.op for n in graph.nodes].count("Gather") == (0 if const else 2)
    feeds = [x] if const else [x, scale, bias]
    (y,) = kiln.load(graph).run(feeds, as_list=True)
    np.testing.assert_allclose(y, onnx_outputs("GroupNormalization", [x, scale, bias], attrs, opset=18)[0],
                               rtol=1e-5, atol=1e-5)


def test_group_norm_18_of_float16_computes_in_float16(rng):
    import kiln
    ins = [a.astype(np.float16) for a in [rand(rng, (2, 4, 3)), rand(rng, (2,)), rand(rng, (2,))]]
    graph = kiln.import_onnx(one_node_model("GroupNormalization", ins, dict(num_groups=2), opset=18))
    assert next(n for n in graph.nodes if n.op == "GroupNormalization").attrs["stash_type"] == 10
    (y,) = kiln.load(graph).run(ins, as_list=True)
    want = onnx_outputs("GroupNormalization", ins, dict(num_groups=2), opset=18)[0]
    np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_group_norm_18_needs_the_channel_count(rng):
    import kiln
    from kiln.errors import UnsupportedOpError
    ins = [rand(rng, (2, 4, 3)), rand(rng, (2,)), rand(rng, (2,))]
    model = one_node_model("GroupNormalization", ins, dict(num_groups=2), opset=18, dims=[2, "C", 3])
    with pytest.raises(UnsupportedOpError, match=r"GroupNormalization-18.*channel count"):
        kiln.import_onnx(model)
    model = one_node_model("GroupNormalization", ins, dict(num_groups=3), opset=18)
    with pytest.raises(kiln.KilnError, match=r"num_groups 3 does not divide X's 4 channels"):
        kiln.import_onnx(model)


@pytest.mark.parametrize("dtype,stash", [(np.float32, 1), (np.float32, 11), (np.float32, 10), (np.float16, 1),
                                         (np.float64, 1)])
def test_group_norm_exports_as_itself_from_opset_21_and_expanded_before(rng, dtype, stash):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from kiln.ir import evaluate
    from kiln.serializer import onnx as kx
    ins = [a.astype(dtype) for a in gn_inputs(rng, (2, 6, 3, 2))]
    g, feeds = build_single("GroupNormalization", ins, dict(num_groups=3, stash_type=stash), symbolic_batch=True)
    (want,) = evaluate(g, feeds)
    assert kx.default_opset(g) == 21
    for opset in (18, 20, 21):
        proto = kx.to_onnx_model(g, opset=opset)
        onnx.checker.check_model(proto, full_check=True)
        ops = {n.op_type for n in proto.graph.node}
        assert ("GroupNormalization" in ops) == (opset >= 21)
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        (got,) = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), feeds)})
        tol = 1e-2 if dtype == np.float16 or stash == 10 else 1e-5
        if opset < 21:  # the expansion computes what kiln does, roundings included
            tol = 1e-3 if dtype == np.float16 else 1e-6
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- LRN


def lrn_loop(x, size, alpha=1e-4, beta=0.75, bias=1.0):
    """LRN by its ONNX definition, one channel at a time in float64."""
    x64 = x.astype(np.float64)
    c = x.shape[1]
    y = np.empty_like(x64)
    for ch in range(c):
        lo, hi = max(0, ch - (size - 1) // 2), min(c - 1, ch + int(np.ceil((size - 1) / 2)))
        square_sum = np.square(x64[:, lo:hi + 1]).sum(axis=1)
        y[:, ch] = x64[:, ch] / (bias + alpha / size * square_sum) ** beta
    return y


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7])
def test_lrn_matches_onnx_reference_and_definition(rng, size):
    x = rand(rng, (5, 5, 3, 4)) * 3  # N == C: where ONNX's reference evaluator (windows over N) is right
    attrs = dict(size=size, alpha=0.02, beta=0.6, bias=1.5)
    want = onnx_outputs("LRN", [x], attrs, opset=13)[0]
    check_op("LRN", [x], want, attrs, rtol=1e-5, atol=1e-6)
    check_op("LRN", [x], lrn_loop(x, **attrs), attrs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 7, 3, 3), (3, 4, 5), (1, 6, 2, 2, 2), (2, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_lrn_over_channels_any_rank(rng, shape, dtype):
    x = rand(rng, shape, dtype) * 4
    check_op("LRN", [x], lrn_loop(x, 3, alpha=0.1), dict(size=3, alpha=0.1), symbolic_batch=True, **TOL[dtype])


def test_lrn_bfloat16(rng):
    import ml_dtypes
    x = (rand(rng, (2, 4, 3, 3)) * 4).astype(ml_dtypes.bfloat16)
    (y,) = check_op("LRN", [x], None, dict(size=5, alpha=0.5))
    np.testing.assert_allclose(y.astype(np.float64), lrn_loop(x.astype(np.float32), 5, alpha=0.5), rtol=1e-2,
                               atol=1e-2)


@pytest.mark.parametrize("shape,attrs,match", [((2, 3, 4), dict(size=0), "size must be >= 1"),
                                               ((3,), dict(size=3), "rank >= 2")])
def test_lrn_bad_inputs_fail(shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(LRN\).*{match}"):
        build_single("LRN", [np.zeros(shape, np.float32)], attrs)
