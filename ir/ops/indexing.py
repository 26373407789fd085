"""Indexing ops of the shape family: Slice, Gather, GatherElements, ScatterND and Trilu
(ONNX opset 18 semantics). Padding and block rearrangement live in ``layout.py``."""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.ops._common import ALL, INDEX
from kiln.ir.ops._dims import (END_OF_AXIS, INT64, as_int_list, check_axes, check_axis, int_values,
                               scalar_input)
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, dims_compatible

# --------------------------------------------------------------------------- Slice


def clamp_slice(start: int, end: int, step: int, dim: int) -> range:
    """The indices ONNX Slice takes along an axis of size ``dim``.

    Negative start/end count from the back; then both are clamped to [0, dim] for a positive
    step, or start to [0, dim-1] and end to [-1, dim-1] for a negative one (end -1 means
    "past index 0", which Python slicing cannot say, hence a range)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return range(min(max(start, 0), dim), min(max(end, 0), dim), step)
    return range(min(max(start, 0), dim - 1), min(max(end, -1), dim - 1), step)


def _slice_params(ctx: InferContext, rank: int) -> Optional[dict]:
    """{axis: (start, end, step)} from constant inputs, or None when they are not known."""
    starts = int_values(ctx, 1)
    ends = int_values(ctx, 2)
    axes = int_values(ctx, 3) if ctx.has_input(3) else None
    steps = int_values(ctx, 4) if ctx.has_input(4) else None
    if starts is None or ends is None or (ctx.has_input(3) and axes is None) or (ctx.has_input(4) and steps is None):
        return None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        ctx.fail(f"starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    if 0 in steps:
        ctx.fail(f"steps {steps} must not be 0")
    axes = check_axes(ctx, axes, rank)
    return {a: (s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)}


def _sliced_dim(d: Dim, start: int, end: int, step: int) -> Dim:
    if isinstance(d, int):
        return len(clamp_slice(start, end, step, d))
    whole_forward = step == 1 and start == 0 and end >= END_OF_AXIS
    whole_reversed = step == -1 and start in (-1, END_OF_AXIS) and end <= -END_OF_AXIS
    return d if whole_forward or whole_reversed else None


def _infer_slice(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, None)
    params = _slice_params(ctx, len(x.shape))
    if params is None:
        axes = int_values(ctx, 3) if ctx.has_input(3) else None
        if axes is None:
            return TensorType(x.dtype, (None,) * len(x.shape))
        axes = check_axes(ctx, axes, len(x.shape))
        return TensorType(x.dtype, [None if i in axes else d for i, d in enumerate(x.shape)])
    return TensorType(x.dtype, [_sliced_dim(d, *params[i]) if i in params else d for i, d in enumerate(x.shape)])


def _propagate_slice(ctx: InferContext) -> Optional[tuple]:
    vals = ctx.symbolic(0)
    if vals is None or ctx.input(0).rank != 1:
        return None
    params = _slice_params(ctx, 1)
    if params is None:
        return None
    if not params:
        return vals
    return tuple(vals[i] for i in clamp_slice(*params[0], len(vals)))


@op("Slice", inputs=[In("data", ALL), In("starts", INDEX, rank=1), In("ends", INDEX, rank=1),
                     In("axes", INDEX, optional=True, rank=1), In("steps", INDEX, optional=True, rank=1)], outputs=["output"], infer=_infer_slice,
    propagate=_propagate_slice)
def slice_(data, starts, ends, axes=None, steps=None):
    starts = as_int_list(starts)
    axes = list(range(len(starts))) if axes is None else as_int_list(axes)
    steps = [1] * len(starts) if steps is None else as_int_list(steps)
    index = [slice(None)] * data.ndim
    for a, s, e, st in zip(axes, starts, as_int_list(ends), steps):
        r = clamp_slice(s, e, st, data.shape[a])
        index[a] = slice(r.start, r.stop if r.stop >= 0 else None, r.step)
    return data[tuple(index)]


# --------------------------------------------------------------------------- Gather / GatherElements


def _infer_gather(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    idx = ctx.input(1)
    if x.shape is None or idx.shape is None:
        return TensorType(x.dtype, None)
    if not x.shape:
        ctx.fail("cannot gather from a scalar")
    axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
    dim = x.shape[axis]
    values = int_values(ctx, 1)
    if values is not None and isinstance(dim, int) and any(not -dim <= v < dim for v in values):
        ctx.fail(f"indices {values} are out of range for axis {axis} of size {dim}")
    return TensorType(x.dtype, x.shape[:axis] + idx.shape + x.shape[axis + 1:])


def _propagate_gather(ctx: InferContext) -> Optional[tuple]:
    vals = ctx.symbolic(0)
    picks = int_values(ctx, 1)
    if vals is None or picks is None or ctx.input(0).rank != 1 or (ctx.input(1).rank or 0) > 1:
        return None
    return tuple(vals[p] for p in picks)


@op("Gather", inputs=[In("data", ALL), In("indices", INDEX)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, 0)], infer=_infer_gather, propagate=_propagate_gather)
def gather(data, indices, *, axis=0):
    dim = data.shape[axis]
    if np.any((indices < -dim) | (indices >= dim)):
        raise IndexError(f"indices out of range [-{dim}, {dim}) on axis {axis}")
    return np.take(data, np.where(indices < 0, indices + dim, indices), axis=axis)


def _infer_gather_elements(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    idx = ctx.input(1)
    if x.shape is not None and idx.shape is not None:
        if len(x.shape) != len(idx.shape) or not x.shape:
            ctx.fail(f"data {x} and indices {idx} must have the same rank >= 1")
        check_axis(ctx, ctx.attrs["axis"], len(x.shape))
    return TensorType(x.dtype, idx.shape)


@op("GatherElements", inputs=[In("data", ALL), In("indices", INDEX)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, 0)], infer=_infer_gather_elements)
def gather_elements(data, indices, *, axis=0):
    dim = data.shape[axis]
    if np.any((indices < -dim) | (indices >= dim)):
        raise IndexError(f"indices out of range [-{dim}, {dim}) on axis {axis}")
    return np.take_along_axis(data, np.where(indices < 0, indices + dim, indices), axis=axis)


# --------------------------------------------------------------------------- ScatterND

_SCATTER_REDUCTIONS = {
    "none": lambda old, new: new,
    "add": np.add,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _infer_scatter_nd(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    idx = ctx.input(1)
    upd = ctx.input(2)
    if ctx.attrs["reduction"] not in _SCATTER_REDUCTIONS:
        ctx.fail(f"reduction '{ctx.attrs['reduction']}' is not one of {', '.join(_SCATTER_REDUCTIONS)}")
    if upd.dtype is not x.dtype:
        ctx.fail(f"updates are {upd.dtype}, data is {x.dtype}")
    if idx.shape == ():
        ctx.fail("indices must have rank >= 1 (the last axis holds the index tuples)")
    if x.shape is None or idx.shape is None or upd.shape is None or not isinstance(idx.shape[-1], int):
        return x
    k = idx.shape[-1]
    if k > len(x.shape):
        ctx.fail(f"indices address {k} axes of rank-{len(x.shape)} data")
    want = idx.shape[:-1] + x.shape[k:]
    if len(want) != len(upd.shape) or not all(dims_compatible(a, b) for a, b in zip(want, upd.shape)):
        ctx.fail(f"updates {upd} must have shape {list(want)} for data {x} and indices {idx}")
    return x


@op("ScatterND", inputs=[In("data", ALL), In("indices", INT64), In("updates", ALL)], outputs=["output"],
    attrs=[Attr("reduction", AttrKind.STRING, "none")], infer=_infer_scatter_nd)
def scatter_nd(data, indices, updates, *, reduction="none"):
    out = data.copy()
    k = indices.shape[-1]
    if k == 0:  # every index tuple addresses the whole tensor
        combine = _SCATTER_REDUCTIONS[reduction]
        for pos in np.ndindex(*indices.shape[:-1]):
            out[...] = combine(out, updates[pos])
        return out
    flat = indices.reshape(-1, k)
    dims = np.asarray(data.shape[:k], np.int64)
    if flat.size and (np.any(flat < -dims) or np.any(flat >= dims)):
        raise IndexError(f"an index tuple is outside data of shape {list(data.shape)}")
    where = tuple(flat[:, j] for j in range(k))
    upd = updates.reshape((flat.shape[0],) + data.shape[k:])
    if reduction == "none":
        out[where] = upd  # duplicate tuples: the last one wins (ONNX leaves it undefined)
    else:
        _SCATTER_REDUCTIONS[reduction].at(out, where, upd)  # duplicates accumulate in order
    return out


# --------------------------------------------------------------------------- Trilu


def _infer_trilu(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) < 2:
        ctx.fail(f"input must have rank >= 2, got {x}")
    if ctx.has_input(1):
        scalar_input(ctx, 1, "k")
    return x


@op("Trilu", inputs=[In("input", ALL), In("k", INT64, optional=True, max_elements=1)], outputs=["output"],
    attrs=[Attr("upper", AttrKind.INT, 1)], infer=_infer_trilu)
def trilu(x, k=None, *, upper=1):
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return np.triu(x, k) if upper else np.tril(x, k)

