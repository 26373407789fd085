"""Quantization: DequantizeLinear (ONNX opset-18 semantics).

kiln registers it so that a file whose weights are stored as int8 plus a scale (what
``kiln mobile pack --quantize int8`` writes, or a QDQ model imported from ONNX) runs in the full
runtime too, with the meaning ONNX gives it: ``y = (x - x_zero_point) * x_scale`` in float32.
A scalar (or 1-element) scale is per-tensor; a 1-D scale of ``x.shape[axis]`` elements is
per-axis (one scale and zero point per slice along ``axis``). Opset 19+ additions (float8
inputs, float16 scales, blocked quantization) are not part of kiln's op set.

The op is registered *not foldable*: on constant inputs it would fold into the float32 weight
it encodes, four times larger, which undoes the quantization the moment a packed file is
optimized again (``kiln.load`` optimizes, so the full runtime still dequantizes every run).
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._dims import check_axis
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType, dims_compatible

QUANT_T = frozenset({DType.INT8, DType.UINT8, DType.INT32})
# float32 scales, and (opset 19's) half ones: y is the scale's type. Weight-only int8 on the GPU (issue 18)
# keeps a half model's weights as int8 with half scales, so y feeds a half MatMul without a Cast.
SCALE_T = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})


def _is_per_tensor(shape: tuple) -> bool:
    """A scale of shape () or [1] applies to the whole tensor (ONNX's reference does the same)."""
    return len(shape) == 0 or (len(shape) == 1 and shape[0] == 1)


def _check_scale(ctx: InferContext, scale_name: str, zp_name: str) -> None:
    """The rules Quantize/DequantizeLinear share: a scalar or 1-D scale (input 1), a zero point (input 2) of its
    shape, and a per-axis scale as long as x (input 0) along ``axis``."""
    x, s = ctx.input(0), ctx.input(1).shape
    if s is not None and len(s) > 1:
        ctx.fail(f"{scale_name} must be a scalar or 1-D, got shape {list(s)}")
    if ctx.has_input(2):
        zp = ctx.input(2)
        if zp.shape is not None and s is not None and (
                len(zp.shape) != len(s) or not all(dims_compatible(a, b) for a, b in zip(zp.shape, s))):
            ctx.fail(f"{zp_name} has shape {list(zp.shape)} but {scale_name} has {list(s)}; they must match")
    if s is not None and x.shape is not None and not _is_per_tensor(s):
        axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
        if not dims_compatible(s[0], x.shape[axis]):
            ctx.fail(f"per-axis {scale_name} has {s[0]} elements but x has {x.shape[axis]} along axis {axis} "
                     f"(shape {list(x.shape)})")


def infer_dequantize_linear(ctx: InferContext) -> TensorType:
    x, scale = ctx.input(0), ctx.input(1)
    if ctx.has_input(2) and ctx.input(2).dtype is not x.dtype:
        ctx.fail(f"x_zero_point is {ctx.input(2).dtype} but x is {x.dtype}; they must match")
    _check_scale(ctx, "x_scale", "x_zero_point")
    return TensorType(scale.dtype if scale.dtype is not None else DType.FLOAT32, x.shape)


def _broadcastable(v: np.ndarray, rank: int, axis: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against x: as is when per-tensor, else along ``axis``."""
    if _is_per_tensor(v.shape):
        return v.reshape(())
    shape = [1] * rank
    shape[axis] = v.size
    return v.reshape(shape)


@op("DequantizeLinear",
    inputs=[In("x", QUANT_T), In("x_scale", SCALE_T, rank=(0, 1)), In("x_zero_point", QUANT_T, optional=True, rank=(0, 1))],
    outputs=[Out("y", SCALE_T)],
    attrs=[Attr("axis", AttrKind.INT, 1)],
    infer=infer_dequantize_linear, foldable=False)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis):
    """y = (x - x_zero_point) * x_scale, computed in float32 and given the scale's dtype (float32, or a
    half type: rounded once); per-tensor (scalar scale) or per-axis (1-D scale along ``axis``). The
    subtraction is done in float32, as ONNX's reference does (exact for 8-bit x)."""
    axis = axis + x.ndim if axis < 0 else axis
    y = x.astype(np.float32)
    if x_zero_point is not None:
        y = y - _broadcastable(x_zero_point, x.ndim, axis).astype(np.float32)
    return (y * _broadcastable(x_scale.astype(np.float32, copy=False), x.ndim, axis)).astype(x_scale.dtype,
                                                                                          copy=False)


# --------------------------------------------------------------------------- QuantizeLinear


def _infer_quantize_linear(ctx: InferContext) -> TensorType:
    x, scale = ctx.input(0), ctx.input(1)
    if scale.dtype is not x.dtype and not (x.dtype is DType.FLOAT32 and scale.dtype is DType.FLOAT32):
        ctx.fail(f"y_scale is {scale.dtype} but x is {x.dtype}; they must match")
    out = DType.UINT8
    if ctx.has_input(2):
        out = ctx.input(2).dtype
        if out not in (DType.INT8, DType.UINT8):
            ctx.fail(f"y_zero_point must be int8 or uint8 (the output type), not {out}")
    _check_scale(ctx, "y_scale", "y_zero_point")
    return TensorType(out, x.shape)


@op("QuantizeLinear",
    inputs=[In("x", SCALE_T | {DType.INT32}), In("y_scale", SCALE_T, rank=(0, 1)),
            In("y_zero_point", frozenset({DType.INT8, DType.UINT8}), optional=True, rank=(0, 1))],
    outputs=[Out("y", frozenset({DType.INT8, DType.UINT8}))],
    attrs=[Attr("axis", AttrKind.INT, 1), Attr("saturate", AttrKind.INT, 1)],
    infer=_infer_quantize_linear, foldable=False)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis, saturate=1):
    """y = saturate(round(x / y_scale) + y_zero_point) (ONNX QuantizeLinear at opset 18: rounding half to even,
    int8 or uint8 by the zero point's type, uint8 without one); per-tensor or per-axis along ``axis``.
    ``saturate`` concerns float8 outputs only, which kiln does not have."""
    axis = axis + x.ndim if axis < 0 else axis
    out = np.uint8 if y_zero_point is None else y_zero_point.dtype
    scale = _broadcastable(np.asarray(y_scale).astype(np.float32), x.ndim, axis)
    y = np.rint(x.astype(np.float32) / scale)
    if y_zero_point is not None:
        y = y + _broadcastable(y_zero_point, x.ndim, axis).astype(np.float32)
    info = np.iinfo(out)
    return np.clip(y, info.min, info.max).astype(out)


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
    from kiln.ir.types import broadcast_shapes
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
