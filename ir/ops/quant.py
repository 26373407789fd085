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


def infer_dequantize_linear(ctx: InferContext) -> TensorType:
    x, scale = ctx.input(0), ctx.input(1)
    s = scale.shape
    if s is not None and len(s) > 1:
        ctx.fail(f"x_scale must be a scalar or 1-D, got shape {list(s)}")
    if ctx.has_input(2):
        zp = ctx.input(2)
        if zp.dtype is not x.dtype:
            ctx.fail(f"x_zero_point is {zp.dtype} but x is {x.dtype}; they must match")
        if zp.shape is not None and s is not None and (
                len(zp.shape) != len(s) or not all(dims_compatible(a, b) for a, b in zip(zp.shape, s))):
            ctx.fail(f"x_zero_point has shape {list(zp.shape)} but x_scale has {list(s)}; they must match")
    if s is not None and x.shape is not None and not _is_per_tensor(s):
        axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
        if not dims_compatible(s[0], x.shape[axis]):
            ctx.fail(f"per-axis x_scale has {s[0]} elements but x has {x.shape[axis]} along axis {axis} "
                     f"(shape {list(x.shape)})")
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
