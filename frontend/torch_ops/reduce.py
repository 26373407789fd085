"""Reductions: sum/mean/prod, amax/amin, max/min (global, along a dim, or elementwise),
argmax/argmin, var/std, norms, cumsum and its inverse diff, topk, logsumexp, all/any.

torch semantics kept here: ``dim=None`` (and ``dim=()`` for sum/mean/amax) reduces every dim,
negative dims, ``keepdim``, a 0-d input accepting dim 0/-1, and the result dtype torch picks
(``int.sum()`` is int64, ``mean(dtype=...)``): the input is cast to ``res.dtype`` first.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of, operands
from kiln.frontend.torch_ops.elementwise import aliases, extremum, res_dtype
from kiln.ir.dtypes import DType
from kiln.ir.ops.reduce import MINMAX_T

T = torch.Tensor
# ReduceMax/ReduceMin take MINMAX_T; bool and int16 are reduced in a stand-in and cast back.
_STAND_IN = {DType.BOOL: DType.UINT8, DType.INT16: DType.INT32}


# ---------------------------------------------------------------------------- axes
def axes_of(input: torch.Tensor, dim: Any) -> Optional[list[int]]:
    """The dims to reduce, normalized; None for all of them (dim None or empty, or a 0-d input)."""
    if dim is None or input.dim() == 0:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [int(d) % input.dim() for d in dims] or None


def reduce(t, op: str, x, axes: Optional[list[int]], keepdim: bool):
    if axes is None:
        return t.emit(op, x, keepdims=int(keepdim))
    return t.emit(op, x, t.constant(np.array(axes, np.int64), "axes"), keepdims=int(keepdim))


def _minmax_input(t, input):
    """input as a value IR Max/Min/Arg reductions accept, and the dtype to cast back to."""
    x = t.value(input)
    dt = x.type.dtype
    if dt in MINMAX_T:
        return x, dt
    if dt in _STAND_IN:
        return t.emit("Cast", x, to=_STAND_IN[dt].value), dt
    raise UnsupportedOpError(f"{t.where()}: max/min reductions of {dt} tensors are not supported")


def _cast_back(t, v, dt: DType):
    return v if v.type.dtype is dt else t.emit("Cast", v, to=dt.value)


# ---------------------------------------------------------------------------- sum, mean, prod
def _simple(op: str, *names: Any) -> None:
    @maps(*aliases(*names))
    def handler(t, res, input, dim=None, keepdim=False, *, dtype=None):
        # Cast first: ints sum in int64, and dtype=... asks for the accumulation dtype.
        x = t.value(input, res_dtype(res))
        return reduce(t, op, x, axes_of(input, dim), keepdim)

    handler.__name__ = op.lower()


_simple("ReduceSum", "sum")
_simple("ReduceMean", "mean")
_simple("ReduceProd", "prod")


@maps(*aliases("count_nonzero"))
def count_nonzero(t, res, input, dim=None):
    x = t.value(input)
    nonzero = t.emit("Not", t.emit("Equal", x, t.scalar(0, x.type.dtype)))
    return reduce(t, "ReduceSum", t.emit("Cast", nonzero, to=DType.INT64.value), axes_of(input, dim), False)


# ---------------------------------------------------------------------------- max, min
def _extreme(t, op: str, input, axes, keepdim):
    x, dt = _minmax_input(t, input)
    return _cast_back(t, reduce(t, op, x, axes, keepdim), dt)


@maps(*aliases("amax"))
def amax(t, res, input, dim=(), keepdim=False):
    return _extreme(t, "ReduceMax", input, axes_of(input, dim), keepdim)


@maps(*aliases("amin"))
def amin(t, res, input, dim=(), keepdim=False):
    return _extreme(t, "ReduceMin", input, axes_of(input, dim), keepdim)


def _max_min(t, res, which: str, input, dim, keepdim, other):
    """The three forms of torch.max/min: over everything, (values, indices) along dim, elementwise."""
    if other is not None or isinstance(dim, torch.Tensor):
        return extremum(t, which, *operands(t, res, input, dim if other is None else other))
    if dim is None:
        return _extreme(t, f"Reduce{which}", input, None, False)
    values = _extreme(t, f"Reduce{which}", input, axes_of(input, dim), keepdim)
    return values, arg_index(t, f"Arg{which}", input, dim, keepdim)


@maps(*aliases("max"))
def max_(t, res, input, dim=None, keepdim=False, *, other=None):
    return _max_min(t, res, "Max", input, dim, keepdim, other)


@maps(*aliases("min"))
def min_(t, res, input, dim=None, keepdim=False, *, other=None):
    return _max_min(t, res, "Min", input, dim, keepdim, other)


def arg_index(t, op: str, input, dim, keepdim):
    """ArgMax/ArgMin; dim None indexes the flattened tensor (keepdim then gives all-1 dims)."""
    x, _ = _minmax_input(t, input)
    if input.dim() == 0:
        x = t.emit("Reshape", x, t.constant(np.array([1], np.int64), "shape"))
        return t.emit(op, x, axis=0, keepdims=0)
    if dim is not None:
        return t.emit(op, x, axis=int(dim), keepdims=int(keepdim))
    flat = t.emit("Reshape", x, t.constant(np.array([-1], np.int64), "shape"))
    idx = t.emit(op, flat, axis=0, keepdims=0)
    if not keepdim:
        return idx
    return t.emit("Reshape", idx, t.constant(np.ones(input.dim(), np.int64), "shape"))


@maps(*aliases("argmax"))
def argmax(t, res, input, dim=None, keepdim=False):
    return arg_index(t, "ArgMax", input, dim, keepdim)


@maps(*aliases("argmin"))
def argmin(t, res, input, dim=None, keepdim=False):
    return arg_index(t, "ArgMin", input, dim, keepdim)


# ---------------------------------------------------------------------------- var, std
def _count(t, input, axes: list[int], dt: DType):
    """The number of reduced elements as a scalar of dtype dt (symbolic when a dim is)."""
    n = 1
    for a in axes:
        n = n * dim_of(t, input, a)  # a SymInt when the dim is symbolic: the product stays in the graph
    return t.value(n, dt)


def _correction(dim, unbiased, correction) -> tuple[Any, float]:
    """Sort out var's overloads: var(x, unbiased), var(x, dim, unbiased), var(x, dim, correction=c)."""
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    if correction is not None:
        return dim, float(correction)
    return dim, 0.0 if unbiased is False else 1.0


def variance(t, res, input, dim, unbiased, keepdim, correction):
    """(variance, mean with keepdim): sum((x - mean)^2) / max(N - correction, 0), as torch."""
    dim, corr = _correction(dim, unbiased, correction)
    dt = res_dtype(res)
    x = t.value(input, dt)
    axes = axes_of(input, dim) or list(range(input.dim()))
    axes_c = t.constant(np.array(axes, np.int64), "axes")
    mean = t.emit("ReduceMean", x, axes_c, keepdims=1)
    diff = t.emit("Sub", x, mean)
    ss = t.emit("ReduceSum", t.emit("Mul", diff, diff), axes_c, keepdims=int(keepdim))
    denom = t.emit("Sub", _count(t, input, axes, dt), t.scalar(corr, dt))
    denom = t.emit("Max", denom, t.scalar(0, dt))
    var = t.emit("Div", ss, denom)
    return var, (mean if keepdim else t.emit("Squeeze", mean, axes_c))


@maps(*aliases("var"))
def var(t, res, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return variance(t, res, input, dim, unbiased, keepdim, correction)[0]


@maps(*aliases("std"))
def std(t, res, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return t.emit("Sqrt", variance(t, res, input, dim, unbiased, keepdim, correction)[0])


@maps(torch.var_mean)
def var_mean(t, res, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return variance(t, res[0], input, dim, unbiased, keepdim, correction)


@maps(torch.std_mean)
def std_mean(t, res, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    var, mean = variance(t, res[0], input, dim, unbiased, keepdim, correction)
    return t.emit("Sqrt", var), mean


# ---------------------------------------------------------------------------- norms
def vector_norm(t, res, input, p, dim, keepdim):
    if p == "fro":
        p = 2  # over one or two dims, Frobenius is the 2-norm of the entries
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise UnsupportedOpError(f"{t.where()}: norm with p={p!r} is not supported (vector norms only)")
    x = t.value(input, res_dtype(res))
    axes = axes_of(input, dim)
    if p == 2:
        return reduce(t, "ReduceL2", x, axes, keepdim)
    if p == 0:
        nonzero = t.emit("Not", t.emit("Equal", x, t.scalar(0, x.type.dtype)))
        return reduce(t, "ReduceSum", t.emit("Cast", nonzero, to=x.type.dtype.value), axes, keepdim)
    a = t.emit("Abs", x)
    if math.isinf(p):
        return reduce(t, "ReduceMax" if p > 0 else "ReduceMin", a, axes, keepdim)
    if p == 1:
        return reduce(t, "ReduceSum", a, axes, keepdim)
    powered = t.emit("Pow", a, t.scalar(p, x.type.dtype))
    return t.emit("Pow", reduce(t, "ReduceSum", powered, axes, keepdim), t.scalar(1.0 / p, x.type.dtype))


@maps(torch.linalg.vector_norm)
def linalg_vector_norm(t, res, x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):  # noqa: A002
    return vector_norm(t, res, x, ord, dim, keepdim)


@maps(torch.norm, T.norm)
def norm(t, res, input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    if p == "fro" and dim is not None and not isinstance(dim, int) and len(dim) > 2:
        raise UnsupportedOpError(f"{t.where()}: Frobenius norm over {len(dim)} dims is not supported")
    return vector_norm(t, res, input, p, dim, keepdim)


# ---------------------------------------------------------------------------- scans, top-k, logsumexp
@maps(*aliases("cumsum"))
def cumsum(t, res, input, dim, *, dtype=None):
    x = t.value(input, res_dtype(res))
    if input.dim() == 0:
        return x
    return t.emit("CumSum", x, t.constant(np.array(int(dim), np.int64), "axis"))


# Slice bounds for diff: from 1 to the end of the axis, and from 0 to one before it. ONNX clamps
# both to the axis' size at run time, so they hold for any size (a symbolic one, or 0).
_TO_END = np.iinfo(np.int64).max


@maps(*aliases("diff"))
def diff(t, res, input, n=1, dim=-1, prepend=None, append=None):
    """``x[1:] - x[:-1]`` along dim, n times, after joining prepend/append to x along dim.

    Bool tensors differ by ``x[1:] != x[:-1]`` (torch's logical xor). prepend/append are cast to
    the result dtype first, as torch.cat promotes them (torch has already checked that they have
    x's rank and its sizes off dim); with n=0 torch ignores them and returns x. Each step is two
    Slices with bounds relative to the axis' ends, never its example size, so a symbolic dim
    stays symbolic; n beyond the size gives an empty dim, as torch does.
    """
    if int(n) == 0:
        return t.value(input)
    d = int(dim) % input.dim()
    dt = res_dtype(res)
    parts = [t.value(p, dt) for p in (prepend, input, append) if p is not None]
    x = parts[0] if len(parts) == 1 else t.emit("Concat", *parts, axis=d)
    axes = t.constant(np.array([d], np.int64), "axes")
    zero, one = t.constant(np.array([0], np.int64), "starts"), t.constant(np.array([1], np.int64), "starts")
    to_end, to_last = (t.constant(np.array([_TO_END], np.int64), "ends"),
                       t.constant(np.array([-1], np.int64), "ends"))
    op = "Xor" if dt is DType.BOOL else "Sub"
    for _ in range(int(n)):
        x = t.emit(op, t.emit("Slice", x, one, to_end, axes), t.emit("Slice", x, zero, to_last, axes))
    return x


@maps(*aliases("topk"))
def topk(t, res, input, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's name
    # IR TopK always sorts; sorted=False leaves torch's order unspecified, so sorted is a valid answer.
    x = t.value(input)
    values, indices = t.emit("TopK", x, t.shape_value([k]), axis=int(dim), largest=int(largest), sorted=1,
                             outputs=2)
    return values, indices


@maps(*aliases("logsumexp", torch.special.logsumexp))
def logsumexp(t, res, input, dim, keepdim=False):
    """max + log(sum(exp(x - max))), with an infinite max taken as 0 so that all -inf gives -inf."""
    x = t.value(input, res_dtype(res))
    dt = x.type.dtype
    axes = axes_of(input, dim) or list(range(input.dim()))
    if not axes:
        return x
    axes_c = t.constant(np.array(axes, np.int64), "axes")
    m = t.emit("ReduceMax", x, axes_c, keepdims=1)
    m = t.emit("Where", t.emit("IsInf", m), t.scalar(0, dt), m)
    s = t.emit("ReduceSum", t.emit("Exp", t.emit("Sub", x, m)), axes_c, keepdims=int(keepdim))
    shift = m if keepdim else t.emit("Squeeze", m, axes_c)
    return t.emit("Add", t.emit("Log", s), shift)


# ---------------------------------------------------------------------------- all, any
def _all_any(t, res, op: str, input, dim, keepdim):
    b = t.emit("Cast", t.value(input, DType.BOOL), to=DType.UINT8.value)
    if isinstance(dim, (tuple, list)) and len(dim) == 0 and input.dim() > 0:
        out = b  # torch: an empty dim list reduces nothing here (unlike sum)
    else:
        out = reduce(t, op, b, axes_of(input, dim), keepdim)
    return t.emit("Cast", out, to=res_dtype(res).value)


@maps(*aliases("all"))
def all_(t, res, input, dim=None, keepdim=False):
    return _all_any(t, res, "ReduceMin", input, dim, keepdim)


@maps(*aliases("any"))
def any_(t, res, input, dim=None, keepdim=False):
    return _all_any(t, res, "ReduceMax", input, dim, keepdim)
