"""Shape ops as views, with constant operands (target shapes, axes, a weight to transpose)
decoded once at load. A transposed constant weight is made once: feeding MatMul, it costs
nothing per run (BLAS reads the transposed view)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.ir.ops.shape import _chunks
from kiln.runtime.kernels.cpu.linalg import const_input


@kernel("Transpose")
def transpose(node, attrs) -> Callable[..., Any]:
    perm = attrs["perm"]
    fixed = const_input(node, 0)
    if fixed is not None:
        view = np.transpose(fixed, perm)
        return lambda x: view
    return lambda x: x.transpose(perm)


@kernel("Reshape")
def reshape(node, attrs) -> Callable[..., Any]:
    target = const_input(node, 1)
    allowzero = attrs["allowzero"]
    if target is None:
        # A target computed at run time (Shape -> Gather -> Concat under a dynamic batch): the reference's rule in
        # one list pass; through the reference's wrapper each of a ViT-style model's 33 Reshapes took 2 us.
        def computed(x, shape):
            t = shape.tolist()
            if not allowzero and 0 in t:
                t = [x.shape[i] if s == 0 else s for i, s in enumerate(t)]
            return x.reshape(t)
        return computed
    shape = tuple(int(s) for s in target)
    if 0 in shape and not allowzero:
        # 0 copies the input's dim at that index (a -1 elsewhere is then inferred by numpy, as the reference does)
        zeros = tuple(i for i, s in enumerate(shape) if s == 0)

        def copying_dims(x, unused):
            t = list(shape)
            dims = x.shape
            for i in zeros:
                t[i] = dims[i]
            return x.reshape(t)
        return copying_dims
    return lambda x, unused: x.reshape(shape)


@kernel("Flatten")
def flatten(node, attrs) -> Callable[..., Any]:
    """x.reshape(outer, inner) as the reference computes it: a view of a contiguous x. (Unregistered,
    Flatten ran the reference itself, whose two np.prod calls on the shape cost about 10 us.)"""
    axis = attrs["axis"]

    def run(x):
        shape = x.shape
        a = axis + len(shape) if axis < 0 else axis
        return x.reshape(math.prod(shape[:a]), math.prod(shape[a:]))
    return run


def _const_axes(node) -> Any:
    axes = const_input(node, 1)
    return None if axes is None else tuple(int(a) for a in axes.reshape(-1))


@kernel("Squeeze")
def squeeze(node, attrs) -> Callable[..., Any]:
    axes = _const_axes(node)
    if axes is None:
        return reference_kernel(node, attrs)
    return lambda x, unused: np.squeeze(x, axis=axes)


@kernel("Unsqueeze")
def unsqueeze(node, attrs) -> Callable[..., Any]:
    axes = _const_axes(node)
    if axes is None:
        return reference_kernel(node, attrs)
    x_type = node.inputs[0].type
    rank = None if x_type is None or x_type.shape is None else len(x_type.shape)
    out_rank = None if rank is None else rank + len(axes)
    places = None if out_rank is None else sorted(a % out_rank for a in axes)
    if places is None or len(set(places)) != len(places):
        return lambda x, unused: np.expand_dims(x, axes)  # raises what the reference raises on repeated axes

    def run(x, unused):  # a reshape with the ones put in (np.expand_dims's checks cost about 2 us a call)
        if x.ndim != rank:
            return np.expand_dims(x, axes)
        shape = list(x.shape)
        for p in places:
            shape.insert(p, 1)
        return x.reshape(shape)
    return run


@kernel("Expand")
def expand(node, attrs) -> Callable[..., Any]:
    """The reference's broadcast and copy without its wrapper (a ViT's class token expanded over the batch: 9 us
    a call through it). A copy, as the reference's: a consumer may write into it."""
    def run(x, shape):
        out = np.empty(np.broadcast_shapes(x.shape, tuple(shape.tolist())), x.dtype)
        np.copyto(out, x)
        return out
    return run


@kernel("Gather")
def gather(node, attrs) -> Callable[..., Any]:
    axis = attrs["axis"]
    index = const_input(node, 1)
    if index is None:
        def computed(data, indices):
            # A 0-d index computed at run time (a Loop's step counter picking one time step):
            # a view, as for a constant one; np.take would copy the whole slice.
            if indices.ndim == 0:
                return _pick(data, int(indices), axis)
            # np.take raises on out-of-range indices and wraps negative ones, as Gather does.
            return np.take(data, indices, axis=axis)
        return computed
    if index.ndim != 0:
        return lambda data, indices: np.take(data, indices, axis=axis)
    i = int(index)
    return lambda data, unused: _pick(data, i, axis)


def _pick(data: np.ndarray, i: int, axis: int) -> np.ndarray:
    """Gather of one scalar index: a view, no copy (the Ellipsis keeps a 0-d result an array)."""
    if not -data.shape[axis] <= i < data.shape[axis]:
        raise IndexError(f"index {i} out of range [-{data.shape[axis]}, {data.shape[axis]}) on axis {axis}")
    return data[(slice(None),) * (axis % data.ndim) + (i, Ellipsis)]


@kernel("Split")
def split(node, attrs) -> Callable[..., Any]:
    """Views of the parts, their bounds worked out once when the split sizes are constants (or
    ``num_outputs``) and the axis is static: np.split's own bookkeeping cost 25 us a call, more
    than the rest of an LSTM step's gate math."""
    axis, n = attrs["axis"], attrs["num_outputs"]
    has_sizes = len(node.inputs) > 1 and node.inputs[1] is not None
    sizes = const_input(node, 1)
    x_type = node.inputs[0].type
    if (has_sizes and sizes is None) or x_type is None or x_type.shape is None:
        return reference_kernel(node, attrs)
    rank = len(x_type.shape)
    ax = axis % rank
    dim = x_type.shape[ax]
    if not isinstance(dim, int):
        return reference_kernel(node, attrs)
    parts = [int(s) for s in sizes.reshape(-1)] if has_sizes else _chunks(dim, n)
    if sum(parts) != dim or min(parts) < 0:
        return reference_kernel(node, attrs)  # the reference raises the error
    ends = np.cumsum(parts).tolist()
    index = tuple((slice(None),) * ax + (slice(e - k, e),) for k, e in zip(parts, ends))

    def run(x, unused=None):
        return tuple(x[i] for i in index)
    return run


@kernel("Concat")
def concat(node, attrs) -> Callable[..., Any]:
    axis = attrs["axis"]
    return lambda *xs: np.concatenate(xs, axis=axis)


@kernel("Shape")
def shape(node, attrs) -> Callable[..., Any]:
    start, end = attrs["start"], attrs["end"]
    return lambda x: np.array(x.shape[start:end], dtype=np.int64)
