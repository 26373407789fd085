"""Comparisons, boolean logic, where/masked_fill, float classification, dtype conversions and
the ops that only change storage (detach, clone, contiguous)."""
from __future__ import annotations

from typing import Any

import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.elementwise import aliases, res_dtype
from kiln.frontend.tracer import kiln_dtype
from kiln.ir.dtypes import DType

T = torch.Tensor


def as_result(t, res, v):
    """Cast a bool result to res's dtype: in-place forms (``x.lt_(y)``, ``x.logical_not_()``)
    keep the tensor's own dtype."""
    dt = res_dtype(res)
    return v if dt is DType.BOOL else t.emit("Cast", v, to=dt.value)


# ---------------------------------------------------------------------------- comparisons
def _compare(op: str, *funcs: Any, negate: bool = False) -> None:
    @maps(*funcs)
    def handler(t, res, input, other):
        # Compare in the dtype torch promotes the operands to (res is bool, so it cannot tell).
        dt = kiln_dtype(torch.result_type(input, other))
        if dt is DType.BOOL and op != "Equal":
            dt = DType.UINT8  # IR orderings take numbers; False < True as 0 < 1
        out = t.emit(op, t.value(input, dt), t.value(other, dt))
        return as_result(t, res, t.emit("Not", out) if negate else out)

    handler.__name__ = "not_equal" if negate else op.lower()


_compare("Equal", *aliases("eq", T.__eq__))
_compare("Equal", *aliases("ne", "not_equal", T.__ne__), negate=True)
_compare("Less", *aliases("lt", "less", T.__lt__))
_compare("LessOrEqual", *aliases("le", "less_equal", T.__le__))
_compare("Greater", *aliases("gt", "greater", T.__gt__))
_compare("GreaterOrEqual", *aliases("ge", "greater_equal", T.__ge__))


# ---------------------------------------------------------------------------- boolean logic
def _logical(op: str, *funcs: Any) -> None:
    @maps(*funcs)
    def handler(t, res, input, other):
        # Any dtype: nonzero is True (Cast to bool does exactly that).
        out = t.emit(op, t.value(input, DType.BOOL), t.value(other, DType.BOOL))
        return as_result(t, res, out)

    handler.__name__ = f"logical_{op.lower()}"


_logical("And", *aliases("logical_and"))
_logical("Or", *aliases("logical_or"))
_logical("Xor", *aliases("logical_xor"))


@maps(*aliases("logical_not"))
def logical_not(t, res, input):
    return as_result(t, res, t.emit("Not", t.value(input, DType.BOOL)))


def _bool_only(t, res, name: str) -> None:
    if res.dtype is not torch.bool:
        raise UnsupportedOpError(f"{t.where()}: {name} on {res.dtype} tensors is not supported "
                                 "(kiln maps bitwise ops on bool tensors only)")


def _bitwise(op: str, *funcs: Any, reflected: bool = False) -> None:
    @maps(*funcs)
    def handler(t, res, input, other):
        _bool_only(t, res, f"bitwise {op.lower()}")
        a, b = (other, input) if reflected else (input, other)
        return t.emit(op, t.value(a, DType.BOOL), t.value(b, DType.BOOL))

    handler.__name__ = f"bitwise_{op.lower()}"


_bitwise("And", *aliases("bitwise_and", T.__and__, T.__iand__))
_bitwise("Or", *aliases("bitwise_or", T.__or__, T.__ior__))
_bitwise("Xor", *aliases("bitwise_xor", T.__xor__, T.__ixor__))
_bitwise("And", T.__rand__, reflected=True)
_bitwise("Or", T.__ror__, reflected=True)
_bitwise("Xor", T.__rxor__, reflected=True)


@maps(*aliases("bitwise_not", T.__invert__))
def bitwise_not(t, res, input):
    _bool_only(t, res, "bitwise not (~)")
    return t.emit("Not", t.value(input))


# ---------------------------------------------------------------------------- where, masked_fill
@maps(torch.where)
def where(t, res, condition, input=None, other=None):
    if input is None or other is None:
        raise UnsupportedOpError(f"{t.where()}: torch.where(condition) with one argument (the indices of "
                                 "nonzero elements: a data-dependent shape) is not supported")
    dt = res_dtype(res)
    return t.emit("Where", t.value(condition, DType.BOOL), t.value(input, dt), t.value(other, dt))


@maps(T.where)
def tensor_where(t, res, input, condition, other):
    """``x.where(cond, y)``: the method takes self as the value where cond holds."""
    return where(t, res, condition, input, other)


@maps(*aliases("masked_fill"))
def masked_fill(t, res, input, mask, value):
    dt = res_dtype(res)
    return t.emit("Where", t.value(mask, DType.BOOL), t.value(value, dt), t.value(input, dt))


# ---------------------------------------------------------------------------- float classification
def _never(t, x):
    """All False, shaped like x: integers are never NaN or infinite."""
    return t.emit("Not", t.emit("Equal", x, x))


@maps(*aliases("isnan"))
def isnan(t, res, input):
    x = t.value(input)
    return t.emit("IsNaN", x) if x.type.dtype.is_float else _never(t, x)


def _isinf(t, input, negative: int, positive: int):
    x = t.value(input)
    if not x.type.dtype.is_float:
        return _never(t, x)
    return t.emit("IsInf", x, detect_negative=negative, detect_positive=positive)


@maps(*aliases("isinf"))
def isinf(t, res, input):
    return _isinf(t, input, 1, 1)


@maps(*aliases("isposinf"))
def isposinf(t, res, input):
    return _isinf(t, input, 0, 1)


@maps(*aliases("isneginf"))
def isneginf(t, res, input):
    return _isinf(t, input, 1, 0)


@maps(*aliases("isfinite"))
def isfinite(t, res, input):
    x = t.value(input)
    if not x.type.dtype.is_float:
        return t.emit("Equal", x, x)
    return t.emit("Not", t.emit("Or", t.emit("IsNaN", x), t.emit("IsInf", x)))


# ---------------------------------------------------------------------------- conversions
# Tensor.to has three overloads (dtype / device / other tensor), so the handler takes *args:
# the target dtype is the eager result's, and devices do not exist in the graph.
@maps(T.to, T.type_as, T.float, T.double, T.half, T.bfloat16, T.long, T.int, T.short, T.char, T.byte,
      T.bool, T.cpu, T.cuda)
def convert(t, res, input, *args, **kwargs):
    return t.value(input, res_dtype(res))


@maps(*aliases("detach", "clone", "contiguous", T.requires_grad_))
def same(t, res, input, *args, **kwargs):
    """Copies, views of the same data and autograd bookkeeping: the same IR value."""
    return t.value(input)


@maps(T.type)
def type_(t, res, input, dtype=None, non_blocking=False, **kwargs):
    # x.type() with no dtype returns the type's name: a string, bound to nothing.
    if not isinstance(res, torch.Tensor):
        return t.value(input)
    return t.value(input, res_dtype(res))
