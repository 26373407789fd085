"""Core mappings: sizes and shapes, arithmetic with type promotion, a first set of ops."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.tracer import kiln_dtype


# ---------------------------------------------------------------------------- sizes
def dim_of(t, x: torch.Tensor, i: int) -> Any:
    """Size i of x: a plain int when static in the graph, else a SymInt computing it."""
    v = t.value(x)
    shape = v.type.shape
    i = i + x.dim() if i < 0 else i
    if shape is not None and isinstance(shape[i], int):
        return shape[i]
    size = t.emit("Shape", v, start=i, end=i + 1)
    scalar = t.emit("Squeeze", size, t.constant(np.array([0], np.int64), "axes"))
    return SymInt(x.shape[i], t, scalar)


@maps(torch.Tensor.shape.__get__, value=True)
def shape(t, res, x):
    """torch.Size when every dim is static in the graph, else a tuple holding SymInts."""
    dims = tuple(dim_of(t, x, i) for i in range(x.dim()))
    return res if not any(isinstance(d, SymInt) for d in dims) else dims


@maps(torch.Tensor.size, value=True)
def size(t, res, x, dim=None):
    return shape(t, res, x) if dim is None else dim_of(t, x, dim)


# ---------------------------------------------------------------------------- arithmetic
def operands(t, res: torch.Tensor, *xs: Any) -> list:
    """IR values of the operands, cast to torch's promoted result dtype (the eager result's)."""
    dt = kiln_dtype(res.dtype)
    return [t.value(x, dt) for x in xs]


def _binary(op: str, *funcs):
    @maps(*funcs)
    def handler(t, res, input, other, *, alpha=1):
        a, b = operands(t, res, input, other)
        if alpha != 1:
            b = t.emit("Mul", b, t.value(alpha, kiln_dtype(res.dtype)))
        return t.emit(op, a, b)

    handler.__name__ = op.lower()
    return handler


_binary("Add", torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.add_, torch.Tensor.__iadd__)
_binary("Sub", torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.sub_, torch.Tensor.__isub__,
        torch.subtract, torch.Tensor.subtract, torch.Tensor.subtract_)
_binary("Mul", torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.mul_, torch.Tensor.__imul__,
        torch.multiply, torch.Tensor.multiply, torch.Tensor.multiply_)


@maps(torch.Tensor.__radd__)
def radd(t, res, input, other):
    a, b = operands(t, res, other, input)
    return t.emit("Add", a, b)


@maps(torch.Tensor.__rmul__)
def rmul(t, res, input, other):
    a, b = operands(t, res, other, input)
    return t.emit("Mul", a, b)


@maps(torch.Tensor.__rsub__, torch.rsub)
def rsub(t, res, input, other, alpha=1):
    a, b = operands(t, res, other, input)
    return t.emit("Sub", a, b)


# ---------------------------------------------------------------------------- a first set
@maps(torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_, F.relu)
def relu(t, res, input, inplace=False):
    return t.emit("Relu", t.value(input))


@maps(F.linear)
def linear(t, res, input, weight, bias=None):
    x, w = t.value(input), t.value(weight)
    if bias is None:
        return t.emit("MatMul", x, t.emit("Transpose", w, perm=[1, 0]))
    if input.dim() == 2:
        return t.emit("Gemm", x, w, t.value(bias), transB=1)
    return t.emit("Add", t.emit("MatMul", x, t.emit("Transpose", w, perm=[1, 0])), t.value(bias))


@maps(torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
def reshape(t, res, input, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return t.emit("Reshape", t.value(input), t.shape_value(shape))
