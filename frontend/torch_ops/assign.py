"""Writing by index: ``x[index] = value`` (Tensor.__setitem__) and index_put / index_put_.

The graph is SSA, so a write is recorded as a new value of x that x is then bound to: Where
for a bool mask, ScatterND for ints, slices and one 1-D int tensor (the indexed axes are
moved to the front, so ScatterND writes whole slabs of the others), and ScatterND for several
index tensors that broadcast together (stacked as its index tuples). In eager torch the write
is also seen through every tensor sharing x's memory (views of x, x's base); the graph cannot
follow that, so those tensors are marked stale and using one later raises UnsupportedOpError.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.frontend.torch_ops.indexing import END, Entry, index_value, is_full, parse_index, slice_bounds
from kiln.frontend.torch_ops.shape import axes_value, squeezable
from kiln.frontend.tracer import kiln_dtype

MASKS = (torch.bool, torch.uint8)


def fit_value(t, x: torch.Tensor, value: Any, rank: int):
    """``value`` as an IR value of x's dtype with at most ``rank`` dims (torch drops leading 1s)."""
    dt = kiln_dtype(x.dtype)
    v = t.value(value, dt)
    if isinstance(value, torch.Tensor) and value.dim() > rank:
        extra = range(value.dim() - rank)
        axes = squeezable(t, "Tensor.__setitem__", value, extra)
        if len(axes) != len(extra):
            raise UnsupportedOpError(f"{t.where()}: a value of shape {tuple(value.shape)} does not fit the "
                                     f"{rank}-d selection it is written to")
        v = t.emit("Squeeze", v, axes_value(t, axes))
    return v


# ---------------------------------------------------------------------------- bool masks: Where
def _mask_axis(t, x: torch.Tensor, items: tuple, mask: torch.Tensor) -> int:
    """The first axis the mask covers; every other item must be a full slice or Ellipsis."""
    at = next(i for i, o in enumerate(items) if o is mask)
    others = [o for o in items if o is not mask]
    if not all(o is Ellipsis or (isinstance(o, slice) and is_full(o)) for o in others):
        raise UnsupportedOpError(f"{t.where()}: writing through a bool mask combined with ints, slices or other "
                                 "tensors is not supported; write x[mask] = v with a mask over x's leading dims")
    if any(o is Ellipsis for o in items[:at]):
        return x.dim() - mask.dim() - (len(items) - at - 1)
    return at


def assign_masked(t, x: torch.Tensor, items: tuple, value: Any, accumulate: bool = False):
    masks = [o for o in items if isinstance(o, torch.Tensor) and o.dtype in MASKS]
    if len(masks) > 1:
        raise UnsupportedOpError(f"{t.where()}: writing through several bool masks is not supported")
    mask = masks[0]
    a = _mask_axis(t, x, items, mask)
    trailing = x.dim() - a - mask.dim()
    cond = t.value(mask, kiln_dtype(torch.bool))
    if trailing:
        cond = t.emit("Unsqueeze", cond, axes_value(t, range(mask.dim(), mask.dim() + trailing)))
    if isinstance(value, torch.Tensor) and value.dim() > trailing and value.numel() != 1:
        raise UnsupportedOpError(
            f"{t.where()}: x[mask] = v with v of shape {tuple(value.shape)} (one row per True element) depends on "
            "the mask's data; kiln supports a scalar v or one that broadcasts over x's unmasked dims")
    v = fit_value(t, x, value, trailing)
    xv = t.value(x)
    if accumulate:
        v = t.emit("Add", xv, v)
    return t.emit("Where", cond, v, xv)


# ---------------------------------------------------------------------------- ints/slices: ScatterND
def _positions(t, x: torch.Tensor, e: Entry):
    """The 1-D int64 positions entry e writes along its axis."""
    size = dim_of(t, x, e.axis)
    if e.kind == "tensor":
        return index_value(t, e.obj, size)
    every = t.emit("Range", t.scalar(0), t.int_value(size), t.scalar(1))
    if e.kind == "int":
        stop = END if not isinstance(e.obj, SymInt) and e.obj == -1 else e.obj + 1
        bounds = (e.obj, stop, 1)
    else:
        bounds = slice_bounds(e.obj)
    return t.emit("Slice", every, t.shape_value([bounds[0]]), t.shape_value([bounds[1]]), axes_value(t, [0]),
                  t.shape_value([bounds[2]]))


def _index_grid(t, positions: list):
    """[L0, ..., Lk-1, k] int64: every combination of the per-axis positions (ScatterND's indices)."""
    k = len(positions)
    if k == 1:
        return t.emit("Unsqueeze", positions[0], axes_value(t, [1]))
    lengths = [t.emit("Shape", p) for p in positions]
    grid_shape = t.emit("Concat", *lengths, t.constant(np.array([1], np.int64), "shape"), axis=0)
    columns = []
    for j, p in enumerate(positions):
        spread = t.emit("Unsqueeze", p, axes_value(t, [i for i in range(k + 1) if i != j]))
        columns.append(t.emit("Expand", spread, grid_shape))
    return t.emit("Concat", *columns, axis=k)


def _selection_shape(t, xv, entries: list[Entry], positions: dict):
    """The shape of x[index] (torch's): full axes as they are, written axes by their positions, ints dropped."""
    pieces = []
    for e in entries:
        if e.kind == "slice" and is_full(e.obj):
            pieces.append(t.emit("Shape", xv, start=e.axis, end=e.axis + 1))
        elif e.kind != "int":
            pieces.append(t.emit("Shape", positions[e.axis]))
    if not pieces:
        return t.constant(np.zeros(0, np.int64), "shape"), 0
    return (pieces[0] if len(pieces) == 1 else t.emit("Concat", *pieces, axis=0)), len(pieces)


def assign_indexed(t, x: torch.Tensor, entries: list[Entry], value: Any, accumulate: bool = False):
    xv = t.value(x)
    written = [e for e in entries if not (e.kind == "slice" and is_full(e.obj))]
    positions = {e.axis: _positions(t, x, e) for e in written}
    target, rank = _selection_shape(t, xv, entries, positions)
    updates = t.emit("Expand", fit_value(t, x, value, rank), target)
    ints = [e.axis for e in entries if e.kind == "int"]
    if ints:
        updates = t.emit("Unsqueeze", updates, axes_value(t, ints))  # now one axis per axis of x
    if not written:
        return t.emit("Add", xv, updates) if accumulate else updates
    perm = [e.axis for e in written] + [e.axis for e in entries if e not in written]
    moved = perm != list(range(x.dim()))
    if moved:
        xv = t.emit("Transpose", xv, perm=perm)
        updates = t.emit("Transpose", updates, perm=perm)
    grid = _index_grid(t, [positions[e.axis] for e in written])
    out = t.emit("ScatterND", xv, grid, updates, reduction="add" if accumulate else "none")
    if moved:
        out = t.emit("Transpose", out, perm=[perm.index(i) for i in range(x.dim())])
    return out


def assign_advanced(t, x: torch.Tensor, entries: list[Entry], value: Any, accumulate: bool = False):
    """``x[i, j] = v`` with several index tensors (or one of 2+ dims) that broadcast together, ints
    among them and every other axis a full slice: one ScatterND whose index tuples are the
    broadcast index tensors (and ints) stacked on a last axis, over x with the indexed axes moved
    to the front (transformers' wav2vec2 writes ``mask[(torch.arange(b), lengths - 1)] = 1``).

    The value is laid out as torch's selection: ints drop their axis, and the broadcast index
    dims stand where the index tensors are when those are adjacent, else first."""
    if any(not (e.kind == "slice" and is_full(e.obj)) for e in entries if e.kind not in ("tensor", "int")):
        raise UnsupportedOpError(f"{t.where()}: writing through several tensor indices combined with a partial "
                                 "slice is not supported; slice first, or index every such axis with a tensor")
    indexed = [e for e in entries if e.kind in ("tensor", "int")]
    axes = [e.axis for e in indexed]
    idx = []
    for e in indexed:
        size = dim_of(t, x, e.axis)
        if e.kind == "tensor":
            idx.append(index_value(t, e.obj, size))
        else:
            idx.append(t.int_value(e.obj if isinstance(e.obj, SymInt) or e.obj >= 0 else size + e.obj))
    rank = max(e.obj.dim() for e in indexed if e.kind == "tensor")
    common = idx[0]
    for v in idx[1:]:
        common = t.emit("Add", common, v)  # only for its broadcast shape
    shape = t.emit("Shape", common)
    last = axes_value(t, [rank])
    grid = t.emit("Concat", *[t.emit("Unsqueeze", t.emit("Expand", v, shape), last) for v in idx], axis=rank)
    xv = t.value(x)
    k = len(axes)
    perm = axes + [i for i in range(x.dim()) if i not in axes]
    moved = perm != list(range(x.dim()))
    if moved:
        xv = t.emit("Transpose", xv, perm=perm)
    # Where torch's selection has the broadcast dims: after the full slices before the first index
    # tensor when the index tensors are adjacent (ints dropped first), else in front.
    kept = [e for e in entries if e.kind != "int"]
    tpos = [i for i, e in enumerate(kept) if e.kind == "tensor"]
    lead = tpos[0] if tpos == list(range(tpos[0], tpos[0] + len(tpos))) else 0
    pieces = ([t.emit("Shape", xv, start=k, end=k + lead)] if lead else []) + [shape]
    if k + lead < x.dim():
        pieces.append(t.emit("Shape", xv, start=k + lead))
    selection = t.emit("Concat", *pieces, axis=0) if len(pieces) > 1 else shape
    total = rank + x.dim() - k
    updates = t.emit("Expand", fit_value(t, x, value, total), selection)
    if lead:
        updates = t.emit("Transpose", updates, perm=list(range(lead, lead + rank)) + list(range(lead))
                         + list(range(lead + rank, total)))
    out = t.emit("ScatterND", xv, grid, updates, reduction="add" if accumulate else "none")
    if moved:
        out = t.emit("Transpose", out, perm=[perm.index(i) for i in range(x.dim())])
    return out


# ---------------------------------------------------------------------------- the mappings
def assign(t, x: torch.Tensor, index: Any, value: Any, accumulate: bool = False):
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(o, torch.Tensor) and o.dtype in MASKS for o in items):
        return assign_masked(t, x, items, value, accumulate)
    entries = parse_index(t, x, index)
    tensors = [e.obj for e in entries if e.kind == "tensor"]
    if any(e.kind == "none" for e in entries):
        raise UnsupportedOpError(f"{t.where()}: writing through an index with None is not supported")
    if len(tensors) > 1 or (tensors and tensors[0].dim() != 1):
        return assign_advanced(t, x, entries, value, accumulate)
    return assign_indexed(t, x, entries, value, accumulate)


def rebind(t, func, x: torch.Tensor, new) -> None:
    """Make ``new`` the value of x; tensors sharing x's memory go stale."""
    t.invalidate_aliases(x, f"this tensor shares memory with one written in place at {t.where()}; kiln's graph "
                            "cannot follow writes through views: .clone() the tensor before writing to it, or "
                            "write to it directly (x[i, j] = v, not x[i][j] = v)")
    t.bind(func, x, new)


@maps(torch.Tensor.__setitem__)
def setitem(t, res, input, index, value):
    new = assign(t, input, index, value)
    rebind(t, torch.Tensor.__setitem__, input, new)
    return new  # __setitem__ returns None: the tracer has no tensor to bind it to


def _index_items(indices) -> tuple:
    return tuple(slice(None) if i is None else i for i in indices)  # index_put's None means "all"


@maps(torch.index_put, torch.Tensor.index_put)
def index_put(t, res, input, indices, values, accumulate=False):
    return assign(t, input, _index_items(indices), values, accumulate)


@maps(torch.index_put_, torch.Tensor.index_put_)
def index_put_(t, res, input, indices, values, accumulate=False):
    new = assign(t, input, _index_items(indices), values, accumulate)
    t.invalidate_aliases(input, f"this tensor shares memory with one written in place by index_put_ at "
                                f"{t.where()}; .clone() it before the write")
    return new
