"""Normalizations: BatchNormalization (inference and training mode), LayerNormalization, RMSNormalization
(opset 23), InstanceNormalization, GroupNormalization (opset 21), LRN, LpNormalization,
MeanVarianceNormalization, Softmax and LogSoftmax (ONNX semantics). Narrow floats compute in float32 and round
once (RMSNormalization and GroupNormalization: their normalization in stash_type)."""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import Dim, TensorType, dims_compatible, normalize_axis


def _check_dtypes(ctx: InferContext, *indices: int) -> DType:
    x = ctx.input(0).dtype
    for i in indices:
        if ctx.has_input(i) and ctx.input(i).dtype is not x:
            ctx.fail(f"input {i} is {ctx.input(i).dtype} but X is {x}; they must match")
    return x


def _check_per_channel(ctx: InferContext, i: int, name: str, channels: Dim) -> None:
    """Input i must be a 1-D tensor of one value per channel."""
    s = ctx.input(i).shape
    if s is not None and (len(s) != 1 or not dims_compatible(s[0], channels)):
        ctx.fail(f"{name} must have shape [{channels}] (one value per channel), got {list(s)}")


def _channel_shape(x: np.ndarray) -> tuple:
    """Shape that broadcasts a per-channel vector over [N, C, *spatial]."""
    return (-1,) + (1,) * (x.ndim - 2)


# --------------------------------------------------------------------------- BatchNormalization


def infer_batch_norm(ctx: InferContext) -> "TensorType | list":
    training = ctx.attrs["training_mode"]
    if training not in (0, 1):
        ctx.fail(f"training_mode must be 0 or 1, got {training}")
    if ctx.num_outputs > 1 and not training:
        ctx.fail("running_mean/running_var outputs exist only in training mode (training_mode=1); use only output Y")
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) < 2:
        ctx.fail(f"X must have rank >= 2 ([N, C, ...]), got shape {list(x.shape)}")
    channels = x.shape[1] if x.shape is not None else None
    for i, name in enumerate(("scale", "B", "input_mean", "input_var"), start=1):
        _check_per_channel(ctx, i, name, channels)
    if ctx.num_outputs == 1:
        return x
    if channels is None:
        channels = next((ctx.input(i).shape[0] for i in (3, 4) if ctx.input(i).shape is not None), None)
    running = [TensorType(ctx.input(i).dtype, (channels,)) for i in (3, 4)]
    return [x] + running[:ctx.num_outputs - 1]


def _batch_norm_apply(x: np.ndarray, scale, b, mean, var, epsilon: float, acc: np.dtype) -> np.ndarray:
    """(X - mean) / sqrt(var + epsilon) * scale + B in ``acc``, the statistics per channel."""
    shape = _channel_shape(x)

    def per_channel(v):
        return np.asarray(v).astype(acc).reshape(shape)

    inv = 1.0 / np.sqrt(per_channel(var) + acc.type(epsilon))
    return (x.astype(acc) - per_channel(mean)) * inv * per_channel(scale) + per_channel(b)


@op("BatchNormalization",
    inputs=[In("X", FLOAT), In("scale", FLOAT), In("B", FLOAT), In("input_mean", FLOAT), In("input_var", FLOAT)],
    outputs=["Y", Out("running_mean", FLOAT, optional=True), Out("running_var", FLOAT, optional=True)],
    attrs=[Attr("epsilon", AttrKind.FLOAT, 1e-5), Attr("momentum", AttrKind.FLOAT, 0.9),
           Attr("training_mode", AttrKind.INT, 0)],
    infer=infer_batch_norm)
def batch_normalization(x, scale, b, mean, var, *, epsilon, momentum, training_mode):
    """Inference mode: Y = (X - input_mean) / sqrt(input_var + epsilon) * scale + B.

    Training mode (BatchNormalization-15): Y normalizes with the batch's own statistics, the mean and the
    population variance (divided by the count, not count - 1) of each channel over every axis but 1, computed
    in float32 or wider; the other outputs are running_mean = input_mean * momentum + mean * (1 - momentum)
    and running_var likewise from input_var and the variance, in input_mean's (input_var's) type. An empty
    batch has NaN statistics."""
    acc = compute_dtype(x.dtype)
    if not training_mode:
        return _batch_norm_apply(x, scale, b, mean, var, epsilon, acc).astype(x.dtype)
    axes = (0,) + tuple(range(2, x.ndim))
    xa = x.astype(acc)
    count = x.size // max(x.shape[1], 1)
    if count:
        cur_mean = xa.mean(axis=axes)
        cur_var = np.square(xa - cur_mean.reshape(_channel_shape(x))).mean(axis=axes)
    else:
        cur_mean = cur_var = np.full(x.shape[1], np.nan, acc)
    y = _batch_norm_apply(x, scale, b, cur_mean, cur_var, epsilon, acc).astype(x.dtype)

    def running(stored, current):
        wide = compute_dtype(stored.dtype)
        return (stored.astype(wide) * wide.type(momentum) + current.astype(wide) * wide.type(1 - momentum)
                ).astype(stored.dtype)

    return y, running(mean, cur_mean), running(var, cur_var)


# --------------------------------------------------------------------------- LayerNormalization


def _check_affine(ctx: InferContext, i: int, name: str, normalized: tuple) -> None:
    """Scale/B must broadcast one way onto the normalized dims X.shape[axis:]."""
    s = ctx.input(i).shape
    if s is None:
        return
    ok = len(s) <= len(normalized) and all(
        d == 1 or dims_compatible(d, n) for d, n in zip(reversed(s), reversed(normalized)))
    if not ok:
        ctx.fail(f"{name} of shape {list(s)} does not broadcast to the normalized dims {list(normalized)}")


def _stash_dtype(ctx: InferContext) -> DType:
    try:
        stash = DType(ctx.attrs["stash_type"])
    except ValueError:
        ctx.fail(f"stash_type {ctx.attrs['stash_type']} is not a dtype code")
    if not stash.is_float:
        ctx.fail(f"stash_type must be a float type, got {stash}")
    return stash


def infer_layer_norm(ctx: InferContext) -> list:
    dtype = _check_dtypes(ctx, 1, 2)
    x = ctx.input(0)
    stash = _stash_dtype(ctx)
    if x.shape is None:
        return [x] + [TensorType(stash, None)] * (ctx.num_outputs - 1)
    rank = len(x.shape)
    try:
        axis = normalize_axis(ctx.attrs["axis"], rank)
    except ValueError as e:
        ctx.fail(str(e))
    _check_affine(ctx, 1, "Scale", x.shape[axis:])
    if ctx.has_input(2):
        _check_affine(ctx, 2, "B", x.shape[axis:])
    stats = TensorType(stash, list(x.shape[:axis]) + [1] * (rank - axis))
    return [TensorType(dtype, x.shape)] + [stats] * (ctx.num_outputs - 1)


@op("LayerNormalization", inputs=[In("X", FLOAT), In("Scale", FLOAT), In("B", FLOAT, optional=True)],
    outputs=["Y", Out("Mean", FLOAT, optional=True), Out("InvStdDev", FLOAT, optional=True)],
    attrs=[Attr("axis", AttrKind.INT, -1), Attr("epsilon", AttrKind.FLOAT, 1e-5),
           Attr("stash_type", AttrKind.INT, 1)],
    infer=infer_layer_norm)
def layer_normalization(x, scale, b=None, *, axis, epsilon, stash_type):
    """Normalize over dims axis..rank-1, then scale and shift. Also returns the Mean and
    InvStdDev it used (in stash_type), as the optional outputs."""
    acc = compute_dtype(x.dtype)
    axes = tuple(range(normalize_axis(axis, x.ndim), x.ndim))
    xa = x.astype(acc)
    mean = xa.mean(axis=axes, keepdims=True)
    inv_std = 1.0 / np.sqrt(np.square(xa - mean).mean(axis=axes, keepdims=True) + acc.type(epsilon))
    y = (xa - mean) * inv_std * scale.astype(acc)
    if b is not None:
        y = y + b.astype(acc)
    stash = DType(stash_type).numpy
    return y.astype(x.dtype), mean.astype(stash), inv_std.astype(stash)


# --------------------------------------------------------------------------- InstanceNormalization


def infer_instance_norm(ctx: InferContext) -> TensorType:
    _check_dtypes(ctx, 1, 2)
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) < 3:
        ctx.fail(f"input must have rank >= 3 ([N, C, *spatial]), got shape {list(x.shape)}")
    channels = x.shape[1] if x.shape is not None else None
    _check_per_channel(ctx, 1, "scale", channels)
    _check_per_channel(ctx, 2, "B", channels)
    return x


@op("InstanceNormalization", inputs=[In("input", FLOAT), In("scale", FLOAT), In("B", FLOAT)],
    outputs=["output"], attrs=[Attr("epsilon", AttrKind.FLOAT, 1e-5)],
    infer=infer_instance_norm)
def instance_normalization(x, scale, b, *, epsilon):
    """Normalize each (sample, channel) over its spatial dims, then per-channel scale and shift."""
    acc = compute_dtype(x.dtype)
    axes = tuple(range(2, x.ndim))
    xa = x.astype(acc)
    mean = xa.mean(axis=axes, keepdims=True)
    var = np.square(xa - mean).mean(axis=axes, keepdims=True)
    shape = _channel_shape(x)
    y = (xa - mean) / np.sqrt(var + acc.type(epsilon)) * scale.astype(acc).reshape(shape)
    return (y + b.astype(acc).reshape(shape)).astype(x.dtype)


# --------------------------------------------------------------------------- GroupNormalization


def infer_group_norm(ctx: InferContext) -> TensorType:
    _check_dtypes(ctx, 1, 2)
    _stash_dtype(ctx)
    groups = ctx.attrs["num_groups"]
    if groups < 1:
        ctx.fail(f"num_groups must be >= 1, got {groups}")
    x = ctx.input(0)
    if x.shape is None:
        return x
    if len(x.shape) < 2:
        ctx.fail(f"X must have rank >= 2 ([N, C, ...]), got shape {list(x.shape)}")
    channels = x.shape[1]
    if isinstance(channels, int) and channels % groups:
        ctx.fail(f"num_groups {groups} does not divide the {channels} channels of X")
    _check_per_channel(ctx, 1, "scale", channels)
    _check_per_channel(ctx, 2, "bias", channels)
    return x


@op("GroupNormalization", inputs=[In("X", FLOAT), In("scale", FLOAT), In("bias", FLOAT)], outputs=["Y"],
    attrs=[Attr("num_groups", AttrKind.INT), Attr("epsilon", AttrKind.FLOAT, 1e-5),
           Attr("stash_type", AttrKind.INT, 1)],
    infer=infer_group_norm)
def group_normalization(x, scale, bias, *, num_groups, epsilon, stash_type):
    """GroupNormalization-21: the channels of X [N, C, ...] split into num_groups groups of C / num_groups; each
    (sample, group) normalized by its mean and population variance, (X - mean) / sqrt(var + epsilon), then scaled
    and shifted per channel. The normalization runs in stash_type (X cast to it, epsilon a float32 cast to it,
    statistics accumulated in float32 or wider, the result rounded to stash_type and cast to X's type), the scale
    and shift in X's type (one rounding), as ONNX's function body. The variance is taken of X - mean, not as
    E[X^2] - mean^2 (the body's form), which is the same number but can round below zero (a NaN from sqrt)
    where a group is nearly constant."""
    if x.size == 0:
        return x.copy()
    stash = DType(stash_type).numpy
    wide = compute_dtype(stash)
    n = x.shape[0]
    xg = x.astype(stash).astype(wide).reshape(n, num_groups, -1)
    centered = xg - xg.mean(axis=2, keepdims=True)
    var = np.square(centered).mean(axis=2, keepdims=True)
    eps = np.asarray(np.float32(epsilon)).astype(stash).astype(wide)
    normalized = (centered / np.sqrt(var + eps)).astype(stash).astype(x.dtype).reshape(x.shape)
    acc = compute_dtype(x.dtype)
    shape = _channel_shape(x)
    y = normalized.astype(acc) * scale.astype(acc).reshape(shape) + bias.astype(acc).reshape(shape)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- LRN


def infer_lrn(ctx: InferContext) -> TensorType:
    size = ctx.attrs["size"]
    if size < 1:
        ctx.fail(f"size must be >= 1 (channels summed over), got {size}")
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) < 2:
        ctx.fail(f"X must have rank >= 2 ([N, C, ...]), got shape {list(x.shape)}")
    return x


@op("LRN", inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("size", AttrKind.INT), Attr("alpha", AttrKind.FLOAT, 1e-4), Attr("beta", AttrKind.FLOAT, 0.75),
           Attr("bias", AttrKind.FLOAT, 1.0)],
    infer=infer_lrn)
def lrn(x, *, size, alpha, beta, bias):
    """Local response normalization across channels (LRN-13): Y = X / (bias + alpha / size * square_sum) ^ beta,
    square_sum[n, c, ...] the sum of X[n, i, ...]^2 over max(0, c - floor((size-1)/2)) <= i <=
    min(C-1, c + ceil((size-1)/2)). (ONNX's reference evaluator walks the window over the batch axis instead of
    the channels, so it agrees with this only where N = C; ONNX Runtime follows the definition.)"""
    acc = compute_dtype(x.dtype)
    sq = np.square(x.astype(acc))
    channels = x.shape[1]
    before = (size - 1) // 2
    pad = [(0, 0)] * x.ndim
    pad[1] = (before, size - 1 - before)
    padded = np.pad(sq, pad)
    square_sum = np.zeros_like(sq)
    for k in range(size):  # one shifted slice per window position: size is small (3 or 5 in practice)
        square_sum += padded[:, k:k + channels]
    y = x.astype(acc) / np.power(acc.type(bias) + acc.type(alpha / size) * square_sum, acc.type(beta))
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- Softmax, LogSoftmax


def infer_softmax(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is not None:
        try:
            normalize_axis(ctx.attrs["axis"], len(x.shape))
        except ValueError as e:
            ctx.fail(str(e))
    return x


def _shifted(x: np.ndarray, axis: int) -> np.ndarray:
    """x minus its max along axis (in the compute dtype): exp() of it cannot overflow."""
    xa = x.astype(compute_dtype(x.dtype))
    return xa - xa.max(axis=axis, keepdims=True)


@op("Softmax", inputs=[In("input", FLOAT)], outputs=["output"], attrs=[Attr("axis", AttrKind.INT, -1)],
    infer=infer_softmax)
def softmax(x, *, axis):
    """exp(x) / sum(exp(x)) along axis, computed from x - max(x) so it never overflows."""
    e = np.exp(_shifted(x, axis))
    return (e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)


@op("LogSoftmax", inputs=[In("input", FLOAT)], outputs=["output"], attrs=[Attr("axis", AttrKind.INT, -1)],
    infer=infer_softmax)
def log_softmax(x, *, axis):
    """x - log(sum(exp(x))) along axis, computed from x - max(x) so it never overflows."""
    s = _shifted(x, axis)
    return (s - np.log(np.exp(s).sum(axis=axis, keepdims=True))).astype(x.dtype)


# --------------------------------------------------------------------------- RMSNormalization

_STASH_TYPES = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16)


def infer_rms_norm(ctx: InferContext) -> TensorType:
    x, scale = ctx.input(0), ctx.input(1)
    if scale.dtype is not x.dtype:
        # ONNX's types allow X and scale to differ, but its function body multiplies X-typed values by scale
        # (Mul takes one type), so a model with two types has no defined result.
        ctx.fail(f"scale is {scale.dtype} but X is {x.dtype}; they must match")
    stash = _stash_dtype(ctx)
    if stash not in _STASH_TYPES:
        ctx.fail(f"stash_type must be float16, float32, float64 or bfloat16, got {stash}")
    if x.shape is None:
        return x
    rank = len(x.shape)
    if rank == 0:
        ctx.fail("X must have rank >= 1 (a scalar has no axis to normalize over)")
    try:
        normalize_axis(ctx.attrs["axis"], rank)
    except ValueError as e:
        ctx.fail(str(e))
    s = scale.shape
    if s is not None and (len(s) > rank or not all(
            d == 1 or dims_compatible(d, n) for d, n in zip(reversed(s), reversed(x.shape)))):
        ctx.fail(f"scale of shape {list(s)} does not broadcast (one way) to X's shape {list(x.shape)}")
    return x


@op("RMSNormalization", inputs=[In("X", FLOAT), In("scale", FLOAT)], outputs=["Y"],
    attrs=[Attr("axis", AttrKind.INT, -1), Attr("epsilon", AttrKind.FLOAT, 1e-5),
           Attr("stash_type", AttrKind.INT, 1)],
    infer=infer_rms_norm)
def rms_normalization(x, scale, *, axis, epsilon, stash_type):
    """Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale, as ONNX's function body: the
    normalization in stash_type (X cast to it, epsilon a float32 cast to it, the mean summed in float32 or
    wider and rounded to it), the result cast back to X's type, then multiplied by scale in X's type."""
    stash = DType(stash_type).numpy
    wide = compute_dtype(stash)
    axes = tuple(range(normalize_axis(axis, x.ndim), x.ndim))
    xu = x.astype(stash)
    mean = np.mean((xu * xu).astype(wide), axis=axes, keepdims=True).astype(stash)
    rms = np.sqrt(mean + np.asarray(np.float32(epsilon)).astype(stash))
    normalized = (xu / rms).astype(x.dtype)
    acc = compute_dtype(x.dtype)  # one rounding: a product of two narrow floats is exact in float32
    return (normalized.astype(acc) * scale.astype(acc)).astype(x.dtype)


# --------------------------------------------------------------------------- LpNormalization


def infer_lp_norm(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if ctx.attrs["p"] not in (1, 2):
        ctx.fail(f"p must be 1 or 2, got {ctx.attrs['p']}")
    if x.shape is not None:
        if len(x.shape) == 0:
            ctx.fail("input must have rank >= 1 (a scalar has no axis to normalize along)")
        try:
            normalize_axis(ctx.attrs["axis"], len(x.shape))
        except ValueError as e:
            ctx.fail(str(e))
    return x


@op("LpNormalization", inputs=[In("input", FLOAT)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, -1), Attr("p", AttrKind.INT, 2)],
    infer=infer_lp_norm)
def lp_normalization(x, *, axis, p):
    """x / ||x||_p along axis (p = 1: sum of |x|; p = 2: sqrt of the sum of squares); 0 where the norm is 0."""
    if p not in (1, 2):
        raise ValueError(f"LpNormalization: p must be 1 or 2, got {p}")
    acc = compute_dtype(x.dtype)
    xa = x.astype(acc)
    if p == 1:
        norm = np.abs(xa).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt(np.square(xa).sum(axis=axis, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, acc.type(0), xa / norm)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- MeanVarianceNormalization

MVN_EPSILON = 1e-9  # what ONNX's function body adds to the standard deviation


def _mvn_axes(ctx: InferContext, rank: int) -> tuple:
    axes = []
    for a in ctx.attrs["axes"]:
        try:
            axes.append(normalize_axis(int(a), rank, "axes entry"))
        except ValueError as e:
            ctx.fail(f"{e} (axes={list(ctx.attrs['axes'])})")
    if len(set(axes)) != len(axes):
        ctx.fail(f"axes {list(ctx.attrs['axes'])} name an axis twice")
    return tuple(axes)


def infer_mvn(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is not None:
        _mvn_axes(ctx, len(x.shape))
    return x


@op("MeanVarianceNormalization", inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("axes", AttrKind.INTS, (0, 2, 3))], infer=infer_mvn)
def mean_variance_normalization(x, *, axes):
    """(X - E[X]) / (sqrt(E[(X - E[X])^2]) + 1e-9), the expectations over ``axes`` (ONNX's definition; its
    function body's epsilon). The variance is taken of X - E[X], not as E[X^2] - E[X]^2, which is the same
    number but can round below zero (a NaN from sqrt) where X is constant along the axes."""
    acc = compute_dtype(x.dtype)
    axes = tuple(normalize_axis(int(a), x.ndim) for a in axes)
    xa = x.astype(acc)
    centered = xa - xa.mean(axis=axes, keepdims=True)
    std = np.sqrt(np.square(centered).mean(axis=axes, keepdims=True))
    return (centered / (std + acc.type(MVN_EPSILON))).astype(x.dtype)
