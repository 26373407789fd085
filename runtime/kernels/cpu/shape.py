"""Shape ops as views, with constant operands (target shapes, axes, a weight to transpose)
decoded once at load. A transposed constant weight is made once: feeding MatMul, it costs
nothing per run (BLAS reads the transposed view)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kiln.runtime.kernels.cpu import kernel, reference_kernel
from kiln.runtime.kernels.cpu.linalg import const_input


@kernel("Transpose")
def transpose(node, attrs) -> Callable[..., Any]:
    perm = attrs["perm"]
    fixed = const_input(node, 0)
    if fixed is not None:
        view = np.transpose(fixed, perm)
        return lambda x: view
    return lambda x: np.transpose(x, perm)


@kernel("Reshape")
def reshape(node, attrs) -> Callable[..., Any]:
    target = const_input(node, 1)
    if target is None or (0 in target and not attrs["allowzero"]):
        return reference_kernel(node, attrs)
    shape = tuple(int(s) for s in target)
    return lambda x, unused: x.reshape(shape)


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
    return lambda x, unused: np.expand_dims(x, axes)


@kernel("Gather")
def gather(node, attrs) -> Callable[..., Any]:
    axis = attrs["axis"]
    index = const_input(node, 1)
    if index is None or index.ndim != 0:
        # np.take raises on out-of-range indices and wraps negative ones, as Gather does.
        return lambda data, indices: np.take(data, indices, axis=axis)
    i = int(index)

    def run(data, unused):
        if not -data.shape[axis] <= i < data.shape[axis]:
            raise IndexError(f"index {i} out of range [-{data.shape[axis]}, {data.shape[axis]}) on axis {axis}")
        # A scalar index selects a view, no copy (the Ellipsis keeps a 0-d result an array).
        return data[(slice(None),) * (axis % data.ndim) + (i, Ellipsis)]
    return run


@kernel("Concat")
def concat(node, attrs) -> Callable[..., Any]:
    axis = attrs["axis"]
    return lambda *xs: np.concatenate(xs, axis=axis)


@kernel("Shape")
def shape(node, attrs) -> Callable[..., Any]:
    start, end = attrs["start"], attrs["end"]
    return lambda x: np.array(x.shape[start:end], dtype=np.int64)
