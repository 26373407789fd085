"""Indexing ops of the shape family: Slice, Gather, GatherElements, GatherND, ScatterND,
ScatterElements, OneHot, Compress, Trilu, NonZero and ReverseSequence (ONNX opset 18 semantics; the
deprecated Scatter is imported as ScatterElements). Padding and block rearrangement live in ``layout.py``."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import ALL, BOOL, INDEX, NUMERIC
from kiln.ir.ops._dims import (END_OF_AXIS, INT64, as_int_list, check_axes, check_axis, dim_product, int_values,
                               scalar_input)
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, dims_compatible, merge_dim, normalize_axis

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


def _scatter_inputs(ctx: InferContext) -> tuple:
    """(data, indices, updates) types, with the checks ScatterND and ScatterElements share."""
    x = ctx.input(0)
    idx = ctx.input(1)
    upd = ctx.input(2)
    if ctx.attrs["reduction"] not in _SCATTER_REDUCTIONS:
        ctx.fail(f"reduction '{ctx.attrs['reduction']}' is not one of {', '.join(_SCATTER_REDUCTIONS)}")
    if upd.dtype is not x.dtype:
        ctx.fail(f"updates are {upd.dtype}, data is {x.dtype}")
    return x, idx, upd


def _infer_scatter_nd(ctx: InferContext) -> TensorType:
    x, idx, upd = _scatter_inputs(ctx)
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


# --------------------------------------------------------------------------- GatherND


def _check_index_values(ctx: InferContext, values: np.ndarray, dims: dict) -> None:
    """Fail when constant indices leave an axis of known size: ``values[..., j]`` indexes data axis
    ``a`` of size ``d`` for the j-th item ``a: d`` of ``dims``."""
    for j, (axis, dim) in enumerate(dims.items()):
        col = values[..., j]
        if not isinstance(dim, int) or not col.size:
            continue
        lo, hi = int(col.min()), int(col.max())
        if lo < -dim or hi >= dim:
            ctx.fail(f"index {lo if lo < -dim else hi} is out of range [-{dim}, {dim}) for axis {axis} of data "
                     f"(size {dim})")


def _infer_gather_nd(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    idx = ctx.input(1)
    b = ctx.attrs["batch_dims"]
    if b < 0:
        ctx.fail(f"batch_dims must be >= 0, got {b}")
    if x.shape == ():
        ctx.fail("data must have rank >= 1, got a scalar")
    if idx.shape == ():
        ctx.fail("indices must have rank >= 1 (the last axis holds the index tuples), got a scalar")
    if x.shape is None or idx.shape is None:
        return TensorType(x.dtype, None)
    r, q = len(x.shape), len(idx.shape)
    if b >= min(r, q):
        ctx.fail(f"batch_dims {b} must be less than the ranks of data ({r}) and indices ({q})")
    if not all(dims_compatible(a, c) for a, c in zip(x.shape[:b], idx.shape[:b])):
        ctx.fail(f"the first batch_dims={b} dims of data {x} and indices {idx} must be equal")
    k = idx.shape[-1]
    if not isinstance(k, int):
        return TensorType(x.dtype, None)  # the output rank depends on the tuple length
    if not 1 <= k <= r - b:
        ctx.fail(f"index tuples have {k} elements (indices {idx}); they must have 1 to {r - b} "
                 f"(data rank {r} less batch_dims {b})")
    values = ctx.const(1)
    if values is not None:
        _check_index_values(ctx, values.astype(np.int64), {b + j: x.shape[b + j] for j in range(k)})
    batch = tuple(merge_dim(a, c) for a, c in zip(x.shape[:b], idx.shape[:b]))
    return TensorType(x.dtype, batch + tuple(idx.shape[b:-1]) + tuple(x.shape[b + k:]))


@op("GatherND", inputs=[In("data", ALL), In("indices", INT64)], outputs=["output"],
    attrs=[Attr("batch_dims", AttrKind.INT, 0)], infer=_infer_gather_nd)
def gather_nd(data, indices, *, batch_dims=0):
    """Slices of data addressed by the index tuples on indices' last axis (GatherND-13); the first
    batch_dims dims of data and indices are batch dims, walked together. Negative indices count
    from the back; one out of range is an error."""
    b = int(batch_dims)
    if data.ndim < 1 or indices.ndim < 1 or not 0 <= b < min(data.ndim, indices.ndim):
        raise ValueError(f"batch_dims={b} needs data (rank {data.ndim}) and indices (rank {indices.ndim}) "
                         f"of rank > batch_dims")
    if data.shape[:b] != indices.shape[:b]:
        raise ValueError(f"batch dims differ: data {list(data.shape)}, indices {list(indices.shape)}, "
                         f"batch_dims={b}")
    k = indices.shape[-1]
    if not 1 <= k <= data.ndim - b:
        raise ValueError(f"index tuples of {k} elements for data of rank {data.ndim} with batch_dims={b}")
    dims = np.asarray(data.shape[b:b + k], np.int64)
    if indices.size and (np.any(indices < -dims) or np.any(indices >= dims)):
        raise IndexError(f"an index tuple is outside data of shape {list(data.shape)} (batch_dims={b})")
    idx = np.where(indices < 0, indices + dims, indices)
    n = math.prod(data.shape[:b])
    m = math.prod(indices.shape[b:-1])
    flat = idx.reshape(n, m, k)
    where = (np.arange(n)[:, None],) + tuple(flat[..., j] for j in range(k))
    out = data.reshape((n,) + data.shape[b:])[where]
    return out.reshape(indices.shape[:-1] + data.shape[b + k:])


# --------------------------------------------------------------------------- ScatterElements


def _infer_scatter_elements(ctx: InferContext) -> TensorType:
    x, idx, upd = _scatter_inputs(ctx)
    for name, t in (("data", x), ("indices", idx), ("updates", upd)):
        if t.shape == ():
            ctx.fail(f"{name} must have rank >= 1, got a scalar")
    ranks = {len(t.shape) for t in (x, idx, upd) if t.shape is not None}
    if len(ranks) > 1:
        ctx.fail(f"data {x}, indices {idx} and updates {upd} must have the same rank")
    if not ranks:
        return x
    axis = check_axis(ctx, ctx.attrs["axis"], ranks.pop())
    if idx.shape is not None and upd.shape is not None and \
            not all(dims_compatible(a, c) for a, c in zip(idx.shape, upd.shape)):
        ctx.fail(f"updates {upd} must have the shape of indices {idx}")
    if x.shape is None or idx.shape is None:
        return x
    for i, (d, n) in enumerate(zip(x.shape, idx.shape)):
        if i != axis and isinstance(d, int) and isinstance(n, int) and n > d:
            ctx.fail(f"indices {idx} are larger than data {x} on axis {i} (only the scatter axis {axis} may differ)")
    values = ctx.const(1)
    if values is not None:
        _check_index_values(ctx, values.astype(np.int64)[..., None], {axis: x.shape[axis]})
    return x


@op("ScatterElements", inputs=[In("data", ALL), In("indices", INDEX), In("updates", ALL)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, 0), Attr("reduction", AttrKind.STRING, "none")],
    infer=_infer_scatter_elements)
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    """A copy of data with updates[p] written (or combined, by reduction) at p with its axis
    coordinate replaced by indices[p] (ScatterElements-18). Duplicates with a reduction combine
    in order; without one the last wins (ONNX leaves that undefined)."""
    if reduction not in _SCATTER_REDUCTIONS:
        raise ValueError(f"reduction '{reduction}' is not one of {', '.join(_SCATTER_REDUCTIONS)}")
    if not data.ndim == indices.ndim == updates.ndim >= 1 or indices.shape != updates.shape:
        raise ValueError(f"data {list(data.shape)}, indices {list(indices.shape)} and updates "
                         f"{list(updates.shape)}: indices and updates must have one shape, of data's rank >= 1")
    axis = normalize_axis(axis, data.ndim)
    over = [i for i in range(data.ndim) if i != axis and indices.shape[i] > data.shape[i]]
    if over:
        raise IndexError(f"indices of shape {list(indices.shape)} are larger than data of shape "
                         f"{list(data.shape)} on axis {over[0]}")
    dim = data.shape[axis]
    if np.any((indices < -dim) | (indices >= dim)):
        raise IndexError(f"indices out of range [-{dim}, {dim}) on axis {axis}")
    where = list(np.indices(indices.shape, sparse=True))
    where[axis] = np.where(indices < 0, indices + dim, indices)
    out = data.copy()
    if reduction == "none":
        out[tuple(where)] = updates
    else:
        _SCATTER_REDUCTIONS[reduction].at(out, tuple(where), updates)  # duplicates accumulate in order
    return out


# --------------------------------------------------------------------------- OneHot

# ONNX's T1/T2 (indices, depth): every numeric type but bfloat16 (uint16/32/64 kiln lacks).
_ONE_HOT_NUMBERS = NUMERIC - {DType.BFLOAT16}


def _depth_value(depth) -> int:
    """The depth input as an int: a float is cast to int64 (truncated) as ONNX says."""
    v = np.asarray(depth).reshape(-1)[0]
    if not np.issubdtype(v.dtype, np.integer):
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"depth {v} is not a finite number")
    return int(v)


def _infer_one_hot(ctx: InferContext) -> TensorType:
    idx = ctx.input(0)
    scalar_input(ctx, 1, "depth")
    vals = ctx.input(2)
    if vals.shape is not None and (len(vals.shape) != 1 or not dims_compatible(vals.shape[0], 2)):
        ctx.fail(f"values must be a 1-D tensor of two elements [off_value, on_value], got shape {list(vals.shape)}")
    depth: Dim = None
    c = ctx.const(1)
    if c is not None:
        try:
            depth = _depth_value(c)
        except ValueError as e:
            ctx.fail(str(e))
    else:
        s = ctx.symbolic(1)
        depth = s[0] if s is not None and len(s) == 1 else None
    if isinstance(depth, int) and depth < 0:
        ctx.fail(f"depth must be >= 0, got {depth}")
    if idx.shape is None:
        return TensorType(vals.dtype, None)
    axis = check_axis(ctx, ctx.attrs["axis"], len(idx.shape) + 1)
    return TensorType(vals.dtype, tuple(idx.shape[:axis]) + (depth,) + tuple(idx.shape[axis:]))


@op("OneHot", inputs=[In("indices", _ONE_HOT_NUMBERS), In("depth", _ONE_HOT_NUMBERS, max_elements=1),
                      In("values", ALL, rank=1)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, -1)], infer=_infer_one_hot)
def one_hot(indices, depth, values, *, axis=-1):
    """on_value (values[1]) where the new axis' position equals the index, off_value (values[0])
    elsewhere (OneHot-11). Float indices and depth are truncated to int64; indices in [-depth, -1]
    count from the back; any other index outside [0, depth) gives all off_value (not an error)."""
    d = _depth_value(depth)
    if d < 0:
        raise ValueError(f"depth must be >= 0, got {d}")
    if values.shape != (2,):
        raise ValueError(f"values must hold two elements [off_value, on_value], got shape {list(values.shape)}")
    with np.errstate(invalid="ignore", over="ignore"):
        idx = np.asarray(indices).astype(np.int64)
    axis = normalize_axis(axis, idx.ndim + 1)
    idx = np.where(idx < 0, idx + d, idx)
    classes = np.arange(d, dtype=np.int64).reshape((1,) * axis + (d,) + (1,) * (idx.ndim - axis))
    hot = np.expand_dims(idx, axis) == classes
    return np.where(hot, values[1], values[0]).astype(values.dtype, copy=False)


# --------------------------------------------------------------------------- Compress


def _infer_compress(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    cond = ctx.input(1)
    axis = ctx.attrs["axis"]
    if cond.shape is not None and len(cond.shape) != 1:
        ctx.fail(f"condition must be a 1-D bool tensor, got shape {list(cond.shape)}")
    if x.shape == ():
        ctx.fail("input must have rank >= 1, got a scalar")
    if x.shape is None:
        return TensorType(x.dtype, (None,) if axis is None else None)
    if axis is None:
        n = dim_product(x.shape)
    else:
        axis = check_axis(ctx, axis, len(x.shape))
        n = x.shape[axis]
    count: Dim = None  # data-dependent, unless the condition is a constant
    c = ctx.const(1)
    if c is not None:
        picks = np.flatnonzero(c)
        if isinstance(n, int) and picks.size and int(picks[-1]) >= n:
            where = "elements in the flattened input" if axis is None else f"slices along axis {axis}"
            ctx.fail(f"condition selects position {int(picks[-1])}, but there are only {n} {where}")
        count = int(picks.size)
    elif cond.shape == (0,):
        count = 0
    if axis is None:
        return TensorType(x.dtype, (count,))
    return TensorType(x.dtype, tuple(x.shape[:axis]) + (count,) + tuple(x.shape[axis + 1:]))


@op("Compress", inputs=[In("input", ALL), In("condition", BOOL, rank=1)], outputs=["output"],
    attrs=[Attr("axis", AttrKind.INT, None)], infer=_infer_compress)
def compress(x, condition, *, axis=None):
    """The slices along axis (without axis: the elements of the flattened input) whose condition
    is True, as numpy.compress (Compress-11). A condition shorter than the axis drops the rest;
    one longer may only hold False past the end (a True there is an error). The output size
    depends on the condition's values."""
    if x.ndim < 1:
        raise ValueError("Compress takes an input of rank >= 1, got a scalar")
    n = x.size if axis is None else x.shape[normalize_axis(axis, x.ndim)]
    picks = np.flatnonzero(condition)
    if picks.size and int(picks[-1]) >= n:
        raise IndexError(f"condition selects position {int(picks[-1])}, but there are only {n} "
                         f"{'elements' if axis is None else f'slices along axis {axis}'}")
    if axis is None:
        return x.reshape(-1)[picks]
    return np.take(x, picks, axis=axis)


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



# --------------------------------------------------------------------------- NonZero


def _infer_nonzero(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    rank = None if x.shape is None else max(len(x.shape), 1)
    # The count of nonzero elements is data: the second dim is known only for a constant input.
    c = ctx.const(0)
    count = None if c is None else int(np.count_nonzero(c))
    return TensorType(DType.INT64, None if rank is None else (rank, count))


@op("NonZero", inputs=[In("X", ALL)], outputs=["Y"], infer=_infer_nonzero)
def nonzero(x):
    """The indices of the nonzero elements, [rank, count] int64, in row-major order (a 0-d input counts as
    rank 1, as numpy and ONNX's reference do)."""
    x = np.asarray(x)
    if x.ndim == 0:
        x = x.reshape(1)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


# --------------------------------------------------------------------------- ReverseSequence


def _infer_reverse_sequence(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    lens = ctx.input(1)
    b, t = ctx.attrs["batch_axis"], ctx.attrs["time_axis"]
    if {b, t} != {0, 1}:
        ctx.fail(f"batch_axis and time_axis must be 0 and 1 (either way round), got {b} and {t}")
    if x.shape is None:
        return x
    if len(x.shape) < 2:
        ctx.fail(f"input must have rank >= 2 (a batch axis and a time axis), got shape {list(x.shape)}")
    if lens.shape is not None and not dims_compatible(lens.shape[0], x.shape[b]):
        ctx.fail(f"sequence_lens has {lens.shape[0]} lengths, but the batch axis {b} of input has {x.shape[b]}")
    values = int_values(ctx, 1)
    steps = x.shape[t]
    if values is not None and isinstance(steps, int) and any(not 0 <= v <= steps for v in values):
        ctx.fail(f"sequence_lens {values} must lie in [0, {steps}] (the time axis {t} has {steps} steps)")
    return x


@op("ReverseSequence", inputs=[In("input", ALL), In("sequence_lens", INT64, rank=1)], outputs=["Y"],
    attrs=[Attr("batch_axis", AttrKind.INT, 1), Attr("time_axis", AttrKind.INT, 0)],
    infer=_infer_reverse_sequence)
def reverse_sequence(x, sequence_lens, *, batch_axis=1, time_axis=0):
    """For each batch entry b, its first sequence_lens[b] steps along time_axis reversed, the rest copied
    (ReverseSequence-10; 28 adds bfloat16). Axes 0 and 1 are the batch and time axes; a length outside
    [0, steps] is an error."""
    steps, batch = x.shape[time_axis], x.shape[batch_axis]
    lens = np.asarray(sequence_lens, np.int64).reshape(-1)
    if lens.shape != (batch,):
        raise ValueError(f"sequence_lens has {lens.size} lengths for a batch of {batch}")
    if np.any((lens < 0) | (lens > steps)):
        raise IndexError(f"sequence_lens {lens.tolist()} must lie in [0, {steps}]")
    t = np.arange(steps, dtype=np.int64)
    source = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # [batch, steps]: the step each one reads
    if time_axis == 0:
        source = source.T
    return np.take_along_axis(x, source.reshape(source.shape + (1,) * (x.ndim - 2)), axis=time_axis)
