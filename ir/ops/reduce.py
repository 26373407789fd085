"""Reductions and their relatives (ONNX semantics at opset 18): ReduceSum/Mean/Max/Min/Prod/L2
(axes as an optional input; ReduceMax/ReduceMin-20 also on bool), ArgMax/ArgMin, TopK, CumSum and
CumProd (ai.onnx opset 26)."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, INDEX, NUMERIC, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType, normalize_axis

INT64 = frozenset({DType.INT64})
# ReduceMax/Min also take the 8-bit ints (MINMAX_T, the numeric types ArgMax/ArgMin share) and, from opset
# 20, bool (False < True: max is any, min is all).
REDUCE_T = FLOAT | frozenset({DType.INT32, DType.INT64, DType.UINT32, DType.UINT64})
MINMAX_T = REDUCE_T | frozenset({DType.INT8, DType.UINT8})
EXTREME_T = MINMAX_T | frozenset({DType.BOOL})


def _axis(ctx: InferContext, axis: int, rank: int) -> int:
    try:
        return normalize_axis(axis, rank)
    except ValueError as e:
        ctx.fail(str(e))


# --------------------------------------------------------------------------- Reduce*


def _known_axes(ctx: InferContext) -> Optional[tuple]:
    """The axes input as ints: () when omitted or empty, None when its values are unknown."""
    if not ctx.has_input(1):
        return ()
    shape = ctx.input(1).shape
    if shape is not None and len(shape) != 1:
        ctx.fail(f"axes must be a 1-D tensor, got shape {list(shape)}")
    if shape == (0,):
        return ()
    c = ctx.const(1)
    return None if c is None else tuple(int(a) for a in c.reshape(-1))


def _unknown_axes_type(ctx: InferContext, x: TensorType) -> TensorType:
    """Output type when the axes are a run-time value: the rank is known only when
    keepdims=1 or the number of axes is static; no dim is known."""
    rank = len(x.shape)
    n_axes = ctx.input(1).shape[0] if ctx.input(1).shape is not None else None
    if ctx.attrs["keepdims"]:
        return TensorType(x.dtype, [None] * rank)
    if isinstance(n_axes, int):
        return TensorType(x.dtype, [None] * (rank - n_axes))
    return TensorType(x.dtype, None)


def infer_reduce(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    axes = _known_axes(ctx)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if axes is None:
        return _unknown_axes_type(ctx, x)
    rank = len(x.shape)
    if not axes:
        if ctx.attrs["noop_with_empty_axes"]:
            return x
        axes = tuple(range(rank))
    normalized = [_axis(ctx, a, rank) for a in axes]
    if len(set(normalized)) != len(normalized):
        ctx.fail(f"axes {list(axes)} name the same axis twice")
    keep = ctx.attrs["keepdims"]
    out = [1 if i in normalized else d for i, d in enumerate(x.shape) if keep or i not in normalized]
    return TensorType(x.dtype, out)


def _reference_axes(x: np.ndarray, axes: Optional[np.ndarray], noop: int) -> Optional[tuple]:
    """The axes to reduce; None means the op is the identity (empty axes and noop set)."""
    if axes is None or axes.size == 0:
        return None if noop else tuple(range(x.ndim))
    return tuple(normalize_axis(int(a), x.ndim) for a in axes.reshape(-1))


def _float_acc(x: np.ndarray) -> np.ndarray:
    """Floats in their compute dtype; integers in float64 (ONNX computes then casts back)."""
    return x.astype(np.float64 if x.dtype.kind in "iu" else compute_dtype(x.dtype))


def _sum(x, axes):
    return x.astype(compute_dtype(x.dtype)).sum(axis=axes, keepdims=True)


def _mean(x, axes):
    return _float_acc(x).mean(axis=axes, keepdims=True)


def _extreme(x: np.ndarray, largest: bool) -> float:
    """The identity of max (min): what a reduction over no elements gives (bool: False for max, True for min,
    as ReduceMax-20/ReduceMin-20 define)."""
    if x.dtype.kind == "b":
        return not largest
    if x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        return info.min if largest else info.max
    return -np.inf if largest else np.inf


def _max(x, axes):
    return x.astype(compute_dtype(x.dtype)).max(axis=axes, keepdims=True, initial=_extreme(x, True))


def _min(x, axes):
    return x.astype(compute_dtype(x.dtype)).min(axis=axes, keepdims=True, initial=_extreme(x, False))


def _prod(x, axes):
    return x.astype(compute_dtype(x.dtype)).prod(axis=axes, keepdims=True)


def _l2(x, axes):
    return np.sqrt(np.square(_float_acc(x)).sum(axis=axes, keepdims=True))


def _register_reduce(name: str, types: frozenset, compute: Callable, doc: str) -> None:
    def reference(data, axes=None, *, keepdims, noop_with_empty_axes):
        ax = _reference_axes(data, axes, noop_with_empty_axes)
        if ax is None:
            return data
        y = compute(data, ax)
        return (y if keepdims else np.squeeze(y, axis=ax)).astype(data.dtype)

    reference.__name__ = name
    reference.__doc__ = doc
    op(name, inputs=[In("data", types), In("axes", INT64, optional=True, rank=1)], outputs=["reduced"],
       attrs=[Attr("keepdims", AttrKind.INT, 1), Attr("noop_with_empty_axes", AttrKind.INT, 0)],
       infer=infer_reduce)(reference)


_register_reduce("ReduceSum", REDUCE_T, _sum, "Sum over axes (all axes when none are given).")
_register_reduce("ReduceMean", REDUCE_T, _mean, "Mean over axes; integers truncate.")
_register_reduce("ReduceMax", EXTREME_T, _max, "Max over axes (bool: any); over no elements, the lowest value "
                 "(bool: False).")
_register_reduce("ReduceMin", EXTREME_T, _min, "Min over axes (bool: all); over no elements, the highest value "
                 "(bool: True).")
_register_reduce("ReduceProd", REDUCE_T, _prod, "Product over axes.")
_register_reduce("ReduceL2", REDUCE_T, _l2, "sqrt(sum(x^2)) over axes.")


def _l1(x, axes):
    return np.abs(x.astype(compute_dtype(x.dtype))).sum(axis=axes, keepdims=True)


def _sum_square(x, axes):
    a = x.astype(compute_dtype(x.dtype))
    return (a * a).sum(axis=axes, keepdims=True)


def _log_sum(x, axes):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(_float_acc(x).sum(axis=axes, keepdims=True))


def _log_sum_exp(x, axes):
    """log(sum(exp(x))), shifted by the max so that large x does not overflow (an all -inf slice gives -inf)."""
    a = _float_acc(x)
    if a.size == 0:
        return np.log(np.exp(a).sum(axis=axes, keepdims=True))
    top = a.max(axis=axes, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.log(np.exp(a - top).sum(axis=axes, keepdims=True)) + top


_register_reduce("ReduceL1", REDUCE_T, _l1, "sum(|x|) over axes.")
_register_reduce("ReduceSumSquare", REDUCE_T, _sum_square, "sum(x^2) over axes.")
_register_reduce("ReduceLogSum", REDUCE_T, _log_sum, "log(sum(x)) over axes.")
_register_reduce("ReduceLogSumExp", REDUCE_T, _log_sum_exp, "log(sum(exp(x))) over axes.")


# --------------------------------------------------------------------------- ArgMax, ArgMin


def infer_arg(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(DType.INT64, None)
    axis = _axis(ctx, ctx.attrs["axis"], len(x.shape))
    if ctx.attrs["keepdims"]:
        out = [1 if i == axis else d for i, d in enumerate(x.shape)]
    else:
        out = [d for i, d in enumerate(x.shape) if i != axis]
    return TensorType(DType.INT64, out)


def _arg(fn: Callable, data: np.ndarray, axis: int, keepdims: int, select_last_index: int) -> np.ndarray:
    axis = normalize_axis(axis, data.ndim)
    if select_last_index:
        # The first hit in the reversed data is the last hit in the data.
        idx = data.shape[axis] - 1 - fn(np.flip(data, axis), axis=axis)
    else:
        idx = fn(data, axis=axis)
    idx = np.asarray(idx, dtype=np.int64)
    return np.expand_dims(idx, axis) if keepdims else idx


_ARG_ATTRS = [Attr("axis", AttrKind.INT, 0), Attr("keepdims", AttrKind.INT, 1),
              Attr("select_last_index", AttrKind.INT, 0)]


@op("ArgMax", inputs=[In("data", NUMERIC)], outputs=[Out("reduced", INT64)], attrs=_ARG_ATTRS,
    infer=infer_arg)
def arg_max(data, *, axis, keepdims, select_last_index):
    """Index of the largest element along axis (the first one, or the last if select_last_index)."""
    return _arg(np.argmax, data, axis, keepdims, select_last_index)


@op("ArgMin", inputs=[In("data", NUMERIC)], outputs=[Out("reduced", INT64)], attrs=_ARG_ATTRS,
    infer=infer_arg)
def arg_min(data, *, axis, keepdims, select_last_index):
    """Index of the smallest element along axis (the first one, or the last if select_last_index)."""
    return _arg(np.argmin, data, axis, keepdims, select_last_index)


# --------------------------------------------------------------------------- TopK


def _topk_k(ctx: InferContext, dim):
    """K as a dim (int, symbol or None), checked against the size of the axis."""
    k_shape = ctx.input(1).shape
    if k_shape is not None and k_shape != (1,):
        ctx.fail(f"K must be a 1-D tensor of one element, got shape {list(k_shape)}")
    sym = ctx.symbolic(1)
    k = sym[0] if sym is not None and len(sym) == 1 else None
    if isinstance(k, int) and (k < 0 or (isinstance(dim, int) and k > dim)):
        ctx.fail(f"K={k} is out of range for an axis of size {dim}")
    return k


def infer_topk(ctx: InferContext) -> list:
    x = ctx.input(0)
    if x.shape is None:
        return [x, TensorType(DType.INT64, None)]
    axis = _axis(ctx, ctx.attrs["axis"], len(x.shape))
    k = _topk_k(ctx, x.shape[axis])
    out = list(x.shape)
    out[axis] = k
    return [TensorType(x.dtype, out), TensorType(DType.INT64, out)]


@op("TopK", inputs=[In("X", NUMERIC), In("K", INT64, max_elements=1)], outputs=["Values", Out("Indices", INT64)],
    attrs=[Attr("axis", AttrKind.INT, -1), Attr("largest", AttrKind.INT, 1), Attr("sorted", AttrKind.INT, 1)],
    infer=infer_topk)
def top_k(x, k, *, axis, largest, sorted):  # noqa: A002 - the ONNX attribute is named 'sorted'
    """The k largest (or smallest) elements along axis and their indices, always in sorted
    order; equal elements keep their order (the lower index first)."""
    k = int(np.asarray(k).reshape(-1)[0])
    axis = normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise ValueError(f"K={k} is out of range for an axis of size {n}")
    if largest:
        # A stable ascending sort of the reversed data, read backwards, is descending with
        # ties in their original order.
        order = n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, idx, axis), idx.astype(np.int64)


# --------------------------------------------------------------------------- CumSum


def infer_cumsum(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    a_shape = ctx.input(1).shape
    if a_shape is not None and a_shape not in ((), (1,)):
        ctx.fail(f"axis must be a scalar or a 1-element tensor, got shape {list(a_shape)}")
    axis = ctx.const(1)
    if axis is not None and x.shape is not None:
        _axis(ctx, int(axis.reshape(-1)[0]), len(x.shape))
    return x


def _shift_forward(y: np.ndarray, axis: int, first: int = 0) -> np.ndarray:
    """Position i along axis gets the value of position i - 1; position 0 gets ``first`` (this
    turns an inclusive running sum (product: first=1) into an exclusive one without subtracting
    or dividing)."""
    out = np.full_like(y, first)
    dst = [slice(None)] * y.ndim
    src = [slice(None)] * y.ndim
    dst[axis] = slice(1, None)
    src[axis] = slice(0, -1)
    out[tuple(dst)] = y[tuple(src)]
    return out


@op("CumSum", inputs=[In("x", REDUCE_T), In("axis", INDEX, max_elements=1)], outputs=["y"],
    attrs=[Attr("exclusive", AttrKind.INT, 0), Attr("reverse", AttrKind.INT, 0)],
    infer=infer_cumsum)
def cumsum(x, axis, *, exclusive, reverse):
    """Running sum along axis; exclusive leaves out the element itself, reverse runs from the end."""
    axis = normalize_axis(int(np.asarray(axis).reshape(-1)[0]), x.ndim)
    xs = np.flip(x, axis) if reverse else x
    y = np.cumsum(xs.astype(compute_dtype(x.dtype)), axis=axis)
    if exclusive:
        y = _shift_forward(y, axis)
    y = np.flip(y, axis) if reverse else y
    return y.astype(x.dtype)


@op("CumProd", inputs=[In("x", REDUCE_T), In("axis", INDEX, max_elements=1)], outputs=["y"],
    attrs=[Attr("exclusive", AttrKind.INT, 0), Attr("reverse", AttrKind.INT, 0)],
    infer=infer_cumsum)
def cumprod(x, axis, *, exclusive, reverse):
    """Running product along axis (ai.onnx CumProd-26); exclusive leaves out the element itself (the
    first gets 1), reverse runs from the end. Half types multiply in float32 and round once, as
    CumSum; integers wrap on overflow."""
    axis = normalize_axis(int(np.asarray(axis).reshape(-1)[0]), x.ndim)
    xs = np.flip(x, axis) if reverse else x
    y = np.cumprod(xs.astype(compute_dtype(x.dtype)), axis=axis)
    if exclusive:
        y = _shift_forward(y, axis, first=1)
    y = np.flip(y, axis) if reverse else y
    return y.astype(x.dtype)
