"""Comparisons, boolean logic, Where, Cast and float classification (ONNX opset-18 semantics)."""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import ALL, BOOL, FLOAT, NUMERIC, infer_broadcast, infer_broadcast_bool, infer_same, \
    same_shape
from kiln.ir.registry import REQUIRED, Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, broadcast_shapes

# --------------------------------------------------------------------------- comparisons


@op("Equal", traits=("elementwise", "commutative"),
    inputs=[In("A", ALL), In("B", ALL)], outputs=["C"], infer=infer_broadcast_bool)
def equal(a, b):
    return np.equal(a, b)


@op("Less", traits=("elementwise",),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast_bool)
def less(a, b):
    return np.less(a, b)


@op("Greater", traits=("elementwise",),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast_bool)
def greater(a, b):
    return np.greater(a, b)


@op("LessOrEqual", traits=("elementwise",),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast_bool)
def less_or_equal(a, b):
    return np.less_equal(a, b)


@op("GreaterOrEqual", traits=("elementwise",),
    inputs=[In("A", NUMERIC), In("B", NUMERIC)], outputs=["C"], infer=infer_broadcast_bool)
def greater_or_equal(a, b):
    return np.greater_equal(a, b)


# --------------------------------------------------------------------------- boolean logic


@op("Not", traits=("elementwise",), inputs=[In("X", BOOL)], outputs=["Y"], infer=infer_same)
def not_(x):
    return np.logical_not(x)


@op("And", traits=("elementwise", "commutative"),
    inputs=[In("A", BOOL), In("B", BOOL)], outputs=["C"], infer=infer_broadcast)
def and_(a, b):
    return np.logical_and(a, b)


@op("Or", traits=("elementwise", "commutative"),
    inputs=[In("A", BOOL), In("B", BOOL)], outputs=["C"], infer=infer_broadcast)
def or_(a, b):
    return np.logical_or(a, b)


@op("Xor", traits=("elementwise", "commutative"),
    inputs=[In("A", BOOL), In("B", BOOL)], outputs=["C"], infer=infer_broadcast)
def xor(a, b):
    return np.logical_xor(a, b)


def _infer_where(ctx: InferContext) -> TensorType:
    cond, x, y = ctx.input(0), ctx.input(1), ctx.input(2)
    if cond.dtype is not DType.BOOL:
        ctx.fail(f"condition must be bool, got {cond.dtype}")
    if x.dtype is not y.dtype:
        ctx.fail(f"X and Y have different dtypes: {x.dtype}, {y.dtype}")
    return TensorType(x.dtype, broadcast_shapes(cond.shape, x.shape, y.shape))


@op("Where", traits=("elementwise",),
    inputs=[In("condition", BOOL), In("X", ALL), In("Y", ALL)], outputs=["output"], infer=_infer_where)
def where(cond, x, y):
    """X where condition holds, else Y; all three broadcast together."""
    return np.where(cond, x, y)


# --------------------------------------------------------------------------- Cast


def _target(code: int) -> DType:
    """The kiln dtype of an ONNX TensorProto data type code; ValueError if kiln lacks it."""
    try:
        return DType(code)
    except ValueError:
        known = ", ".join(f"{d.value} ({d})" for d in DType)
        raise ValueError(f"to={code} is not a dtype kiln supports; known codes: {known}") from None


def _infer_cast(ctx: InferContext) -> TensorType:
    try:
        target = _target(ctx.attrs["to"])
    except ValueError as e:
        ctx.fail(str(e))
    return same_shape(ctx, target)


# ``saturate`` (Cast-19) only changes float8 conversions, which kiln does not have; it is
# accepted so opset-19 models load, and ignored.
def _propagate_cast(ctx: InferContext):
    """Shape values survive a cast between integer types (Shape -> Cast(int32) -> Reshape)."""
    return ctx.symbolic(0) if _target(ctx.attrs["to"]).is_int else None


@op("Cast", traits=("elementwise",), inputs=[In("input", ALL)], outputs=["output"],
    attrs=[Attr("to", AttrKind.INT, REQUIRED), Attr("saturate", AttrKind.INT, 1)], infer=_infer_cast,
    propagate=_propagate_cast)
def cast(x, to=REQUIRED, saturate=1):
    """Convert to dtype code ``to``. Float to int truncates toward zero (out of range: undefined);
    anything nonzero (NaN included) becomes True."""
    target = _target(to).numpy
    # NaN/inf/out-of-range float -> int is undefined in ONNX; numpy's result is kept, quietly.
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x).astype(target)


def _infer_cast_like(ctx: InferContext) -> TensorType:
    return same_shape(ctx, ctx.input(1).dtype)


@op("CastLike", inputs=[In("input", ALL), In("target_type", ALL)], outputs=["output"],
    attrs=[Attr("saturate", AttrKind.INT, 1)], infer=_infer_cast_like, since_version=1)
def cast_like(x, target_type, saturate=1):
    """Cast to the dtype of ``target_type`` (its values are not read); as Cast otherwise. ONNX
    function bodies (the expanded forms of many activations) use it to type their constants."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x).astype(np.asarray(target_type).dtype)


# --------------------------------------------------------------------------- float classification


def _infer_bool_like(ctx: InferContext) -> TensorType:
    return same_shape(ctx, DType.BOOL)


@op("IsNaN", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=_infer_bool_like)
def is_nan(x):
    return np.isnan(x)


@op("IsInf", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("detect_negative", AttrKind.INT, 1), Attr("detect_positive", AttrKind.INT, 1)],
    infer=_infer_bool_like)
def is_inf(x, detect_negative=1, detect_positive=1):
    """True at -inf (if detect_negative) and at +inf (if detect_positive)."""
    inf = np.isinf(x)
    with np.errstate(invalid="ignore"):
        negative = np.less(x, 0)
    return (inf & negative & bool(detect_negative)) | (inf & ~negative & bool(detect_positive))
