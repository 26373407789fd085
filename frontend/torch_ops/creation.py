"""Tensor creation inside ``forward``: arange, zeros/ones/full/empty (and their ``_like`` and
``Tensor.new_*`` forms), tensor/as_tensor/asarray/scalar_tensor, eye; random creation raises.

Sizes may be SymInts (``torch.zeros(x.size(0), 4)``): the shape is then computed in the graph
(ConstantOfShape of a Shape-derived tensor), and ``_like`` forms read the input's Shape, so
the graph runs at other batch sizes. The result's dtype is always the one torch chose
(``res.dtype``): integer ``arange``, bool ``full``, ``dtype=`` arguments.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.frontend.torch_ops.shape import axes_value, ir_dims, sizes_arg
from kiln.frontend.tracer import kiln_dtype, op_name, to_numpy
from kiln.ir.dtypes import DType


# ---------------------------------------------------------------------------- filled tensors
def filled(t, res: torch.Tensor, shape, fill: Any):
    """A tensor of res's dtype and the given shape value, every element ``fill``."""
    dt = kiln_dtype(res.dtype)
    if isinstance(fill, (SymInt, torch.Tensor)):
        return t.emit("Expand", t.value(fill, dt), shape)  # a fill computed in the graph
    return t.emit("ConstantOfShape", shape, value=np.array([fill], dt.numpy))


def shape_of(t, x: torch.Tensor):
    """x's shape as a value: a constant when static in the graph, else Shape(x)."""
    dims = ir_dims(t, x)
    if all(isinstance(d, int) for d in dims):
        return t.shape_value(dims)
    return t.emit("Shape", t.value(x))


def _sizes(size: tuple, kwargs: dict) -> list:
    return list(kwargs["size"]) if "size" in kwargs else sizes_arg(size)


def _filled_factory(fill: Any, *funcs):
    @maps(*funcs)
    def handler(t, res, *size, **kwargs):
        return filled(t, res, t.shape_value(_sizes(size, kwargs)), fill)

    return handler


_filled_factory(0, torch.zeros, torch.empty)  # empty's contents are unspecified: zeros are as good
_filled_factory(1, torch.ones)


@maps(torch.full)
def full(t, res, size, fill_value, **kwargs):
    return filled(t, res, t.shape_value(list(size)), fill_value)


def _like_factory(fill: Any, *funcs):
    @maps(*funcs)
    def handler(t, res, input, **kwargs):
        return filled(t, res, shape_of(t, input), fill)

    return handler


_like_factory(0, torch.zeros_like, torch.empty_like)
_like_factory(1, torch.ones_like)


@maps(torch.full_like)
def full_like(t, res, input, fill_value, **kwargs):
    return filled(t, res, shape_of(t, input), fill_value)


@maps(torch.Tensor.fill_)
def fill_(t, res, input, value):
    new = filled(t, res, shape_of(t, input), value)
    t.invalidate_aliases(input, f"this tensor shares memory with one filled in place at {t.where()}; .clone() it "
                                "before the write, or build the value out of place (torch.full_like)")
    return new


@maps(torch.Tensor.zero_)
def zero_(t, res, input):
    return fill_(t, res, input, 0)


def _new_factory(fill: Any, *funcs):
    @maps(*funcs)
    def handler(t, res, input, *size, **kwargs):
        return filled(t, res, t.shape_value(_sizes(size, kwargs)), fill)

    return handler


_new_factory(0, torch.Tensor.new_zeros, torch.Tensor.new_empty)
_new_factory(1, torch.Tensor.new_ones)


@maps(torch.Tensor.new_full)
def new_full(t, res, input, size, fill_value, **kwargs):
    return filled(t, res, t.shape_value(list(size)), fill_value)


# ---------------------------------------------------------------------------- from Python data
def _flat(data: Any) -> list:
    if isinstance(data, (list, tuple)):
        return [y for item in data for y in _flat(item)]
    return [data]


def data_value(t, res: torch.Tensor, data: Any):
    """The value of ``torch.tensor(data)``: a constant for plain numbers; built in the graph when
    the data holds SymInts or traced tensors (``torch.tensor([x.size(0), 4])``)."""
    dt = kiln_dtype(res.dtype)
    if isinstance(data, torch.Tensor):
        return t.value(data, dt)
    items = _flat(data)
    if not any(isinstance(i, (SymInt, torch.Tensor)) for i in items):
        return t.constant(to_numpy(res), "tensor")
    one = t.constant(np.array([1], np.int64), "shape")
    parts = [t.emit("Reshape", t.value(i, dt), one) for i in items]
    flat = parts[0] if len(parts) == 1 else t.emit("Concat", *parts, axis=0)
    return t.emit("Reshape", flat, t.shape_value(list(res.shape)))


@maps(torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor)
def tensor(t, res, data, **kwargs):
    return data_value(t, res, data)


@maps(torch.Tensor.new_tensor)
def new_tensor(t, res, input, data, **kwargs):
    return data_value(t, res, data)


# ---------------------------------------------------------------------------- arange / eye
def _range_bounds(args: tuple, kwargs: dict) -> tuple:
    """(start, end, step) of ``arange(end)``, ``arange(start, end[, step])`` or keywords."""
    if len(args) == 1 and "end" not in kwargs:
        bounds = {"start": 0, "end": args[0], "step": 1}
    else:
        bounds = dict(zip(("start", "end", "step"), args))
    bounds.update({k: kwargs[k] for k in ("start", "end", "step") if k in kwargs})
    return bounds.get("start", 0), bounds["end"], bounds.get("step", 1)


def _is_integral(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.dtype.is_floating_point
    return isinstance(x, int)


def range_value(t, res: torch.Tensor, start: Any, end: Any, step: Any):
    """Range in int64 for integer bounds, else in float64 (torch computes arange in double),
    then cast to torch's result dtype."""
    dt = DType.INT64 if all(_is_integral(b) for b in (start, end, step)) else DType.FLOAT64
    out = t.emit("Range", t.value(start, dt), t.value(end, dt), t.value(step, dt))
    want = kiln_dtype(res.dtype)
    return out if want is dt else t.emit("Cast", out, to=want.value)


@maps(torch.arange)
def arange(t, res, *args, **kwargs):
    return range_value(t, res, *_range_bounds(args, kwargs))


@maps(torch.eye)
def eye(t, res, n, m=None, **kwargs):
    """(i == j) over a Range of rows and one of columns: works for SymInt sizes too."""
    rows = t.emit("Range", t.scalar(0), t.int_value(n), t.scalar(1))
    cols = t.emit("Range", t.scalar(0), t.int_value(n if m is None else m), t.scalar(1))
    same = t.emit("Equal", t.emit("Unsqueeze", rows, axes_value(t, [1])), cols)
    return t.emit("Cast", same, to=kiln_dtype(res.dtype).value)


# ---------------------------------------------------------------------------- random: refused
RANDOM = (torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
          torch.randint_like, torch.normal, torch.bernoulli, torch.multinomial, torch.poisson,
          torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli,
          torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.multinomial)


def _random_refused(func):
    @maps(func)
    def handler(t, res, *args, **kwargs):
        raise UnsupportedOpError(
            f"{t.where()}: '{op_name(func)}' draws random numbers, which a deterministic inference graph cannot "
            "reproduce; create them outside forward and pass them in as an input")

    return handler


for _func in RANDOM:
    _random_refused(_func)


@maps(torch.meshgrid)
def meshgrid(t, res, *tensors, indexing=None):
    """torch.meshgrid: each 0-D/1-D input unsqueezed to the output rank along its own axis, then
    expanded to the grid (sizes symbolic where the inputs' are). ``indexing="xy"`` swaps the first
    two axes of the grid, as numpy does; torch's default is "ij"."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in (None, "ij", "xy"):
        raise UnsupportedOpError(f"{t.where()}: meshgrid indexing {indexing!r} (torch takes 'ij' or 'xy')")
    if not tensors or any(x.dim() > 1 for x in tensors):
        raise UnsupportedOpError(f"{t.where()}: meshgrid takes 0-D or 1-D tensors")
    n = len(tensors)
    axes = list(range(n))
    if indexing == "xy" and n >= 2:
        axes[0], axes[1] = 1, 0
    dims: list = [None] * n
    for x, a in zip(tensors, axes):
        dims[a] = dim_of(t, x, 0) if x.dim() == 1 else 1
    shape = t.shape_value(dims)
    out = []
    for x, a in zip(tensors, axes):
        v = t.value(x)
        if x.dim() == 0:
            v = t.emit("Unsqueeze", v, axes_value(t, [0]))
        others = [i for i in range(n) if i != a]
        if others:
            v = t.emit("Unsqueeze", v, axes_value(t, others))
        out.append(t.emit("Expand", v, shape))
    return tuple(out)
