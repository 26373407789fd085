"""Reading by index: ``Tensor.__getitem__`` (ints, slices, None, Ellipsis, int tensors, constant
bool masks), gather, index_select, select, tril/triu, flip, roll. Writing (``__setitem__``,
index_put) is in assign.py.

``x[...]`` is lowered in torch's order: one Slice for every slice, a Gather per int (torch
selects ints first), one Gather for the tensor indices (several adjacent ones are merged into a
single flat index), then an Unsqueeze for the Nones. Slice bounds and int indices may be
SymInts, so ``x[:, :seq]`` keeps working when ``seq`` comes from another input's shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.frontend.torch_ops.shape import axes_value, norm_dim, numel
from kiln.ir.dtypes import DType

END = 2**63 - 1  # a slice "to the end" (ONNX clamps it to the axis)
BEFORE_START = -2**63  # a reversed slice "past index 0"


# ---------------------------------------------------------------------------- parsing an index
@dataclass
class Entry:
    """One item of an index tuple: 'slice', 'int', 'none' or 'tensor', and the input axis it reads."""

    kind: str
    obj: Any
    axis: int = -1


def is_dependent(t, x: torch.Tensor) -> bool:
    """Whether x's value depends on the graph inputs (else its eager value holds for every input)."""
    v = t.values.get(id(x))
    return v is not None and v in t.dependent


def _as_tensor_entry(t, obj: Any) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    flat = np.asarray(obj, dtype=object).reshape(-1)
    if any(isinstance(o, torch.Tensor) for o in flat):
        raise UnsupportedOpError(f"{t.where()}: an index list holding tensors is not supported; "
                                 "index with one tensor (torch.stack the list)")
    return torch.tensor(obj)


def _classify(t, obj: Any) -> Entry:
    if obj is None:
        return Entry("none", None)
    if obj is Ellipsis:
        return Entry("ellipsis", None)
    if isinstance(obj, slice):
        for bound in (obj.start, obj.stop, obj.step):
            if isinstance(bound, torch.Tensor):
                raise UnsupportedOpError(f"{t.where()}: a slice bound read from a tensor is data dependent; "
                                         "use a Python int or a size (x.size(i))")
        return Entry("slice", obj)
    if isinstance(obj, bool):
        raise UnsupportedOpError(f"{t.where()}: indexing with a Python bool is not supported")
    if isinstance(obj, int):
        return Entry("int", obj)
    return Entry("tensor", _as_tensor_entry(t, obj))


def _mask_to_indices(t, e: Entry) -> list[Entry]:
    """A bool mask -> one int index per masked axis (its nonzero positions), when the count is static."""
    mask = e.obj
    if mask.dim() == 0:
        raise UnsupportedOpError(f"{t.where()}: indexing with a 0-d bool tensor is not supported")
    if is_dependent(t, mask):
        raise UnsupportedOpError(
            f"{t.where()}: x[mask] with a bool mask computed from the inputs has a data-dependent length, "
            "which kiln graphs cannot express; use torch.where(mask, x, fill) or multiply by the mask")
    return [Entry("tensor", col) for col in mask.nonzero().unbind(1)]


def parse_index(t, x: torch.Tensor, index: Any) -> list[Entry]:
    """The entries of ``x[index]``, Ellipsis expanded, constant masks as int indices, axes assigned."""
    items = index if isinstance(index, tuple) else (index,)
    entries = [_classify(t, obj) for obj in items]
    expanded = []
    for e in entries:
        is_mask = e.kind == "tensor" and e.obj.dtype in (torch.bool, torch.uint8)
        expanded.extend(_mask_to_indices(t, e) if is_mask else [e])
    used = sum(1 for e in expanded if e.kind in ("slice", "int", "tensor"))
    out = []
    for e in expanded:
        if e.kind == "ellipsis":
            out.extend(Entry("slice", slice(None)) for _ in range(x.dim() - used))
        else:
            out.append(e)
    if not any(e.kind == "ellipsis" for e in expanded):
        out.extend(Entry("slice", slice(None)) for _ in range(x.dim() - used))
    axis = 0
    for e in out:
        if e.kind != "none":
            e.axis = axis
            axis += 1
    return out


def is_full(s: slice) -> bool:
    plain = not isinstance(s.start, SymInt) and not isinstance(s.stop, SymInt)
    return plain and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def slice_bounds(s: slice) -> tuple:
    return (0 if s.start is None else s.start, END if s.stop is None else s.stop, 1 if s.step is None else s.step)


# ---------------------------------------------------------------------------- __getitem__
def apply_slices(t, v, entries: list[Entry]):
    sliced = [e for e in entries if e.kind == "slice" and not is_full(e.obj)]
    if not sliced:
        return v
    bounds = [slice_bounds(e.obj) for e in sliced]
    return t.emit("Slice", v, t.shape_value([b[0] for b in bounds]), t.shape_value([b[1] for b in bounds]),
                  axes_value(t, [e.axis for e in sliced]), t.shape_value([b[2] for b in bounds]))


def apply_ints(t, v, entries: list[Entry]):
    """A Gather per int index, last axis first so the earlier axes keep their numbers."""
    for e in sorted((e for e in entries if e.kind == "int"), key=lambda e: -e.axis):
        v = t.emit("Gather", v, t.int_value(e.obj), axis=e.axis)
    return v


def index_value(t, idx: torch.Tensor, dim: Any):
    """An int64 index tensor with negative entries wrapped (``idx + dim`` where ``idx < 0``)."""
    v = t.value(idx, DType.INT64)
    if not is_dependent(t, idx) and bool((idx >= 0).all()):
        return v
    size = t.int_value(dim)
    wrapped = t.emit("Add", v, size)
    return t.emit("Where", t.emit("Less", v, t.scalar(0)), wrapped, v)


def gather_tensors(t, input: torch.Tensor, v, entries: list[Entry]):
    """Apply the tensor indices to v (slices and ints already applied): a Gather, on one axis or
    on the adjacent indexed axes merged into one. Non-adjacent tensor indices put their dims
    first (torch/numpy's rule), so v is transposed to bring those axes to the front."""
    kept = [e for e in entries if e.kind in ("slice", "tensor")]  # the axes of v, in order
    pos = [i for i, e in enumerate(kept) if e.kind == "tensor"]
    if pos != list(range(pos[0], pos[0] + len(pos))):
        perm = pos + [i for i in range(len(kept)) if i not in pos]
        v = t.emit("Transpose", v, perm=perm)
        kept = [kept[i] for i in perm]
        pos = list(range(len(pos)))
    if len(pos) == 1:
        return t.emit("Gather", v, t.value(kept[pos[0]].obj), axis=pos[0])
    return _gather_merged(t, v, kept, pos, input)


def _gather_merged(t, v, kept: list[Entry], pos: list[int], input: torch.Tensor):
    """Several adjacent tensor indices: merge their axes into one and Gather the flat index."""
    p, k = pos[0], len(pos)
    sizes = [dim_of(t, input, kept[i].axis) for i in pos]  # tensor-indexed axes are never sliced
    flat = index_value(t, kept[p].obj, sizes[0])
    for i, size in zip(pos[1:], sizes[1:]):
        flat = t.emit("Add", t.emit("Mul", flat, t.int_value(size)), index_value(t, kept[i].obj, size))
    # [the leading dims (0 copies them), the merged axes (-1), the trailing dims of v as they are]
    shape = t.emit("Concat", t.constant(np.array([0] * p + [-1], np.int64), "shape"),
                   t.emit("Shape", v, start=p + k), axis=0)
    return t.emit("Gather", t.emit("Reshape", v, shape), flat, axis=p)


def new_axes(entries: list[Entry], advanced_rank: int) -> list[int]:
    """Output positions of the Nones (the tensor indices' dims sit where the first one was)."""
    out, pos, seen_tensor = [], 0, False
    for e in entries:
        if e.kind == "none":
            out.append(pos)
            pos += 1
        elif e.kind == "slice":
            pos += 1
        elif e.kind == "tensor" and not seen_tensor:
            pos += advanced_rank
            seen_tensor = True
    return out


@maps(torch.Tensor.__getitem__)
def getitem(t, res, input, index):
    entries = parse_index(t, input, index)
    tensors = [e.obj for e in entries if e.kind == "tensor"]
    nones = [e for e in entries if e.kind == "none"]
    v = apply_ints(t, apply_slices(t, t.value(input), entries), entries)
    advanced_rank = 0
    if tensors:
        v = gather_tensors(t, input, v, entries)
        advanced_rank = len(torch.broadcast_shapes(*(x.shape for x in tensors)))
        if nones and _tensors_split(entries):
            raise UnsupportedOpError(f"{t.where()}: None together with non-adjacent tensor indices is not supported")
    if nones:
        v = t.emit("Unsqueeze", v, axes_value(t, new_axes(entries, advanced_rank)))
    return v


def _tensors_split(entries: list[Entry]) -> bool:
    kinds = [e.kind for e in entries if e.kind in ("slice", "tensor")]
    first = kinds.index("tensor")
    last = len(kinds) - 1 - kinds[::-1].index("tensor")
    return "slice" in kinds[first:last]


# ---------------------------------------------------------------------------- named indexing ops
@maps(torch.gather, torch.Tensor.gather)
def gather(t, res, input, dim, index, *, sparse_grad=False, out=None):
    d = norm_dim(dim, input.dim())
    v = t.value(input)
    short = [i for i in range(input.dim()) if i != d and index.shape[i] != input.shape[i]]
    if short:
        # torch lets the index be smaller off the gather axis; GatherElements wants equal sizes.
        ends = t.emit("Gather", t.emit("Shape", t.value(index)), t.constant(np.array(short, np.int64)))
        v = t.emit("Slice", v, t.constant(np.zeros(len(short), np.int64)), ends, axes_value(t, short))
    return t.emit("GatherElements", v, t.value(index), axis=d)


@maps(torch.index_select, torch.Tensor.index_select)
def index_select(t, res, input, dim, index, *, out=None):
    idx = t.value(index)
    if index.dim() == 0:
        idx = t.emit("Unsqueeze", idx, axes_value(t, [0]))  # a 0-d index keeps the dim in torch
    return t.emit("Gather", t.value(input), idx, axis=norm_dim(dim, input.dim()))


@maps(torch.select, torch.Tensor.select)
def select(t, res, input, dim, index):
    return t.emit("Gather", t.value(input), t.int_value(index), axis=norm_dim(dim, input.dim()))


@maps(torch.masked_select, torch.Tensor.masked_select)
def masked_select(t, res, input, mask, *, out=None):
    raise UnsupportedOpError(
        f"{t.where()}: 'masked_select' returns as many elements as the mask has True values, a data-dependent "
        "length kiln graphs cannot express; use torch.where(mask, x, fill) instead")


def _trilu(upper: int, *funcs):
    @maps(*funcs)
    def handler(t, res, input, diagonal=0, *, out=None):
        return t.emit("Trilu", t.value(input), t.int_value(diagonal), upper=upper)

    handler.__name__ = "triu" if upper else "tril"
    return handler


_trilu(0, torch.tril, torch.Tensor.tril, torch.Tensor.tril_)
_trilu(1, torch.triu, torch.Tensor.triu, torch.Tensor.triu_)


# ---------------------------------------------------------------------------- flip / roll
def flip_value(t, v, dims: list[int]):
    n = len(dims)
    return t.emit("Slice", v, t.shape_value([-1] * n), t.shape_value([BEFORE_START] * n), axes_value(t, dims),
                  t.shape_value([-1] * n))


@maps(torch.flip, torch.Tensor.flip)
def flip(t, res, input, *dims):
    dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else list(dims)
    if not dims:
        return t.value(input)
    return flip_value(t, t.value(input), [norm_dim(d, input.dim()) for d in dims])


@maps(torch.fliplr, torch.Tensor.fliplr)
def fliplr(t, res, input):
    return flip_value(t, t.value(input), [1])


@maps(torch.flipud, torch.Tensor.flipud)
def flipud(t, res, input):
    return flip_value(t, t.value(input), [0])


def roll_axis(t, v, size: Any, shift: int, d: int):
    """Roll v by ``shift`` along axis d of ``size`` (int or SymInt): x[k:] ++ x[:k] with
    k = (-shift) mod size, computed on the runtime size when it is symbolic."""
    if not isinstance(size, SymInt) and size == 0:
        return v
    if shift >= 0:
        k = size - (shift - (shift // size) * size)
    else:
        k = -shift - ((-shift) // size) * size
    if not isinstance(k, SymInt) and k % size == 0:
        return v
    axis = axes_value(t, [d])
    head = t.emit("Slice", v, t.shape_value([k]), t.shape_value([END]), axis)
    tail = t.emit("Slice", v, t.shape_value([0]), t.shape_value([k]), axis)
    return t.emit("Concat", head, tail, axis=d)


@maps(torch.roll, torch.Tensor.roll)
def roll(t, res, input, shifts, dims=None):
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    if dims is None:
        flat = t.emit("Reshape", t.value(input), t.shape_value([-1]))
        size = numel(t, input.numel(), input)
        rolled = roll_axis(t, flat, size, shifts[0], 0)
        return t.emit("Reshape", rolled, t.emit("Shape", t.value(input)))
    dims = [dims] if isinstance(dims, int) else list(dims)
    v = t.value(input)
    for shift, d in zip(shifts, dims):
        d = norm_dim(d, input.dim())
        v = roll_axis(t, v, dim_of(t, input, d), shift, d)
    return v
