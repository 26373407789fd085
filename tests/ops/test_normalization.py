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
    (dict(training_mode=1), None, (3,), "training_mode=1 is not supported"),
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
