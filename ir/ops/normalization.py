"""Normalizations: BatchNormalization (inference), LayerNormalization, RMSNormalization (opset 23),
InstanceNormalization, LpNormalization, MeanVarianceNormalization, Softmax and LogSoftmax (ONNX
semantics). Narrow floats compute in float32 and round once (RMSNormalization: in its stash_type)."""
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


def infer_batch_norm(ctx: InferContext) -> TensorType:
    if ctx.attrs["training_mode"] != 0:
        ctx.fail("training_mode=1 is not supported: kiln runs BatchNormalization in inference mode")
    if ctx.num_outputs > 1:
        ctx.fail("running_mean/running_var outputs exist only in training mode; use only output Y")
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) < 2:
        ctx.fail(f"X must have rank >= 2 ([N, C, ...]), got shape {list(x.shape)}")
    channels = x.shape[1] if x.shape is not None else None
    for i, name in enumerate(("scale", "B", "input_mean", "input_var"), start=1):
        _check_per_channel(ctx, i, name, channels)
    return x


@op("BatchNormalization",
    inputs=[In("X", FLOAT), In("scale", FLOAT), In("B", FLOAT), In("input_mean", FLOAT), In("input_var", FLOAT)],
    outputs=["Y", Out("running_mean", FLOAT, optional=True), Out("running_var", FLOAT, optional=True)],
    attrs=[Attr("epsilon", AttrKind.FLOAT, 1e-5), Attr("momentum", AttrKind.FLOAT, 0.9),
           Attr("training_mode", AttrKind.INT, 0)],
    infer=infer_batch_norm)
def batch_normalization(x, scale, b, mean, var, *, epsilon, momentum, training_mode):
    """Y = (X - mean) / sqrt(var + epsilon) * scale + B with the stored statistics
    (momentum only matters in training mode)."""
    if training_mode:
        raise ValueError("training_mode=1 is not supported")
    acc = compute_dtype(x.dtype)
    shape = _channel_shape(x)

    def per_channel(v):
        return v.astype(acc).reshape(shape)

    inv = 1.0 / np.sqrt(per_channel(var) + acc.type(epsilon))
    y = (x.astype(acc) - per_channel(mean)) * inv * per_channel(scale) + per_channel(b)
    return y.astype(x.dtype)


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
