"""Comparisons, boolean logic, Where, Cast and float classification (ONNX opset-18 semantics)."""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import ALL, BOOL, FLOAT, INT, NUMERIC, infer_broadcast, infer_broadcast_bool, infer_same, \
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


# Bitwise ops (ai.onnx 18) on the integer types kiln has (uint16/32/64 are not kiln dtypes).
@op("BitwiseAnd", traits=("elementwise", "commutative"), inputs=[In("A", INT), In("B", INT)], outputs=["C"],
    infer=infer_broadcast)
def bitwise_and(a, b):
    return np.bitwise_and(a, b)


@op("BitwiseOr", traits=("elementwise", "commutative"), inputs=[In("A", INT), In("B", INT)], outputs=["C"],
    infer=infer_broadcast)
def bitwise_or(a, b):
    return np.bitwise_or(a, b)


@op("BitwiseXor", traits=("elementwise", "commutative"), inputs=[In("A", INT), In("B", INT)], outputs=["C"],
    infer=infer_broadcast)
def bitwise_xor(a, b):
    return np.bitwise_xor(a, b)


@op("BitwiseNot", traits=("elementwise",), inputs=[In("X", INT)], outputs=["Y"], infer=infer_same)
def bitwise_not(x):
    return np.invert(x)


def _infer_bitshift(ctx: InferContext) -> TensorType:
    if ctx.attrs["direction"] not in ("LEFT", "RIGHT"):
        ctx.fail(f"direction must be 'LEFT' or 'RIGHT', not {ctx.attrs['direction']!r}")
    if ctx.input(0).dtype is not ctx.input(1).dtype:
        ctx.fail(f"X and Y have different dtypes: {ctx.input(0).dtype}, {ctx.input(1).dtype}")
    return infer_broadcast(ctx)


@op("BitShift", inputs=[In("X", INT), In("Y", INT)], outputs=["Z"],
    attrs=[Attr("direction", AttrKind.STRING, REQUIRED)], infer=_infer_bitshift)
def bit_shift(x, y, direction=REQUIRED):
    """BitShift-28 (kiln imports every version: BitShift-11 is its unsigned subset). Right shifts of signed
    types are arithmetic; left shifts drop the bits shifted past the width (the sign bit included); a shift
    below 0 or of the width or more gives what the sign extension alone gives: -1 for a right shift of a
    negative x, else 0."""
    x, y = np.broadcast_arrays(x, y)
    bits = np.iinfo(x.dtype).bits
    valid = (y >= 0) & (y < bits)
    s = np.where(valid, y, 0)
    if direction == "RIGHT":
        out = np.right_shift(x, s.astype(x.dtype))
        fill = np.where(x < 0, x.dtype.type(-1), x.dtype.type(0)) if x.dtype.kind == "i" else x.dtype.type(0)
    else:
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        out = np.left_shift(x.view(unsigned), s.astype(unsigned)).view(x.dtype)
        fill = x.dtype.type(0)
    return np.where(valid, out, fill).astype(x.dtype)


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
