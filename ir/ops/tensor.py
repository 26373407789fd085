"""Tensor-creation ops: Identity, Constant, ConstantOfShape, EyeLike, Range (Range-27), Dropout (ONNX opset 18;
inference only: training mode is exact only with ratio 0).

Cast lives in ``logic.py``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kiln.errors import KilnError, UnsupportedOpError
from kiln.ir.dtypes import ANY_TYPES as ANY
from kiln.ir.dtypes import DType
from kiln.ir.dtypes import dtype as as_dtype
from kiln.ir.ops._common import ALL, BOOL, FLOAT, infer_same
from kiln.ir.ops._dims import INT64, same_values, scalar_input, unknown_dims
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType


@op("Identity", inputs=[In("input", ANY)], outputs=["output"], infer=infer_same, propagate=same_values(infer_same))
def identity(x):
    return x


# --------------------------------------------------------------------------- Constant

_CONSTANT_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints")


def _constant_array(attrs: dict) -> np.ndarray:
    """The tensor a Constant node holds; exactly one of its value attributes must be set."""
    given = [k for k in _CONSTANT_ATTRS if attrs.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"exactly one of {', '.join(_CONSTANT_ATTRS)} must be set, got {given or 'none'}")
    key = given[0]
    v = attrs[key]
    if key == "value":
        return np.asarray(v)
    # value_float(s) are float32 and value_int(s) int64, as in ONNX.
    return np.asarray(v, dtype=np.float32 if key.startswith("value_float") else np.int64)


def _infer_constant(ctx: InferContext) -> TensorType:
    try:
        return TensorType.of(_constant_array(ctx.attrs))
    except (ValueError, KilnError) as e:
        ctx.fail(str(e))


def _propagate_constant(ctx: InferContext) -> Optional[tuple]:
    arr = _constant_array(ctx.attrs)
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        return None
    return tuple(int(v) for v in arr.reshape(-1))


@op("Constant", inputs=[], outputs=["output"],
    attrs=[Attr("value", AttrKind.TENSOR, None), Attr("value_float", AttrKind.FLOAT, None),
           Attr("value_floats", AttrKind.FLOATS, None), Attr("value_int", AttrKind.INT, None),
           Attr("value_ints", AttrKind.INTS, None)],
    infer=_infer_constant, propagate=_propagate_constant)
def constant(**attrs):
    return _constant_array(attrs)


# --------------------------------------------------------------------------- ConstantOfShape


def _fill_value(value: Optional[np.ndarray]) -> np.ndarray:
    """The 1-element fill tensor; ONNX's default is float32 0."""
    return np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)


def _infer_constant_of_shape(ctx: InferContext) -> TensorType:
    value = _fill_value(ctx.attrs["value"])
    if value.size != 1:
        ctx.fail(f"value must hold exactly one element, got {value.size}")
    dtype = TensorType.of(value).dtype
    dims = ctx.symbolic(0)
    if dims is None:
        return TensorType(dtype, unknown_dims(ctx, 0))
    if any(isinstance(d, int) and d < 0 for d in dims):
        ctx.fail(f"shape {list(dims)} has a negative dim")
    return TensorType(dtype, dims)


@op("ConstantOfShape", inputs=[In("input", INT64, rank=1)], outputs=["output"],
    attrs=[Attr("value", AttrKind.TENSOR, None)], infer=_infer_constant_of_shape)
def constant_of_shape(shape, *, value=None):
    fill = _fill_value(value)
    return np.full([int(d) for d in shape], fill[0], dtype=fill.dtype)


# --------------------------------------------------------------------------- EyeLike


def _eye_dtype(code: Optional[int], like: DType) -> DType:
    """The output dtype: ONNX TensorProto code ``code``, else the input's; ValueError if kiln lacks it."""
    if code is None:
        return like
    try:
        return DType(int(code))
    except ValueError:
        known = ", ".join(f"{d.value} ({d})" for d in DType)
        raise ValueError(f"dtype={code} is not a dtype kiln supports; known codes: {known}") from None


def _infer_eye_like(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) != 2:
        ctx.fail(f"input must be a 2-D tensor, got {x}")
    try:
        dtype = _eye_dtype(ctx.attrs["dtype"], x.dtype)
    except ValueError as e:
        ctx.fail(str(e))
    return TensorType(dtype, (None, None) if x.shape is None else x.shape)


@op("EyeLike", inputs=[In("input", ALL, rank=2)], outputs=["output"],
    attrs=[Attr("dtype", AttrKind.INT, None), Attr("k", AttrKind.INT, 0)], infer=_infer_eye_like)
def eye_like(x, *, dtype=None, k=0):
    """A matrix of the input's shape (its values are not read) with ones on diagonal k (k > 0 above
    the main one, k < 0 below) and zeros elsewhere, of dtype ``dtype`` (default: the input's)."""
    if x.ndim != 2:
        raise ValueError(f"EyeLike takes a 2-D input, got shape {list(x.shape)}")
    target = x.dtype if dtype is None else _eye_dtype(dtype, DType.FLOAT32).numpy
    return np.eye(x.shape[0], x.shape[1], k=int(k), dtype=target)


# --------------------------------------------------------------------------- Range

_RANGE_TYPES = frozenset({DType.FLOAT32, DType.FLOAT64, DType.INT16, DType.INT32, DType.INT64, DType.FLOAT16,
                          DType.BFLOAT16})
_HALF = frozenset({DType.FLOAT16, DType.BFLOAT16})
# Range-27's stash_type (a TensorProto code): the type a float16/bfloat16 range is computed in.
_STASH_TYPES = {DType.FLOAT32.value: np.float32, DType.FLOAT64.value: np.float64}


def range_length(start: float, limit: float, delta: float) -> int:
    """ONNX: max(ceil((limit - start) / delta), 0); exact integer arithmetic for ints."""
    if delta == 0:
        raise ValueError("delta must not be 0")
    if all(isinstance(v, int) for v in (start, limit, delta)):
        return max(-((start - limit) // delta), 0)
    return max(math.ceil((limit - start) / delta), 0)


def _range_dim(ctx: InferContext, dtype: DType):
    """The output length from constant inputs; Range(0, n, 1) keeps a symbolic n."""
    if dtype.is_int:
        vals = [ctx.symbolic(i) for i in range(3)]
        if any(v is None for v in vals):
            return None
        start, limit, delta = (v[0] for v in vals)
        if start == 0 and delta == 1 and isinstance(limit, str):
            return limit
        if not all(isinstance(v, int) for v in (start, limit, delta)):
            return None
    else:
        consts = [ctx.const(i) for i in range(3)]
        if any(c is None for c in consts):
            return None
        start, limit, delta = (float(c.reshape(-1)[0]) for c in consts)
    if delta == 0:
        ctx.fail("delta must not be 0")
    return range_length(start, limit, delta)


def _infer_range(ctx: InferContext) -> TensorType:
    types = [scalar_input(ctx, i, name) for i, name in enumerate(("start", "limit", "delta"))]
    dtype = types[0].dtype
    if any(t.dtype is not dtype for t in types):
        ctx.fail(f"start, limit and delta must share a dtype, got {', '.join(str(t.dtype) for t in types)}")
    stash = ctx.attrs["stash_type"]
    if dtype in _HALF and stash not in _STASH_TYPES:
        ctx.fail(f"stash_type {stash} is not 1 (float) or 11 (double), the types a {dtype} range is computed in")
    return TensorType(dtype, (_range_dim(ctx, dtype),))


@op("Range", inputs=[In("start", _RANGE_TYPES, max_elements=1), In("limit", _RANGE_TYPES, max_elements=1),
                    In("delta", _RANGE_TYPES, max_elements=1)],
    outputs=["output"], attrs=[Attr("stash_type", AttrKind.INT, DType.FLOAT32.value)], infer=_infer_range)
def range_(start, limit, delta, *, stash_type=DType.FLOAT32.value):
    """Range-27: start + i * delta for i in [0, max(ceil((limit - start) / delta), 0)). Integers exactly;
    float and double as ONNX's reference computes them (in double, then rounded). float16/bfloat16 (new in 27)
    are computed in stash_type (float by default, or double) and rounded once: start cast to it, the steps
    taken there (numpy's arange in that type, as ONNX's reference does), the result cast back. stash_type has
    no effect on the other types, so Range-11 is this op on its types."""
    dtype = np.asarray(start).dtype
    if dtype.kind in "iu":
        s, lim, d = (int(np.asarray(v).reshape(-1)[0]) for v in (start, limit, delta))
        return (s + np.arange(range_length(s, lim, d), dtype=np.int64) * d).astype(dtype)
    s, lim, d = (float(np.asarray(v).reshape(-1)[0]) for v in (start, limit, delta))
    if as_dtype(dtype) in _HALF:
        work = _STASH_TYPES.get(int(stash_type))
        if work is None:
            raise ValueError(f"stash_type {stash_type} is not 1 (float) or 11 (double)")
        range_length(s, lim, d)  # delta 0 is an error, not numpy's ZeroDivisionError
        first = np.asarray(start).reshape(-1)[0].astype(work).item()
        return np.arange(first, lim, d, dtype=work).astype(dtype)
    return (s + np.arange(range_length(s, lim, d), dtype=np.float64) * d).astype(dtype)


# --------------------------------------------------------------------------- Dropout


def dropout_ratio(ratio: Optional[np.ndarray]) -> float:
    """The drop probability: ONNX's default 0.5 when the ratio input is omitted."""
    return 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])


def _infer_dropout(ctx: InferContext) -> list[TensorType]:
    x = ctx.input(0)
    if ctx.has_input(1):
        scalar_input(ctx, 1, "ratio")
    if ctx.has_input(2):
        scalar_input(ctx, 2, "training_mode")
        mode = ctx.const(2)
        ratio = ctx.const(1) if ctx.has_input(1) else None
        ratio_known = ratio is not None or not ctx.has_input(1)  # a computed ratio is checked at run time
        if mode is not None and bool(mode.reshape(-1)[0]) and ratio_known and dropout_ratio(ratio) != 0:
            ctx.fail(f"training_mode=True with ratio {dropout_ratio(ratio)} is not supported: kiln runs Dropout for "
                     f"inference only (training mode is exact only with ratio 0, where it is the identity)")
    mask = TensorType(DType.BOOL, x.shape)
    return [x, mask][:ctx.num_outputs]


@op("Dropout", inputs=[In("data", FLOAT), In("ratio", FLOAT, optional=True, max_elements=1),
                     In("training_mode", BOOL, optional=True, max_elements=1)],
    outputs=["output", In("mask", BOOL, optional=True)], attrs=[Attr("seed", AttrKind.INT, None)],
    infer=_infer_dropout)
def dropout(data, ratio=None, training_mode=None, *, seed=None):
    """The identity and an all-true mask: Dropout outside training, and in training with ratio 0 (nothing
    dropped, the scale 1 / (1 - 0) is 1). Training with another ratio draws random numbers no other runtime
    reproduces: refused when the run meets it (training_mode may be computed, so it is checked here)."""
    if training_mode is not None and bool(np.asarray(training_mode).reshape(-1)[0]) and dropout_ratio(ratio) != 0:
        raise UnsupportedOpError(f"Dropout met training_mode=True with ratio {dropout_ratio(ratio)} at run time: kiln "
                                 f"runs Dropout for inference only (training mode is exact only with ratio 0, "
                                 f"where it is the identity)")
    return data, np.ones(data.shape, dtype=bool)
