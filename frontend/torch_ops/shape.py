"""Shape and view mappings: flatten/unflatten, permute/transpose, squeeze/unsqueeze, expand,
repeat/tile/repeat_interleave, movedim, narrow, view_as, numel. (view/reshape/size/shape live in
core.py; cat/stack/split/chunk/unbind in concat.py.)

Dims that are symbolic in the graph stay symbolic: sizes come from ``dims_of`` (ints where the
IR dim is static, SymInts computing the dim otherwise), and reshapes keep leading dims with
ONNX's ``0`` (copy the input dim) and let one ``-1`` absorb the rest where they can.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of


# ---------------------------------------------------------------------------- helpers
def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def axes_value(t, axes: Sequence[int]):
    """A constant int64 axes input (Squeeze, Unsqueeze, Slice, ...)."""
    return t.constant(np.array(list(axes), np.int64), "axes")


def ir_dims(t, x: torch.Tensor) -> tuple:
    """The dims of x in the graph: ints where static, a symbol or None where not."""
    shape = t.value(x).type.shape
    return tuple(shape) if shape is not None else (None,) * x.dim()


def is_static(t, x: torch.Tensor, i: int) -> bool:
    return isinstance(ir_dims(t, x)[i], int)


def dims_of(t, x: torch.Tensor, start: int = 0, end: Optional[int] = None) -> list:
    """Sizes start..end of x: ints where the graph knows them, SymInts computing them otherwise."""
    return [dim_of(t, x, i) for i in range(start, x.dim() if end is None else end)]


def sizes_arg(sizes: Sequence[Any]) -> list:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])`` and ``f(torch.Size)`` all mean sizes [2, 3]."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        return list(sizes[0])
    return list(sizes)


def product(dims: Sequence[Any]) -> Any:
    out = 1
    for d in dims:
        out = out * d  # SymInt arithmetic records the product when a dim is symbolic
    return out


def reshape_keep(t, x: torch.Tensor, lead: int, rest: Sequence[Any]):
    """Reshape x to its first ``lead`` dims followed by ``rest`` (ints/SymInts, at most one -1).

    The lead dims are ONNX ``0`` (copy the input dim), so a symbolic batch needs no Shape op.
    An empty tensor cannot use 0/-1 (0 is ambiguous there): its shape is written out."""
    if x.numel() == 0:
        explicit = dims_of(t, x, 0, lead) + list(rest)
        if -1 in [d for d in explicit if not isinstance(d, SymInt)]:
            raise UnsupportedOpError(f"{t.where()}: a reshape with -1 of an empty tensor is ambiguous")
        return t.emit("Reshape", t.value(x), t.shape_value(explicit), allowzero=1)
    return t.emit("Reshape", t.value(x), t.shape_value([0] * lead + list(rest)))


# ---------------------------------------------------------------------------- flatten / unflatten
@maps(torch.flatten, torch.Tensor.flatten)
def flatten(t, res, input, start_dim=0, end_dim=-1):
    rank = input.dim()
    if rank == 0:
        return t.emit("Reshape", t.value(input), t.shape_value([1]))
    s, e = norm_dim(start_dim, rank), norm_dim(end_dim, rank)
    if s == e:
        return t.value(input)
    if s == 1 and e == rank - 1:
        return t.emit("Flatten", t.value(input), axis=1)  # ONNX Flatten is 2-D: only this case matches
    tail = dims_of(t, input, e + 1)
    return reshape_keep(t, input, s, [-1] + tail)


@maps(torch.unflatten, torch.Tensor.unflatten)
def unflatten(t, res, input, dim, sizes):
    d = norm_dim(dim, input.dim())
    sizes = list(sizes)
    if input.numel() == 0:
        sizes = [res.shape[d + i] if s == -1 else s for i, s in enumerate(sizes)]
    return reshape_keep(t, input, d, sizes + dims_of(t, input, d + 1))


# ---------------------------------------------------------------------------- transposes
@maps(torch.permute, torch.Tensor.permute)
def permute(t, res, input, *dims):
    rank = input.dim()
    return t.emit("Transpose", t.value(input), perm=[norm_dim(d, rank) for d in sizes_arg(dims)])


def swap(t, x: torch.Tensor, a: int, b: int):
    rank = x.dim()
    if rank < 2:
        return t.value(x)
    perm = list(range(rank))
    a, b = norm_dim(a, rank), norm_dim(b, rank)
    perm[a], perm[b] = perm[b], perm[a]
    return t.emit("Transpose", t.value(x), perm=perm)


@maps(torch.transpose, torch.Tensor.transpose, torch.Tensor.transpose_, torch.swapaxes, torch.Tensor.swapaxes,
      torch.Tensor.swapaxes_, torch.swapdims, torch.Tensor.swapdims, torch.Tensor.swapdims_)
def transpose(t, res, input, dim0, dim1):
    return swap(t, input, dim0, dim1)


@maps(torch.t, torch.Tensor.t, torch.Tensor.t_)
def t_(t, res, input):
    return swap(t, input, 0, 1)


@maps(torch.Tensor.T.__get__, torch.Tensor.H.__get__)
def reverse_dims(t, res, input):
    if input.dim() < 2:
        return t.value(input)
    return t.emit("Transpose", t.value(input), perm=list(reversed(range(input.dim()))))


@maps(torch.Tensor.mT.__get__, torch.Tensor.mH.__get__, torch.adjoint, torch.Tensor.adjoint)
def matrix_transpose(t, res, input):
    return swap(t, input, -2, -1)  # real tensors only (kiln has no complex dtypes): mH == mT


@maps(torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis)
def movedim(t, res, input, source, destination):
    rank = input.dim()
    src = [norm_dim(d, rank) for d in ([source] if isinstance(source, int) else source)]
    dst = [norm_dim(d, rank) for d in ([destination] if isinstance(destination, int) else destination)]
    perm: list = [None] * rank
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    perm = [next(rest) if p is None else p for p in perm]
    return t.emit("Transpose", t.value(input), perm=perm)


# ---------------------------------------------------------------------------- squeeze / unsqueeze
def squeezable(t, name: str, x: torch.Tensor, dims: Sequence[int]) -> list[int]:
    """The dims among ``dims`` that torch squeezes (size 1 in the example).

    A size-1 dim that is symbolic in the graph (a dynamic batch traced at batch 1) would be
    squeezed at every batch size: refuse rather than emit a graph that fails at batch 4."""
    graph_dims = ir_dims(t, x)
    out = []
    for d in dims:
        if x.shape[d] != 1:
            continue
        if not isinstance(graph_dims[d], int):
            raise UnsupportedOpError(
                f"{t.where()}: '{name}' squeezes dim {d}, which is symbolic ({graph_dims[d]}) and only 1 in the "
                "example; trace with a size other than 1 there, or squeeze a static dim")
        out.append(d)
    return out


def _squeeze_dims(dim, rank: int):
    if dim is None:
        return range(rank)
    return [norm_dim(d, rank) for d in ([dim] if isinstance(dim, int) else dim)]


@maps(torch.squeeze, torch.Tensor.squeeze)
def squeeze(t, res, input, dim=None):
    """Without dims, torch squeezes every size-1 dim: the graph squeezes those that are static,
    so at a symbolic size of 1 (batch 1) the graph keeps a dim that torch would drop."""
    axes = squeezable(t, "squeeze", input, _squeeze_dims(dim, input.dim()))
    if not axes:
        return t.value(input)
    return t.emit("Squeeze", t.value(input), axes_value(t, axes))


@maps(torch.Tensor.squeeze_)
def squeeze_(t, res, input, dim=None):
    # The handler runs after torch's in-place call: input has lost its dims already, so the
    # squeezed ones are read from the graph's shape of the value before the call.
    before = ir_dims(t, input)
    ones = [d for d in _squeeze_dims(dim, len(before)) if before[d] == 1]
    if len(ones) != len(before) - input.dim():
        raise UnsupportedOpError(f"{t.where()}: 'squeeze_' of a dim whose size is not static in the graph is not "
                                 "supported; write x = x.squeeze(dim)")
    if not ones:
        return t.value(input)
    return t.emit("Squeeze", t.value(input), axes_value(t, ones))


@maps(torch.unsqueeze, torch.Tensor.unsqueeze)
def unsqueeze(t, res, input, dim):
    return t.emit("Unsqueeze", t.value(input), axes_value(t, [norm_dim(dim, input.dim() + 1)]))


@maps(torch.Tensor.unsqueeze_)
def unsqueeze_(t, res, input, dim):
    # After torch's in-place call input already has the new dim: its rank is the output rank.
    return t.emit("Unsqueeze", t.value(input), axes_value(t, [norm_dim(dim, input.dim())]))


# ---------------------------------------------------------------------------- expand / repeat
@maps(torch.Tensor.expand)
def expand(t, res, input, *sizes, implicit=False):
    sizes = sizes_arg(sizes)
    # Expand broadcasts: a 1 keeps the input dim, exactly what torch's -1 means.
    target = [1 if not isinstance(s, SymInt) and s == -1 else s for s in sizes]
    return t.emit("Expand", t.value(input), t.shape_value(target))


@maps(torch.broadcast_to, torch.Tensor.broadcast_to)
def broadcast_to(t, res, input, size):
    return expand(t, res, input, size)


@maps(torch.Tensor.expand_as)
def expand_as(t, res, input, other):
    return t.emit("Expand", t.value(input), t.emit("Shape", t.value(other)))


def tile_value(t, x: torch.Tensor, reps: list):
    """Tile x by ``reps``; leading new dims (len(reps) > rank) are unsqueezed first."""
    v = t.value(x)
    extra = len(reps) - x.dim()
    if extra > 0:
        v = t.emit("Unsqueeze", v, axes_value(t, range(extra)))
    return t.emit("Tile", v, t.shape_value(reps))


@maps(torch.Tensor.repeat)
def repeat(t, res, input, *sizes):
    return tile_value(t, input, sizes_arg(sizes))


@maps(torch.tile, torch.Tensor.tile)
def tile(t, res, input, *dims):
    reps = sizes_arg(dims)
    return tile_value(t, input, [1] * (input.dim() - len(reps)) + reps)


@maps(torch.repeat_interleave, torch.Tensor.repeat_interleave)
def repeat_interleave(t, res, input, repeats=None, dim=None, *, output_size=None):
    """Each element (or slice along ``dim``) repeated: by an int (or SymInt) as Unsqueeze +
    Expand + Reshape; by a tensor of counts as a Gather of the indices they make, which needs
    the counts to be constants (counts computed from the inputs give a data-dependent size)."""
    if repeats is None:  # torch.repeat_interleave(counts): the indices 0, 0, 1, 2, 2, ...
        repeats, input, dim = input, torch.arange(input.numel()), 0
    x = t.value(input)
    if dim is None:
        x = t.emit("Reshape", x, t.shape_value([-1]))
        d, dims = 0, [product(dims_of(t, input))]
    else:
        d, dims = norm_dim(dim, input.dim()), dims_of(t, input)
    if isinstance(repeats, torch.Tensor) and repeats.numel() == 1 and t.value(repeats) not in t.dependent:
        repeats = int(repeats.reshape(()))
    if not isinstance(repeats, torch.Tensor):
        ones = [1] * len(dims)
        x = t.emit("Unsqueeze", x, axes_value(t, [d + 1]))
        x = t.emit("Expand", x, t.shape_value(ones[:d + 1] + [repeats] + ones[d + 1:]))
        return t.emit("Reshape", x, t.shape_value([0] * d + [-1] + dims[d + 1:]))
    if t.value(repeats) in t.dependent:
        raise UnsupportedOpError(f"{t.where()}: 'repeat_interleave' by counts computed from the inputs gives a "
                                 "size that depends on their values")
    if not isinstance(dims[d], int):
        raise UnsupportedOpError(f"{t.where()}: 'repeat_interleave' by a tensor of counts along dim {d}, which is "
                                 "symbolic (one count per element)")
    index = np.repeat(np.arange(dims[d], dtype=np.int64), repeats.detach().cpu().numpy().astype(np.int64))
    return t.emit("Gather", x, t.constant(index, "indices"), axis=d)


# ---------------------------------------------------------------------------- narrow, *_as, numel
@maps(torch.narrow, torch.Tensor.narrow, torch.narrow_copy, torch.Tensor.narrow_copy)
def narrow(t, res, input, dim, start, length):
    d = norm_dim(dim, input.dim())
    if isinstance(start, torch.Tensor):
        raise UnsupportedOpError(f"{t.where()}: 'narrow' with a tensor start is data dependent")
    if start < 0:
        start = dim_of(t, input, d) + start  # torch wraps a negative start once
    ends = t.shape_value([start + length])
    return t.emit("Slice", t.value(input), t.shape_value([start]), ends, axes_value(t, [d]))


@maps(torch.Tensor.view_as, torch.Tensor.reshape_as)
def view_as(t, res, input, other):
    return t.emit("Reshape", t.value(input), t.emit("Shape", t.value(other)))


@maps(torch.numel, torch.Tensor.numel, torch.Tensor.nelement, value=True)
def numel(t, res, input):
    """An int, or a SymInt (the Size of the tensor) when a dim is symbolic."""
    if all(isinstance(d, int) for d in ir_dims(t, input)):
        return res
    return SymInt(res, t, t.emit("Size", t.value(input)))
