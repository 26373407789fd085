"""Elementwise arithmetic and math: division with torch's rounding modes, remainders, powers,
unary math, clamping and elementwise minimum/maximum (add/sub/mul live in core.py).

Dtypes follow the eager result: operands are cast to ``res.dtype`` (torch's promotion), so
``int_tensor / 2`` divides in float and ``x.exp()`` of an int tensor computes in float32.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import operands
from kiln.frontend.tracer import kiln_dtype
from kiln.ir.dtypes import DType
from kiln.ir.ops.elementwise import POW_BASE

T = torch.Tensor


def aliases(*items: Union[str, Callable], functional: bool = False) -> list:
    """The torch callables to register, each once: a name stands for ``torch.X``, ``torch.X_``,
    ``Tensor.X`` and ``Tensor.X_`` (and ``F.X``, ``F.X_`` with ``functional``) where they exist;
    a callable (a dunder, an odd alias) is taken as is. Duplicates (``Tensor.__abs__ is
    Tensor.abs``) are dropped, since the table refuses a callable mapped twice."""
    owners = (torch, T, F) if functional else (torch, T)
    found: list = []
    for item in items:
        if isinstance(item, str):
            candidates = [getattr(o, n, None) for o in owners for n in (item, item + "_")]
        else:
            candidates = [item]
        for f in candidates:
            if f is not None and not any(f is g for g in found):
                found.append(f)
    return found


def res_dtype(res: torch.Tensor) -> DType:
    return kiln_dtype(res.dtype)


# ---------------------------------------------------------------------------- rounding helpers
def trunc(t, x):
    """Round toward zero (the IR has Floor and Ceil, not Trunc); integers are already whole."""
    if not x.type.dtype.is_float:
        return x
    negative = t.emit("Less", x, t.scalar(0, x.type.dtype))
    return t.emit("Where", negative, t.emit("Ceil", x), t.emit("Floor", x))


def _nonzero(t, x):
    return t.emit("Not", t.emit("Equal", x, t.scalar(0, x.type.dtype)))


def _signs_differ(t, a, b):
    zero = t.scalar(0, a.type.dtype)
    return t.emit("Xor", t.emit("Less", a, zero), t.emit("Less", b, zero))


def div_trunc(t, a, b):
    # IR Div already truncates integer quotients (as C and ONNX do).
    q = t.emit("Div", a, b)
    return trunc(t, q) if a.type.dtype.is_float else q


def div_floor(t, a, b):
    """Python/torch floor division. Integers: the truncated quotient, one less where the
    remainder is nonzero and its sign differs from the divisor's."""
    if a.type.dtype.is_float:
        return t.emit("Floor", t.emit("Div", a, b))
    q = t.emit("Div", a, b)
    r = t.emit("Sub", a, t.emit("Mul", q, b))
    step = t.emit("And", _nonzero(t, r), _signs_differ(t, r, b))
    return t.emit("Sub", q, t.emit("Cast", step, to=a.type.dtype.value))


def fmod(t, a, b):
    """C fmod: the remainder of truncated division, with the dividend's sign. For floats,
    a - trunc(a/b)*b, exact for moderate quotients (C fmod is exact for all)."""
    return t.emit("Sub", a, t.emit("Mul", div_trunc(t, a, b), b))


def remainder(t, a, b):
    """Python/torch remainder (the divisor's sign): fmod, plus b where fmod's sign differs from b's."""
    r = fmod(t, a, b)
    fix = t.emit("And", _nonzero(t, r), _signs_differ(t, r, b))
    return t.emit("Where", fix, t.emit("Add", r, b), r)


# ---------------------------------------------------------------------------- division
def _divide(t, a, b, rounding_mode):
    if rounding_mode is None:
        return t.emit("Div", a, b)
    if rounding_mode == "trunc":
        return div_trunc(t, a, b)
    if rounding_mode == "floor":
        return div_floor(t, a, b)
    raise UnsupportedOpError(f"{t.where()}: torch.div rounding_mode={rounding_mode!r} is not supported")


@maps(*aliases("div", "divide", "true_divide", T.__truediv__, T.__itruediv__, T.__div__, T.__idiv__))
def div(t, res, input, other, *, rounding_mode=None):
    return _divide(t, *operands(t, res, input, other), rounding_mode)


@maps(*aliases(T.__rtruediv__, T.__rdiv__))
def rdiv(t, res, input, other):
    return t.emit("Div", *operands(t, res, other, input))


@maps(*aliases("floor_divide", T.__floordiv__, T.__ifloordiv__))
def floor_divide(t, res, input, other):
    return div_floor(t, *operands(t, res, input, other))


@maps(T.__rfloordiv__)
def rfloordiv(t, res, input, other):
    return div_floor(t, *operands(t, res, other, input))


@maps(*aliases("remainder", T.__mod__, T.__imod__))
def remainder_(t, res, input, other):
    return remainder(t, *operands(t, res, input, other))


@maps(T.__rmod__)
def rmod(t, res, input, other):
    return remainder(t, *operands(t, res, other, input))


@maps(*aliases("fmod"))
def fmod_(t, res, input, other):
    return fmod(t, *operands(t, res, input, other))


# ---------------------------------------------------------------------------- powers
def power(t, res, base, exponent):
    dt = res_dtype(res)
    if dt not in POW_BASE and not dt.is_int:
        raise UnsupportedOpError(f"{t.where()}: torch.pow of {res.dtype} tensors is not supported")
    # IR Pow takes no 8/16-bit integer base: those powers are computed in int64 and cast back.
    work = dt if dt in POW_BASE else DType.INT64
    out = t.emit("Pow", t.value(base, work), t.value(exponent, work))
    return out if work is dt else t.emit("Cast", out, to=dt.value)


@maps(*aliases("pow", "float_power", T.__pow__, T.__ipow__))
def pow_(t, res, input, exponent):
    return power(t, res, input, exponent)


@maps(T.__rpow__)
def rpow(t, res, input, other):
    return power(t, res, other, input)


@maps(*aliases("square"))
def square(t, res, input):
    x = t.value(input, res_dtype(res))
    return t.emit("Mul", x, x)


# ---------------------------------------------------------------------------- unary math
def _unary(op: str, *names: Any) -> None:
    """An IR unary op computed in the result's dtype (ints promote to float for exp, log, ...)."""

    @maps(*aliases(*names))
    def handler(t, res, input):
        return t.emit(op, t.value(input, res_dtype(res)))

    handler.__name__ = op.lower()


_unary("Exp", "exp")
_unary("Log", "log")
_unary("Sqrt", "sqrt")
_unary("Reciprocal", "reciprocal")
_unary("Erf", "erf", torch.special.erf)
_unary("Tanh", "tanh")
_unary("Sigmoid", "sigmoid", torch.special.expit)
_unary("Sin", "sin")
_unary("Cos", "cos")


@maps(*aliases("neg", "negative"))
def neg(t, res, input):
    x = t.value(input, res_dtype(res))
    if x.type.dtype.is_signed:
        return t.emit("Neg", x)
    return t.emit("Sub", t.scalar(0, x.type.dtype), x)  # uint8 wraps around, as in torch


@maps(*aliases("abs", "absolute"))
def abs_(t, res, input):
    x = t.value(input, res_dtype(res))
    return x if x.type.dtype is DType.BOOL else t.emit("Abs", x)


@maps(*aliases("rsqrt"))
def rsqrt(t, res, input):
    return t.emit("Reciprocal", t.emit("Sqrt", t.value(input, res_dtype(res))))


@maps(*aliases("log1p", torch.special.log1p))
def log1p(t, res, input):
    """log(1 + x) accurate for tiny x (Goldberg's trick): with u = 1 + x rounded,
    log1p(x) = x * log(u) / (u - 1), and x itself where u rounds to 1."""
    x = t.value(input, res_dtype(res))
    one = t.scalar(1, x.type.dtype)
    u = t.emit("Add", x, one)
    d = t.emit("Sub", u, one)
    scaled = t.emit("Mul", x, t.emit("Div", t.emit("Log", u), d))
    return t.emit("Where", t.emit("Equal", d, t.scalar(0, x.type.dtype)), x, scaled)


def _whole(op: str, *names: Any) -> None:
    """Floor/Ceil/trunc: integer tensors are already whole (torch returns them unchanged)."""

    @maps(*aliases(*names))
    def handler(t, res, input):
        x = t.value(input, res_dtype(res))
        if not x.type.dtype.is_float:
            return x
        return trunc(t, x) if op == "Trunc" else t.emit(op, x)

    handler.__name__ = op.lower()


_whole("Floor", "floor")
_whole("Ceil", "ceil")
_whole("Trunc", "trunc", "fix")


def round_half_even(t, x):
    """torch.round (nearbyint: ties to even) from Floor. x - floor(x) is exact, so unlike
    floor(x + 0.5) this never rounds 0.49999997 up."""
    f = t.emit("Floor", x)
    frac = t.emit("Sub", x, f)
    half = t.scalar(0.5, x.type.dtype)
    two = t.scalar(2, x.type.dtype)
    odd = t.emit("Not", t.emit("Equal", t.emit("Floor", t.emit("Div", f, two)), t.emit("Div", f, two)))
    up = t.emit("Or", t.emit("Greater", frac, half), t.emit("And", t.emit("Equal", frac, half), odd))
    return t.emit("Add", f, t.emit("Cast", up, to=x.type.dtype.value))


@maps(*aliases("round", torch.special.round))
def round_(t, res, input, *, decimals=0):
    x = t.value(input, res_dtype(res))
    if not x.type.dtype.is_float:
        return x
    if decimals == 0:
        return round_half_even(t, x)
    # torch scales by 10^|decimals| the same way before rounding.
    scale = t.scalar(10.0 ** abs(decimals), x.type.dtype)
    if decimals > 0:
        return t.emit("Div", round_half_even(t, t.emit("Mul", x, scale)), scale)
    return t.emit("Mul", round_half_even(t, t.emit("Div", x, scale)), scale)


@maps(*aliases("sign"))
def sign(t, res, input):
    x = t.value(input, res_dtype(res))
    if x.type.dtype is DType.BOOL:
        return x
    s = t.emit("Sign", x)
    if not x.type.dtype.is_float:
        return s
    # torch.sign(nan) is 0; IR Sign (numpy) keeps NaN.
    return t.emit("Where", t.emit("IsNaN", x), t.scalar(0, x.type.dtype), s)


# ---------------------------------------------------------------------------- clamp, min/max
def extremum(t, op: str, a, b):
    """Elementwise Max/Min; on bools they are Or/And (IR Max/Min take numbers only)."""
    if a.type.dtype is DType.BOOL:
        return t.emit("Or" if op == "Max" else "And", a, b)
    return t.emit(op, a, b)


def _is_elementwise_bound(bound: Any) -> bool:
    # IR Clip takes scalar bounds only; tensors with elements along some dim need Max/Min.
    return isinstance(bound, torch.Tensor) and bound.dim() > 0


def clamp_value(t, res, input, min, max):  # noqa: A002 - torch's parameter names
    if min is None and max is None:
        raise UnsupportedOpError(f"{t.where()}: torch.clamp needs min or max")
    dt = res_dtype(res)
    x = t.value(input, dt)
    if _is_elementwise_bound(min) or _is_elementwise_bound(max):
        if min is not None:
            x = extremum(t, "Max", x, t.value(min, dt))
        if max is not None:
            x = extremum(t, "Min", x, t.value(max, dt))
        return x
    lo = None if min is None else t.value(min, dt)
    hi = None if max is None else t.value(max, dt)
    return t.emit("Clip", x, lo, hi)


@maps(*aliases("clamp", "clip"))
def clamp(t, res, input, min=None, max=None):  # noqa: A002
    return clamp_value(t, res, input, min, max)


@maps(*aliases("clamp_min"))
def clamp_min(t, res, input, min):  # noqa: A002
    return clamp_value(t, res, input, min, None)


@maps(*aliases("clamp_max"))
def clamp_max(t, res, input, max):  # noqa: A002
    return clamp_value(t, res, input, None, max)


@maps(*aliases("maximum"))
def maximum(t, res, input, other):
    return extremum(t, "Max", *operands(t, res, input, other))


@maps(*aliases("minimum"))
def minimum(t, res, input, other):
    return extremum(t, "Min", *operands(t, res, input, other))


# ---------------------------------------------------------------------------- fused forms
@maps(*aliases("lerp"))
def lerp(t, res, input, end, weight):
    a, b, w = operands(t, res, input, end, weight)
    return t.emit("Add", a, t.emit("Mul", w, t.emit("Sub", b, a)))


def _scaled(t, res, x, value):
    return x if value == 1 else t.emit("Mul", x, t.value(value, res_dtype(res)))


@maps(*aliases("addcmul"))
def addcmul(t, res, input, tensor1, tensor2, *, value=1):
    a, b, c = operands(t, res, input, tensor1, tensor2)
    return t.emit("Add", a, _scaled(t, res, t.emit("Mul", b, c), value))


@maps(*aliases("addcdiv"))
def addcdiv(t, res, input, tensor1, tensor2, *, value=1):
    a, b, c = operands(t, res, input, tensor1, tensor2)
    return t.emit("Add", a, _scaled(t, res, t.emit("Div", b, c), value))
