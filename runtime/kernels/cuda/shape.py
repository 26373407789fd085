"""Shape, indexing, reduction and tensor-making ops on the GPU.

Most of these are the op's own numpy reference run on device arrays: the references use
numpy functions and array methods that CuPy implements under the same names, and numpy hands
a call with a CuPy argument to CuPy (NEP 18, ``__array_function__``/``__array_ufunc__``), so
``np.concatenate`` of CuPy arrays runs ``cupy.concatenate`` on the GPU. The references' shape
parameters (a Reshape's target, a Slice's starts) are read on the host (HOST_INPUTS). Where a
reference calls something CuPy lacks (``np.asarray`` of a device array, ``max(initial=)``),
``device_reference`` notices on the first call, switches that node to the host for good and
counts it as a fallback; the explicit kernels below cover the common ones of those.
"""
from __future__ import annotations

from typing import Any, Callable

import cupy as cp
import numpy as np

from kiln.ir.types import normalize_axis
from kiln.runtime.kernels.cuda import const_input, host, in_dtype, kernel, reduce_all

# op -> the input positions its reference reads as host parameters.
_REFERENCE_OPS = {
    "Reshape": (1,), "Flatten": (), "Transpose": (), "Squeeze": (1,), "Unsqueeze": (1,), "Concat": (),
    "Split": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "DepthToSpace": (), "SpaceToDepth": (),
    "Trilu": (1,), "GatherElements": (), "CumSum": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceProd": (1,),
    "ReduceL2": (1,), "TopK": (1,), "ScatterND": (1,), "Mod": (),
}
# DequantizeLinear: a kernel of its own (quant.py), this reference behind it for the rare forms.


def device_reference(node, attrs) -> Callable[..., Any]:
    """The op's numpy reference on device arrays (see the module docstring), with a switch to
    the host on the first call CuPy cannot serve."""
    ref = node.schema.reference
    single = len(node.outputs) == 1
    host_pos = set(_REFERENCE_OPS.get(node.op, ()))
    state = {"host": False}

    def call(args):
        out = ref(*args, **attrs)
        if single and isinstance(out, (tuple, list)):
            out = out[0]
        return out

    def run(*args):
        args = [host(a) if i in host_pos else a for i, a in enumerate(args)]
        device_error = None
        if not state["host"]:
            try:
                out = call(args)
                if _on_device(out):
                    return out
                device_error = "the reference returned host arrays"
            except Exception as e:  # noqa: BLE001 - the host call below decides: it raises the real errors
                device_error = f"{type(e).__name__}: {e}"
        # On the host. An error here is the op's own (bad inputs) and propagates; only a call that works
        # on the host after failing on the device switches this node to the host for good, and says why.
        out = call([a.get() if isinstance(a, cp.ndarray) else a for a in args])
        if not state["host"]:
            state["host"] = True
            run.fallback = True
            run.fallback_reason = device_error
        if isinstance(out, (tuple, list)):
            return tuple(cp.asarray(o) for o in out)
        return cp.asarray(out)
    run.fallback = False
    run.fallback_reason = None
    return run


def _on_device(out) -> bool:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return all(isinstance(o, cp.ndarray) for o in items)


for _op, _host in _REFERENCE_OPS.items():
    if _op != "ReduceSum":
        kernel(_op, host=_host)(device_reference)


@kernel("ReduceSum", host=(1,))
def reduce_sum(node, attrs):
    """A sum over every element in two kernels of our own (reduce_all.py), else the reference."""
    dt = in_dtype(node)
    general = device_reference(node, attrs)
    if not reduce_all.supported("sum", dt):
        return general
    from kiln.ir.ops.reduce import _reference_axes
    keep, noop = attrs["keepdims"], attrs["noop_with_empty_axes"]

    def run(x, axes=None):
        ax = _reference_axes(x, host(axes), noop)
        if ax is not None and len(ax) == x.ndim and isinstance(x, cp.ndarray) and x.size:
            return reduce_all.reduce_all("sum", x, bool(keep))
        return general(x, axes)
    run.fallback = False
    run.inner = general
    return run


@kernel("Shape")
def shape(node, attrs):
    """On the host: the value is the array's shape, which the host knows without the GPU."""
    start, end = attrs["start"], attrs["end"]
    return lambda x: np.array(x.shape[start:end], dtype=np.int64)


@kernel("Size")
def size(node, attrs):
    return lambda x: np.array(x.size, dtype=np.int64)


@kernel("Expand", host=(1,))
def expand(node, attrs):
    def run(x, shape):
        out = np.broadcast_shapes(x.shape, tuple(int(s) for s in host(shape)))
        return cp.ascontiguousarray(cp.broadcast_to(x, out))
    return run


def _check_range(idx, dim: int, axis: int) -> None:
    if isinstance(idx, np.ndarray):
        bad = bool(np.any((idx < -dim) | (idx >= dim)))
    elif cp.cuda.get_current_stream().is_capturing():
        return  # no host synchronization inside a CUDA-graph capture: checked on eager runs only
    else:
        bad = bool(((idx < -dim) | (idx >= dim)).any())
    if bad:
        raise IndexError(f"indices out of range [-{dim}, {dim}) on axis {axis}")


@kernel("Gather")
def gather(node, attrs):
    axis = attrs["axis"]
    index = const_input(node, 1)
    if index is not None and index.ndim == 0:
        i = int(index)

        def take_one(data, unused):
            if not -data.shape[axis] <= i < data.shape[axis]:
                raise IndexError(f"index {i} out of range [-{data.shape[axis]}, {data.shape[axis]}) on axis {axis}")
            return data[(slice(None),) * (axis % data.ndim) + (i, Ellipsis)]
        return take_one
    uploaded: dict = {}

    def run(data, indices):
        ax = axis % data.ndim
        dim = data.shape[ax]
        _check_range(indices, dim, axis)
        if isinstance(indices, np.ndarray):
            key = (id(indices), dim)
            d = uploaded.get(key) if index is not None else None
            if d is None:
                d = cp.asarray(np.where(indices < 0, indices + dim, indices))
                if index is not None:
                    uploaded[key] = d
        else:
            d = cp.where(indices < 0, indices + dim, indices)
        return cp.take(data, d, axis=ax)
    return run


def _reduce_extreme(largest: bool):
    def factory(node, attrs):
        dt = in_dtype(node)
        if dt is None or dt.kind == "b":  # bool (ReduceMax/Min-20): the reference, on the host
            return None
        keep, noop = attrs["keepdims"], attrs["noop_with_empty_axes"]
        whole = reduce_all.supported("max", dt)  # every element at once: reduce_all.py's kernels
        from kiln.ir.ops.reduce import _reference_axes

        def run(x, axes=None):
            ax = _reference_axes(x, host(axes), noop)
            if ax is None:
                return x
            if any(x.shape[a] == 0 for a in ax):  # over no elements: the identity, as the reference
                fill = (np.iinfo(dt).min if largest else np.iinfo(dt).max) if dt.kind in "iu" else \
                    (-np.inf if largest else np.inf)
                shape = tuple(1 if i in ax else d for i, d in enumerate(x.shape))
                y = cp.full(shape, fill, dt)
            elif len(ax) == x.ndim and whole:
                return reduce_all.reduce_all("max" if largest else "min", x, bool(keep))
            else:
                y = x.max(axis=ax, keepdims=True) if largest else x.min(axis=ax, keepdims=True)
            return y if keep else cp.squeeze(y, axis=ax)
        return run
    return factory


kernel("ReduceMax", host=(1,))(_reduce_extreme(True))
kernel("ReduceMin", host=(1,))(_reduce_extreme(False))


def _arg(largest: bool):
    def factory(node, attrs):
        keep, last = attrs["keepdims"], attrs["select_last_index"]

        def run(x):
            axis = normalize_axis(attrs["axis"], x.ndim)
            fn = cp.argmax if largest else cp.argmin
            if last:
                idx = x.shape[axis] - 1 - fn(cp.flip(x, axis), axis=axis)
            else:
                idx = fn(x, axis=axis)
            idx = idx.astype(np.int64)
            return cp.expand_dims(idx, axis) if keep else idx
        return run
    return factory


kernel("ArgMax")(_arg(True))
kernel("ArgMin")(_arg(False))


@kernel("ConstantOfShape", host=(0,))
def constant_of_shape(node, attrs):
    value = attrs["value"]
    v = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)

    def run(shape):
        return cp.full(tuple(int(s) for s in host(shape)), v[0], v.dtype)
    return run


@kernel("Range", host=(0, 1, 2))
def range_(node, attrs):
    """Computed by the reference on the host from its three scalars (and stash_type), then uploaded."""
    ref = node.schema.reference
    return lambda start, limit, delta: cp.asarray(ref(host(start), host(limit), host(delta), **attrs))
