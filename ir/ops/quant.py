"""Quantization (ONNX semantics): QuantizeLinear and DequantizeLinear (ai.onnx 10 to 28), DynamicQuantizeLinear,
the exact integer products MatMulInteger and ConvInteger (10), and the requantizing QLinearMatMul (10/21) and
QLinearConv (10).

QuantizeLinear / DequantizeLinear. kiln implements version 28 of both over the element types it has, and takes the
older versions as they are (each only added types or an attribute whose default keeps the old meaning):

- granularity, from the scale's shape: per-tensor (a scalar or 1-element scale), per-axis (a 1-D scale as long as x
  along ``axis``) or, from version 21, blocked (``block_size`` > 0: the scale has x's shape except along ``axis``,
  where it has ceil(D / block_size) entries, each repeated over a block of x); the zero point has the scale's shape;
- quantized types: int8, uint8, int16 and uint16 (21 added the 16-bit ones), and kiln's storage types
  (kiln.ir.dtypes): float8 (19: e4m3fn, e4m3fnuz, e5m2, e5m2fnuz), int4/uint4 (21), float4e2m1 (23), int2/uint2 (25);
  int32 data for DequantizeLinear; float8e8m0 scales (24). ONNX's float6 types (28) are not kiln dtypes: a model
  using them is refused at import by element type;
- DequantizeLinear: ``y = (x - x_zero_point) * x_scale``, the difference and product in float32 (as ONNX's reference
  evaluator: exact for 8- and 16-bit data and the storage types) rounded once to ``output_dtype`` (23), else to the
  scale's type (a float8e8m0 scale needs output_dtype: the output is float32, float16 or bfloat16);
- QuantizeLinear: ``y = saturate(round_half_even(x / y_scale) + y_zero_point)`` into ``output_dtype`` (21) or the
  zero point's type, uint8 without either. The division runs in ``precision``'s type (23) when given, else in the
  type numpy's true division of x by y_scale gives, which is ONNX's reference evaluator's rule: the common type of
  x and y_scale when both are floats (float32 for float16 with bfloat16 or with a float8e8m0 scale), float64 when
  either is int32. (ONNX's text for 23 says the scale's type sets the precision; where x is the wider float the
  reference, and kiln, divide in x's type.) A NaN, which ONNX leaves undefined for integer outputs, quantizes to the
  zero point. To float8 and float4 nothing is rounded before the cast (Cast's rounding to nearest even), and
  ``saturate`` (float8 only) clamps out-of-range values to the largest finite one instead of giving inf/NaN; the
  zero point is added as the formula says (ONNX's reference leaves a float8 one out: it is 0 in practice, and then
  the two agree);

Both are registered *not foldable*: on constant inputs DequantizeLinear would fold into the float weight it encodes,
several times larger, which undoes the quantization the moment a packed file is optimized again (``kiln.load``
optimizes, so the full runtime still dequantizes every run).

MatMulInteger and ConvInteger subtract the zero points and multiply exactly: the products of 8-bit values (at most
255 * 255) summed in float64 are exact integers for any reduction shorter than 2**37 terms, so the BLAS product (and
kiln's Conv, ir/ops/nn.py, run in float64) gives the integer result, which is then wrapped to int32 as ONNX's int32
accumulator would ("the accumulation may overflow if and only if in 32 bits").
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import FLOAT8_TYPES, INT_TYPES, DType
from kiln.ir.dtypes import dtype as as_dtype
from kiln.ir.ops._common import FLOAT
from kiln.ir.ops._dims import check_axis, scalar_input
from kiln.ir.ops.logic import cast_array
from kiln.ir.ops.nn import _CONV_ATTRS, check_conv_shapes, conv, conv_output_shape
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import Dim, TensorType, broadcast_shapes, dims_compatible

# The quantized types of Quantize/DequantizeLinear (T3 / T1): the integers (8 and 16 bits, and the 4- and 2-bit
# storage types of kiln.ir.dtypes), which saturate to their range, and the float8 formats and float4e2m1, which are
# cast to. (ONNX also has float6, which kiln lacks.)
QINT_T = frozenset(t for t in INT_TYPES if t.itemsize <= 2) | {DType.INT4, DType.UINT4, DType.INT2, DType.UINT2}
Q_T = QINT_T | FLOAT8_TYPES | {DType.FLOAT4E2M1}
# DequantizeLinear's x: those and int32 (a bias quantized with scale = x_scale * w_scale, no zero point).
QUANT_T = Q_T | {DType.INT32}
# float32 scales, and (opset 19's) half ones: y is the scale's type. Weight-only int8 on the GPU (issue 18)
# keeps a half model's weights as int8 with half scales, so y feeds a half MatMul without a Cast.
SCALE_T = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})
# DequantizeLinear-24's x_scale: float8e8m0 too (a power of two: the MX formats' shared scale).
DQ_SCALE_T = SCALE_T | {DType.FLOAT8E8M0}
# QuantizeLinear's x (T1) and, from version 23, its y_scale (T2): the float types and int32 (and float8e8m0, 24).
QX_T = SCALE_T | {DType.INT32}
Q_SCALE_T = QX_T | {DType.FLOAT8E8M0}
# The saturation range of each integer type (ml_dtypes' iinfo for the sub-byte ones).
_SUB_BYTE_RANGE = {DType.INT4: (-8, 7), DType.UINT4: (0, 15), DType.INT2: (-2, 1), DType.UINT2: (0, 3)}


def _int_range(dt: DType) -> tuple:
    if dt in _SUB_BYTE_RANGE:
        return _SUB_BYTE_RANGE[dt]
    info = np.iinfo(dt.numpy)
    return int(info.min), int(info.max)


def _is_per_tensor(shape: tuple) -> bool:
    """A scale of shape () or [1] applies to the whole tensor (ONNX's reference does the same)."""
    return len(shape) == 0 or (len(shape) == 1 and shape[0] == 1)


def _dtype_attr(ctx: InferContext, name: str, allowed: frozenset) -> Optional[DType]:
    """The dtype an INT attribute names (None when it is 0, unset); it must be one of ``allowed``."""
    code = ctx.attrs[name]
    if not code:
        return None
    try:
        dt = DType(code)
    except ValueError:
        dt = None
    if dt not in allowed:
        ctx.fail(f"{name}={code} is not one of the types kiln's {ctx.schema.name} takes there "
                 f"({', '.join(f'{d.value} ({d})' for d in sorted(allowed, key=lambda d: d.value))})")
    return dt


def _check_scale(ctx: InferContext, scale_name: str, zp_name: str) -> None:
    """The rules Quantize/DequantizeLinear share on x (input 0), the scale (input 1) and the zero point (input 2):
    the zero point has the scale's shape (a scalar and a 1-element vector are both per-tensor, as ONNX's own
    tests mix them); the scale is per-tensor, per-axis (1-D, as long as x along ``axis``) or,
    with ``block_size`` > 0, blocked (x's shape, except ceil(D / block_size) along ``axis``)."""
    x, s = ctx.input(0), ctx.input(1).shape
    block = ctx.attrs["block_size"]
    if block < 0:
        ctx.fail(f"block_size must be >= 0 (0: per-tensor or per-axis), got {block}")
    if ctx.has_input(2):
        zp = ctx.input(2)
        if zp.shape is not None and s is not None and not (_is_per_tensor(zp.shape) and _is_per_tensor(s)) and (
                len(zp.shape) != len(s) or not all(dims_compatible(a, b) for a, b in zip(zp.shape, s))):
            ctx.fail(f"{zp_name} has shape {list(zp.shape)} but {scale_name} has {list(s)}; they must match")
    if s is None or _is_per_tensor(s):
        return
    if not block:
        if len(s) > 1:
            ctx.fail(f"{scale_name} must be a scalar or 1-D (per-tensor or per-axis) without block_size, got shape "
                     f"{list(s)}")
        if x.shape is not None:
            axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
            if not dims_compatible(s[0], x.shape[axis]):
                ctx.fail(f"per-axis {scale_name} has {s[0]} elements but x has {x.shape[axis]} along axis {axis} "
                         f"(shape {list(x.shape)})")
        return
    if x.shape is None:
        return
    if len(s) != len(x.shape):
        ctx.fail(f"blocked {scale_name} must have x's rank {len(x.shape)}, got shape {list(s)}")
    axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
    for i, (a, b) in enumerate(zip(s, x.shape)):
        if i == axis:
            if isinstance(a, int) and isinstance(b, int) and a != -(-b // block):
                ctx.fail(f"blocked {scale_name} has {a} blocks along axis {axis}, but x's {b} elements in blocks "
                         f"of {block} make {-(-b // block)}")
        elif not dims_compatible(a, b):
            ctx.fail(f"blocked {scale_name} of shape {list(s)} must match x {list(x.shape)} except along axis "
                     f"{axis}")


def _spread(v: np.ndarray, shape: tuple, axis: int, block: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against x of ``shape``: per-tensor as a scalar, per-axis along
    ``axis``, blocked repeated ``block`` times along ``axis`` (the last block cut to x's length)."""
    if _is_per_tensor(v.shape):
        return v.reshape(())
    if block:
        return np.repeat(v, block, axis=axis)[(slice(None),) * axis + (slice(0, shape[axis]),)]
    dims = [1] * len(shape)
    dims[axis] = v.size
    return v.reshape(dims)


# --------------------------------------------------------------------------- DequantizeLinear


def infer_dequantize_linear(ctx: InferContext) -> TensorType:
    x, scale = ctx.input(0), ctx.input(1)
    if ctx.has_input(2) and ctx.input(2).dtype is not x.dtype:
        ctx.fail(f"x_zero_point is {ctx.input(2).dtype} but x is {x.dtype}; they must match")
    out = _dtype_attr(ctx, "output_dtype", SCALE_T)
    if out is None and scale.dtype not in SCALE_T:
        ctx.fail(f"x_scale is {scale.dtype}, so output_dtype must say the output type (float32, float16 or bfloat16)")
    _check_scale(ctx, "x_scale", "x_zero_point")
    return TensorType(out or scale.dtype, x.shape)


@op("DequantizeLinear",
    inputs=[In("x", QUANT_T), In("x_scale", DQ_SCALE_T), In("x_zero_point", QUANT_T, optional=True)],
    outputs=[Out("y", SCALE_T)],
    attrs=[Attr("axis", AttrKind.INT, 1), Attr("block_size", AttrKind.INT, 0), Attr("output_dtype", AttrKind.INT, 0)],
    infer=infer_dequantize_linear, foldable=False)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    """y = (x - x_zero_point) * x_scale, computed in float32 and rounded once to ``output_dtype`` or the scale's
    type; per-tensor, per-axis or blocked (module docstring). The subtraction is done in float32, as ONNX's
    reference does (exact for 8- and 16-bit x and the storage types)."""
    axis = axis + x.ndim if axis < 0 else axis
    y = x.astype(np.float32)
    if x_zero_point is not None:
        y = y - _spread(x_zero_point, x.shape, axis, block_size).astype(np.float32)
    y = y * _spread(x_scale.astype(np.float32, copy=False), x.shape, axis, block_size)
    return y.astype(DType(output_dtype).numpy if output_dtype else x_scale.dtype, copy=False)


# --------------------------------------------------------------------------- QuantizeLinear


def division_dtype(x: DType, scale: DType, precision: int = 0) -> DType:
    """The type QuantizeLinear divides x by y_scale in (module docstring): ``precision``'s when set, else numpy's
    true division's: the common float type, float64 when either is int32."""
    if precision:
        return DType(precision)
    if x is scale and x.is_float:
        return x
    if x.is_float and (scale.is_float or scale is DType.FLOAT8E8M0):
        return DType.FLOAT32  # the types here: float32 with a half type, float16 with bfloat16, float8e8m0
    return DType.FLOAT64


def _infer_quantize_linear(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    out = _dtype_attr(ctx, "output_dtype", Q_T)
    if ctx.has_input(2):
        zp = ctx.input(2).dtype
        if out is not None and zp is not out:
            ctx.fail(f"output_dtype is {out} but y_zero_point is {zp}; they must match (the zero point's type is "
                     f"the output's)")
        out = zp
    _dtype_attr(ctx, "precision", FLOAT)
    _check_scale(ctx, "y_scale", "y_zero_point")
    return TensorType(out or DType.UINT8, x.shape)


@op("QuantizeLinear",
    inputs=[In("x", QX_T), In("y_scale", Q_SCALE_T), In("y_zero_point", Q_T, optional=True)],
    outputs=[Out("y", Q_T)],
    attrs=[Attr("axis", AttrKind.INT, 1), Attr("saturate", AttrKind.INT, 1), Attr("block_size", AttrKind.INT, 0),
           Attr("output_dtype", AttrKind.INT, 0), Attr("precision", AttrKind.INT, 0)],
    infer=_infer_quantize_linear, foldable=False)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    """y = saturate(round_half_even(x / y_scale) + y_zero_point) into ``output_dtype``, the zero point's type or
    uint8; per-tensor, per-axis or blocked; the division in ``division_dtype`` (module docstring). To a float8 or
    float4 type, x / y_scale + y_zero_point is cast (Cast's rounding; float8 ``saturate``)."""
    axis = axis + x.ndim if axis < 0 else axis
    out = as_dtype(y_zero_point.dtype) if y_zero_point is not None else (DType(output_dtype) if output_dtype else
                                                                          DType.UINT8)
    div = division_dtype(as_dtype(x.dtype), as_dtype(y_scale.dtype), precision).numpy
    scale = _spread(y_scale, x.shape, axis, block_size).astype(div, copy=False)
    zp = None if y_zero_point is None else _spread(y_zero_point, x.shape, axis, block_size)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = x.astype(div, copy=False) / scale
        if out not in QINT_T:  # float8 / float4: the cast rounds. ONNX's reference adds a float4 zero point (-0
            # becomes 0) and leaves a float8 one out (0 in practice, which the formula then agrees with)
            if zp is not None and (out is DType.FLOAT4E2M1 or np.any(zp.astype(np.float32))):
                q = q + zp.astype(q.dtype)
            return cast_array(q, out, saturate)
        q = np.rint(q).astype(np.float64, copy=False)
    q = np.where(np.isnan(q), 0.0, q)
    if zp is not None:
        q = q + zp.astype(np.float64)
    lo, hi = _int_range(out)
    return np.clip(q, lo, hi).astype(out.numpy)


# --------------------------------------------------------------------------- DynamicQuantizeLinear, QLinearMatMul


def _infer_dynamic_quantize(ctx: InferContext):
    x = ctx.input(0)
    if x.dtype is not DType.FLOAT32:
        ctx.fail(f"x must be float32, not {x.dtype}")
    return [TensorType(DType.UINT8, x.shape), TensorType(DType.FLOAT32, ()), TensorType(DType.UINT8, ())]


@op("DynamicQuantizeLinear", inputs=[In("x", {DType.FLOAT32})],
    outputs=["y", Out("y_scale", {DType.FLOAT32}), Out("y_zero_point", {DType.UINT8})],
    infer=_infer_dynamic_quantize, foldable=False)
def dynamic_quantize_linear(x):
    """uint8 quantization of x over the range [min(0, min x), max(0, max x)] (ONNX's rules: float32 arithmetic,
    the zero point and the values rounded half to even, saturated to 0..255; an all-zero x gets scale 1/255)."""
    hi = np.float32(max(0.0, float(x.max()))) if x.size else np.float32(0)
    lo = np.float32(min(0.0, float(x.min()))) if x.size else np.float32(0)
    scale = np.float32(1.0 if hi == lo else hi - lo) / np.float32(255)
    zero = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.uint8)
    return y, np.array(scale, np.float32), np.array(zero, np.uint8)


_Q8 = frozenset({DType.INT8, DType.UINT8})


def _infer_qlinear_matmul(ctx: InferContext) -> TensorType:
    a, b = ctx.input(0), ctx.input(3)
    for i, name in ((2, "a_zero_point"), (5, "b_zero_point"), (7, "y_zero_point")):
        zp = ctx.input(i)
        owner = (a, b, None)[(i - 2) // 3] if i != 7 else None
        if owner is not None and zp.dtype is not owner.dtype:
            ctx.fail(f"{name} is {zp.dtype} but its tensor is {owner.dtype}")
    a_shape, b_shape = a.shape, b.shape
    if a_shape is None or b_shape is None:
        return TensorType(ctx.input(7).dtype, None)
    if len(a_shape) < 2 or len(b_shape) < 2:
        ctx.fail(f"a and b must have rank >= 2 (matrices or stacks), not {list(a_shape)} and {list(b_shape)}")
    if not dims_compatible(a_shape[-1], b_shape[-2]):
        ctx.fail(f"a {list(a_shape)} and b {list(b_shape)}: inner dims differ")
    try:
        batch = broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    except ValueError as e:
        ctx.fail(str(e))
    return TensorType(ctx.input(7).dtype, (*batch, a_shape[-2], b_shape[-1]))


@op("QLinearMatMul",
    inputs=[In("a", _Q8), In("a_scale", SCALE_T), In("a_zero_point", _Q8), In("b", _Q8), In("b_scale", SCALE_T),
            In("b_zero_point", _Q8), In("y_scale", SCALE_T), In("y_zero_point", _Q8)],
    outputs=["y"], infer=_infer_qlinear_matmul, foldable=False)
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    """y = saturate(round((a - a_zp) @ (b - b_zp) * a_scale * b_scale / y_scale) + y_zp), the product exact in
    int64, the rescale in float64 (rounded half to even). A 1-D a_scale/a_zero_point is per row of a, a 1-D
    b_scale/b_zero_point per column of b (ONNX's per-row / per-column quantization)."""
    def rows(v):  # per-row of a: [M] -> [M, 1]
        v = np.asarray(v)
        return v.reshape(-1, 1) if v.ndim == 1 and v.size > 1 else v.reshape(())

    def cols(v):  # per-column of b: [N] -> [1, N] (broadcasts over rows)
        v = np.asarray(v)
        return v.reshape(1, -1) if v.ndim == 1 and v.size > 1 else v.reshape(())
    acc = np.matmul(a.astype(np.int64) - rows(a_zero_point).astype(np.int64),
                    b.astype(np.int64) - cols(b_zero_point).astype(np.int64))
    scale = rows(a_scale).astype(np.float64) * cols(b_scale).astype(np.float64) / np.asarray(y_scale, np.float64)
    info = np.iinfo(y_zero_point.dtype)
    y = np.rint(acc * scale) + np.asarray(y_zero_point).astype(np.float64)
    return np.clip(y, info.min, info.max).astype(y_zero_point.dtype)


# --------------------------------------------------------------------------- MatMulInteger


def _wrap_int32(acc: np.ndarray) -> np.ndarray:
    """An exact integer result held in float64, as ONNX's int32 accumulator leaves it (wrapping past int32)."""
    return acc.astype(np.int64).astype(np.int32)


def _matmul_shape(ctx: InferContext, a: tuple, b: tuple) -> list:
    """numpy.matmul's output shape for A and B (a 1-D A is a row, a 1-D B a column, the added dim dropped)."""
    if len(a) == 0 or len(b) == 0:
        ctx.fail("A and B must have rank >= 1, got a scalar")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if not dims_compatible(a2[-1], b2[-2]):
        ctx.fail(f"inner dims differ: A{list(a)} has K={a2[-1]}, B{list(b)} has K={b2[-2]}")
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError as e:
        ctx.fail(f"batch dims {list(a2[:-2])} and {list(b2[:-2])} do not broadcast ({e})")
    return list(batch) + ([a2[-2]] if len(a) > 1 else []) + ([b2[-1]] if len(b) > 1 else [])


def _check_matmul_zero_point(ctx: InferContext, i: int, name: str, owner: tuple, per_row: bool) -> None:
    """A MatMulInteger zero point: a scalar (per tensor), a vector (per row of A [M] / per column of B [N]), or an
    N-D tensor broadcasting against its operand with a 1 along the contracted dim."""
    s = ctx.input(i).shape
    if s is None or owner is None or _is_per_tensor(s):
        return
    rows, what = (-2, "rows") if per_row else (-1, "columns")
    if len(owner) < 2:
        ctx.fail(f"{name} of shape {list(s)}: a 1-D operand takes a scalar zero point only")
    if len(s) == 1:
        if not dims_compatible(s[0], owner[rows]):
            ctx.fail(f"{name} has {s[0]} elements but its operand {list(owner)} has {owner[rows]} {what}")
        return
    contracted = -1 if per_row else -2
    if len(s) != len(owner) or s[contracted] != 1:
        ctx.fail(f"an N-D {name} must have its operand's rank {len(owner)} and a 1 along the contracted dim, got "
                 f"{list(s)} for {list(owner)}")
    try:
        if broadcast_shapes(s, owner) != tuple(owner):
            raise ValueError("it would change the operand's shape")
    except ValueError as e:
        ctx.fail(f"{name} of shape {list(s)} does not broadcast against its operand {list(owner)} ({e})")


def _infer_matmul_integer(ctx: InferContext) -> TensorType:
    a, b = ctx.input(0), ctx.input(1)
    for i, name, owner in ((2, "a_zero_point", a), (3, "b_zero_point", b)):
        if ctx.has_input(i) and ctx.input(i).dtype is not owner.dtype:
            ctx.fail(f"{name} is {ctx.input(i).dtype} but its tensor is {owner.dtype}; they must match")
    for i, name, owner, per_row in ((2, "a_zero_point", a, True), (3, "b_zero_point", b, False)):
        if ctx.has_input(i):
            _check_matmul_zero_point(ctx, i, name, owner.shape, per_row)
    if a.shape is None or b.shape is None:
        return TensorType(DType.INT32, None)
    return TensorType(DType.INT32, _matmul_shape(ctx, a.shape, b.shape))



def _centered(v: np.ndarray, zero_point: Optional[np.ndarray], per_row: bool = False) -> np.ndarray:
    """v - zero_point in float64 (exact); a vector zero point of a matrix is per row (A) or per column (B)."""
    out = v.astype(np.float64)
    if zero_point is None:
        return out
    zp = zero_point.astype(np.float64)
    if per_row and zp.ndim == 1 and zp.size > 1:
        zp = zp.reshape(-1, 1)
    return out - zp


@op("MatMulInteger",
    inputs=[In("A", _Q8), In("B", _Q8), In("a_zero_point", _Q8, optional=True), In("b_zero_point", _Q8, optional=True)],
    outputs=[Out("Y", {DType.INT32})], infer=_infer_matmul_integer)
def matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    """(A - a_zero_point) @ (B - b_zero_point) as int32, numpy.matmul's broadcasting; exact (module docstring).
    A vector a_zero_point is per row of A, a vector b_zero_point per column of B."""
    return _wrap_int32(np.matmul(_centered(a, a_zero_point, per_row=True), _centered(b, b_zero_point)))


# --------------------------------------------------------------------------- ConvInteger, QLinearConv


def _conv_shape(ctx: InferContext, xi: int, wi: int, dtype: DType) -> TensorType:
    """The output of a Conv of x (input ``xi``) by w (input ``wi``): Conv's rules (ir/ops/nn.py)."""
    xs, ws = ctx.input(xi).shape, ctx.input(wi).shape
    check_conv_shapes(ctx, xs, ws, names=("x", "w"))
    if xs is None:
        return TensorType(dtype, None)
    return TensorType(dtype, conv_output_shape(ctx, xs, ws, names=("x", "w")))


def _out_channels(ctx: InferContext, wi: int) -> Dim:
    ws = ctx.input(wi).shape
    return ws[0] if ws is not None else None


def _check_per_channel(ctx: InferContext, i: int, name: str, m: Dim) -> None:
    """A scalar (per tensor) or a vector of one entry per output channel."""
    s = ctx.input(i).shape
    if s is not None and not _is_per_tensor(s) and (len(s) != 1 or not dims_compatible(s[0], m)):
        ctx.fail(f"{name} must be a scalar or have one element per output channel ({m}), got shape {list(s)}")


def _infer_conv_integer(ctx: InferContext) -> TensorType:
    x, w = ctx.input(0), ctx.input(1)
    if ctx.has_input(2):
        if ctx.input(2).dtype is not x.dtype:
            ctx.fail(f"x_zero_point is {ctx.input(2).dtype} but x is {x.dtype}; they must match")
        scalar_input(ctx, 2, "x_zero_point")
    if ctx.has_input(3):
        if ctx.input(3).dtype is not w.dtype:
            ctx.fail(f"w_zero_point is {ctx.input(3).dtype} but w is {w.dtype}; they must match")
        _check_per_channel(ctx, 3, "w_zero_point", _out_channels(ctx, 1))
    return _conv_shape(ctx, 0, 1, DType.INT32)


def _per_channel(v: np.ndarray, rank: int) -> np.ndarray:
    """A scalar, or a per-output-channel vector shaped to broadcast against [N or M, M or C, *spatial]."""
    return v.reshape(()) if _is_per_tensor(v.shape) else v.reshape((-1,) + (1,) * (rank - 1))


def _integer_conv(x, w, x_zero_point, w_zero_point, attrs: dict) -> np.ndarray:
    """The exact integer convolution of (x - x_zero_point) by (w - w_zero_point), in float64 (module docstring)."""
    xf = x.astype(np.float64)
    if x_zero_point is not None:
        xf = xf - x_zero_point.astype(np.float64).reshape(())
    wf = w.astype(np.float64)
    if w_zero_point is not None:
        wf = wf - _per_channel(w_zero_point.astype(np.float64), w.ndim)
    return conv(xf, wf, None, **attrs)


@op("ConvInteger",
    inputs=[In("x", _Q8), In("w", _Q8), In("x_zero_point", _Q8, optional=True),
            In("w_zero_point", _Q8, optional=True)],
    outputs=[Out("y", {DType.INT32})], attrs=_CONV_ATTRS, infer=_infer_conv_integer)
def conv_integer(x, w, x_zero_point=None, w_zero_point=None, *, auto_pad, dilations, group, kernel_shape, pads,
                 strides):
    """Conv (ir/ops/nn.py: padding, strides, dilations, groups) of (x - x_zero_point) by (w - w_zero_point) as int32,
    exact (module docstring); x_zero_point is per tensor, w_zero_point per tensor or per output channel. Padding
    adds zeros to x - x_zero_point (as ONNX's reference)."""
    return _wrap_int32(_integer_conv(x, w, x_zero_point, w_zero_point, dict(
        auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape, pads=pads, strides=strides)))


def _infer_qlinear_conv(ctx: InferContext) -> TensorType:
    x, w, y_zp = ctx.input(0), ctx.input(3), ctx.input(7)
    for i, name, owner in ((2, "x_zero_point", x), (5, "w_zero_point", w)):
        if ctx.input(i).dtype is not owner.dtype:
            ctx.fail(f"{name} is {ctx.input(i).dtype} but its tensor is {owner.dtype}; they must match")
    for i, name in ((1, "x_scale"), (2, "x_zero_point"), (6, "y_scale"), (7, "y_zero_point")):
        scalar_input(ctx, i, name)
    m = _out_channels(ctx, 3)
    _check_per_channel(ctx, 4, "w_scale", m)
    _check_per_channel(ctx, 5, "w_zero_point", m)
    if ctx.has_input(8):
        b = ctx.input(8).shape
        if b is not None and (len(b) != 1 or not dims_compatible(b[0], m)):
            ctx.fail(f"bias B must have shape [{m}] (one int32 value per output channel), got {list(b)}")
    return _conv_shape(ctx, 0, 3, y_zp.dtype)


@op("QLinearConv",
    inputs=[In("x", _Q8), In("x_scale", {DType.FLOAT32}), In("x_zero_point", _Q8), In("w", _Q8),
            In("w_scale", {DType.FLOAT32}), In("w_zero_point", _Q8), In("y_scale", {DType.FLOAT32}),
            In("y_zero_point", _Q8), In("B", {DType.INT32}, optional=True)],
    outputs=["y"], attrs=_CONV_ATTRS, infer=_infer_qlinear_conv)
def qlinear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, b=None, *, auto_pad,
                 dilations, group, kernel_shape, pads, strides):
    """y = saturate(round_half_even(acc * (x_scale * w_scale / y_scale) + y_zero_point)), acc the exact int32
    ConvInteger of x and w plus B. As ONNX's reference evaluator: the multiplier in float32 (per output channel
    for a vector w_scale), the product with acc and the zero point's addition in float64."""
    acc = _integer_conv(x, w, x_zero_point, w_zero_point, dict(
        auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape, pads=pads, strides=strides))
    if b is not None:
        acc = acc + b.astype(np.float64).reshape((-1,) + (1,) * (x.ndim - 2))
    multiplier = (np.float32(x_scale.reshape(())) * _per_channel(w_scale, x.ndim - 1).astype(np.float32)
                  / np.float32(y_scale.reshape(())))
    r = _wrap_int32(acc).astype(np.float64) * multiplier.astype(np.float64) + np.float64(y_zero_point.reshape(()))
    info = np.iinfo(y_zero_point.dtype)
    return np.rint(np.clip(r, info.min, info.max)).astype(y_zero_point.dtype)
