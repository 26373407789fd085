"""Comparisons, boolean logic, Where, Cast and float classification (ONNX opset-18 semantics)."""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import ANY_TYPES as ANY
from kiln.ir.dtypes import FLOAT8_TYPES, DType, dtype
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


def _propagate_cast(ctx: InferContext):
    """Shape values survive a cast between integer types (Shape -> Cast(int32) -> Reshape)."""
    return ctx.symbolic(0) if _target(ctx.attrs["to"]).is_int else None


_ROUND_MODES = ("up", "down", "nearest")


def _check_round_mode(ctx: InferContext) -> None:
    if ctx.attrs["round_mode"] not in _ROUND_MODES:
        ctx.fail(f"round_mode must be one of {list(_ROUND_MODES)}, not {ctx.attrs['round_mode']!r}")


def _infer_cast(ctx: InferContext) -> TensorType:
    _check_round_mode(ctx)
    try:
        target = _target(ctx.attrs["to"])
    except ValueError as e:
        ctx.fail(str(e))
    return same_shape(ctx, target)


def cast_array(x: np.ndarray, target: DType, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    """``x`` converted to ``target`` as ONNX's Cast-25 defines it. Between the ordinary types: numpy's
    conversion (float to int truncates toward zero; NaN, inf and out-of-range values are undefined in ONNX and
    numpy's result is kept quietly; anything nonzero, NaN included, becomes True). To a float8 type with
    ``saturate`` (the default): out-of-range values and infinities clamp to the largest finite value, NaN stays
    NaN; without it they become NaN (inf where the type has one). To float8e8m0: the exponent of x's float32
    value, rounded by ``round_mode`` (see ``to_float8e8m0``). The sub-byte integers and float4 convert as
    ml_dtypes does, which is what ONNX's reference does."""
    x = np.asarray(x)
    dt = target.numpy
    with np.errstate(invalid="ignore", over="ignore"):
        if target is DType.FLOAT8E8M0:
            return to_float8e8m0(x, bool(saturate), round_mode)
        if target in FLOAT8_TYPES and saturate:
            import ml_dtypes
            info = ml_dtypes.finfo(dt)
            src = x if x.dtype.kind == "f" or dtype(x.dtype).is_float else x.astype(np.float32)
            return np.clip(src, info.min, info.max).astype(dt)
        return x.astype(dt)


def to_float8e8m0(x: np.ndarray, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """float8e8m0 (an 8-bit power-of-two exponent, no sign or mantissa: the MX formats' shared scale) of ``x``'s
    float32 value: the float32 exponent bits, rounded up when a mantissa bit is set ('up'), kept ('down'), or
    rounded to nearest-even on the guard/round/sticky bits ('nearest'); NaN and inf give 0xFF (NaN), and
    ``saturate`` keeps a rounding from stepping past the largest finite value. Bit for bit as ONNX's
    reference (onnx.numpy_helper.to_float8e8m0)."""
    import ml_dtypes
    if round_mode not in _ROUND_MODES:
        raise ValueError(f"round_mode must be one of {list(_ROUND_MODES)}, not {round_mode!r}")
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    normal = ~special
    if round_mode == "nearest":
        g = (bits & 0x400000) > 0
        r = (bits & 0x200000) > 0
        st = (bits & 0x1FFFFF) > 0
        up = g & (r | st | (exponent > 0)) & normal
    elif round_mode == "up":
        up = ((bits & 0x7FFFFF) > 0) & normal
    else:
        up = np.zeros(bits.shape, bool)
    if saturate:
        up &= exponent != 0xFE
    exponent = (exponent + up).astype(np.uint8)
    out = np.where(special, np.uint8(0xFF), exponent).astype(np.uint8)
    return out.view(ml_dtypes.float8_e8m0fnu)


@op("Cast", traits=("elementwise",), inputs=[In("input", ANY)], outputs=["output"],
    attrs=[Attr("to", AttrKind.INT, REQUIRED), Attr("saturate", AttrKind.INT, 1),
           Attr("round_mode", AttrKind.STRING, "up")], infer=_infer_cast,
    propagate=_propagate_cast)
def cast(x, to=REQUIRED, saturate=1, round_mode="up"):
    """Convert to dtype code ``to`` (``cast_array``). ``saturate`` (Cast-19) and ``round_mode`` (Cast-24) only
    change conversions to the float8 types and float8e8m0."""
    return cast_array(x, _target(to), saturate, round_mode)


def _infer_cast_like(ctx: InferContext) -> TensorType:
    _check_round_mode(ctx)
    return same_shape(ctx, ctx.input(1).dtype)


@op("CastLike", inputs=[In("input", ANY), In("target_type", ANY)], outputs=["output"],
    attrs=[Attr("saturate", AttrKind.INT, 1), Attr("round_mode", AttrKind.STRING, "up")],
    infer=_infer_cast_like, since_version=1)
def cast_like(x, target_type, saturate=1, round_mode="up"):
    """Cast to the dtype of ``target_type`` (its values are not read); as Cast otherwise. ONNX
    function bodies (the expanded forms of many activations) use it to type their constants."""
    return cast_array(x, dtype(np.asarray(target_type).dtype), saturate, round_mode)


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
