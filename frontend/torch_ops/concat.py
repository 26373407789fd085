"""Joining and splitting: cat/concat/concatenate, stack, split, chunk, unbind, tensor_split and
hsplit/vsplit/dsplit.

The number of pieces a split makes is fixed in the graph (it is the number of tensors the
model gets back); their sizes stay symbolic where torch's rule allows it (ONNX Split's
``num_outputs`` rounds like ``chunk``), and splitting a symbolic dim by anything that needs
its example size raises UnsupportedOpError instead of baking that size in.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.shape import axes_value, is_static, norm_dim
from kiln.frontend.tracer import kiln_dtype


# ---------------------------------------------------------------------------- cat / stack
def concat_values(t, res: torch.Tensor, tensors: Sequence[torch.Tensor], dim: int):
    # torch.cat skips legacy empty 1-D tensors (shape (0,)) next to tensors of another rank.
    parts = [x for x in tensors if not (x.dim() == 1 and x.shape[0] == 0 and res.dim() != 1)]
    dt = kiln_dtype(res.dtype)  # cat promotes mixed dtypes
    values = [t.value(x, dt) for x in parts]
    if len(values) == 1:
        return values[0]
    return t.emit("Concat", *values, axis=norm_dim(dim, res.dim()))


@maps(torch.cat, torch.concat)
def cat(t, res, tensors, dim=0, *, out=None):
    return concat_values(t, res, tensors, dim)


@maps(torch.concatenate)
def concatenate(t, res, tensors, axis=0, *, out=None):
    return concat_values(t, res, tensors, axis)


@maps(torch.stack)
def stack(t, res, tensors, dim=0, *, out=None):
    d = norm_dim(dim, res.dim())
    dt = kiln_dtype(res.dtype)
    parts = [t.emit("Unsqueeze", t.value(x, dt), axes_value(t, [d])) for x in tensors]
    if len(parts) == 1:
        return parts[0]
    return t.emit("Concat", *parts, axis=d)


# ---------------------------------------------------------------------------- split family
def split_by(t, input: torch.Tensor, sizes: Sequence, d: int):
    """Split along d into pieces of the given sizes (ints or SymInts)."""
    if len(sizes) == 1:
        return (t.value(input),)
    out = t.emit("Split", t.value(input), t.shape_value(sizes), axis=d, outputs=len(sizes))
    return tuple(out)


# A model that iterates over a symbolic dim (a list of images: `for img in images.unbind(0)`, detection models)
# runs its Python loop once per item of the example: the graph would hold that many copies (issue 24, item 4).
_FIXED_SIZE_HINT = (". A Python loop over that dim runs once per item of the example, so it cannot follow the "
                    "size at run time: export with that dim fixed (kiln.trace without dynamic_batch=True and "
                    "without it in dynamic=; `kiln export` without --dynamic-batch/--dynamic for it), one model per "
                    "size you serve, or write the per-item code batched")


def _dim_name(t, input, d: int) -> str:
    shape = getattr(getattr(t.value(input), "type", None), "shape", None)
    dim = shape[d] if shape is not None and d < len(shape) else None
    return f"'{dim}'" if isinstance(dim, str) else "unknown size"


def split_like_result(t, name: str, res: Sequence[torch.Tensor], input: torch.Tensor, d: int):
    """Split with the sizes torch's pieces have: only when the dim is static in the graph."""
    if not is_static(t, input, d):
        raise UnsupportedOpError(
            f"{t.where()}: '{name}' of dim {d}, which is symbolic ({_dim_name(t, input, d)}), makes pieces whose "
            f"sizes (and number) depend on the dim's size; split a static dim, or give explicit sizes with "
            f"torch.split{_FIXED_SIZE_HINT}")
    return split_by(t, input, [r.shape[d] for r in res], d)


@maps(torch.split, torch.Tensor.split, torch.unsafe_split, torch.Tensor.unsafe_split)
def split(t, res, tensor, split_size_or_sections, dim=0):
    d = norm_dim(dim, tensor.dim())
    if isinstance(split_size_or_sections, (list, tuple)):
        return split_by(t, tensor, list(split_size_or_sections), d)
    return split_like_result(t, "split", res, tensor, d)


@maps(torch.split_with_sizes, torch.Tensor.split_with_sizes, torch.unsafe_split_with_sizes,
      torch.Tensor.unsafe_split_with_sizes)
def split_with_sizes(t, res, input, split_sizes, dim=0):
    return split_by(t, input, list(split_sizes), norm_dim(dim, input.dim()))


@maps(torch.chunk, torch.Tensor.chunk, torch.unsafe_chunk, torch.Tensor.unsafe_chunk)
def chunk(t, res, input, chunks, dim=0):
    d = norm_dim(dim, input.dim())
    if is_static(t, input, d):
        return split_by(t, input, [r.shape[d] for r in res], d)
    if len(res) != chunks:
        raise UnsupportedOpError(
            f"{t.where()}: 'chunk' of symbolic dim {d} into {chunks} gives {len(res)} pieces for this example; "
            "the number of pieces would change with the dim's size")
    if chunks == 1:
        return (t.value(input),)
    # ONNX's num_outputs split is torch's chunk rule (ceil(n / chunks) each, the last smaller).
    return tuple(t.emit("Split", t.value(input), axis=d, num_outputs=chunks, outputs=chunks))


@maps(torch.tensor_split, torch.Tensor.tensor_split)
def tensor_split(t, res, input, indices_or_sections=None, dim=0, *, indices=None, sections=None,
                 tensor_indices_or_sections=None):
    # torch's overloads name the second argument indices=, sections= or tensor_indices_or_sections=.
    given = [a for a in (indices_or_sections, indices, sections, tensor_indices_or_sections) if a is not None]
    indices_or_sections = given[0] if given else None
    if isinstance(indices_or_sections, torch.Tensor):
        raise UnsupportedOpError(f"{t.where()}: 'tensor_split' by a tensor of indices is not supported; "
                                 "pass a Python int or list")
    d = norm_dim(dim, input.dim())
    if isinstance(indices_or_sections, (list, tuple)) and not is_static(t, input, d):
        # Split points on a symbolic dim: pieces x[:i0], x[i0:i1], ..., x[ik:] (Python slice rules,
        # negative points included), which do not depend on the dim's size.
        from kiln.frontend.torch_ops.indexing import END

        bounds = [0, *indices_or_sections, END]
        v, axis = t.value(input), axes_value(t, [d])
        return tuple(t.emit("Slice", v, t.shape_value([a]), t.shape_value([b]), axis)
                     for a, b in zip(bounds, bounds[1:]))
    return split_like_result(t, "tensor_split", res, input, d)


def _directional(name: str, dim_for_rank, *funcs):
    @maps(*funcs)
    def handler(t, res, input, indices_or_sections):
        return split_like_result(t, name, res, input, dim_for_rank(input.dim()))

    handler.__name__ = name
    return handler


_directional("hsplit", lambda rank: 1 if rank > 1 else 0, torch.hsplit, torch.Tensor.hsplit)
_directional("vsplit", lambda rank: 0, torch.vsplit, torch.Tensor.vsplit)
_directional("dsplit", lambda rank: 2, torch.dsplit, torch.Tensor.dsplit)


@maps(torch.unbind, torch.Tensor.unbind)
def unbind(t, res, input, dim=0):
    d = norm_dim(dim, input.dim())
    if not is_static(t, input, d):
        raise UnsupportedOpError(f"{t.where()}: 'unbind' of dim {d}, which is symbolic ({_dim_name(t, input, d)}), "
                                 f"gives a number of tensors that depends on its size{_FIXED_SIZE_HINT}")
    v = t.value(input)
    axis = axes_value(t, [d])
    if len(res) == 0:
        return ()
    if len(res) == 1:
        return (t.emit("Squeeze", v, axis),)
    parts = t.emit("Split", v, t.constant(np.ones(len(res), np.int64), "split"), axis=d, outputs=len(res))
    return tuple(t.emit("Squeeze", p, axis) for p in parts)
