"""Dim arithmetic and input readers shared by the shape, indexing and tensor-creation ops.

Dims are ints, symbols (``"batch"``) or None (unknown). Arithmetic on them stays exact: a
product or sum is only symbolic when it is one symbol times (plus) a neutral int; anything
else that is not a plain int becomes None rather than a guess.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.registry import InferContext
from kiln.ir.types import Dim, TensorType, normalize_axis

INT64 = frozenset({DType.INT64})

# An end index at least this large means "to the end of the axis" (exporters write INT32_MAX
# or INT64_MAX there): no real tensor has an axis this long.
END_OF_AXIS = 2**31 - 1


@dataclass
class Factors:
    """A product of dims as int coefficient x symbols (x something unknown)."""

    coef: int = 1
    symbols: Counter = field(default_factory=Counter)
    unknown: bool = False


def factor(dims: Sequence[Dim]) -> Factors:
    f = Factors()
    for d in dims:
        if isinstance(d, int):
            f.coef *= d
        elif isinstance(d, str):
            f.symbols[d] += 1
        else:
            f.unknown = True
    return f


def factors_to_dim(f: Factors) -> Dim:
    if f.coef == 0:
        return 0
    if f.unknown:
        return None
    if not f.symbols:
        return f.coef
    if f.coef == 1 and sum(f.symbols.values()) == 1:
        return next(iter(f.symbols))
    return None


def dim_product(dims: Sequence[Dim]) -> Dim:
    """The product of ``dims`` as a dim (1 for no dims)."""
    return factors_to_dim(factor(dims))


def dim_mul(a: Dim, b: Dim) -> Dim:
    return dim_product((a, b))


def dim_sum(dims: Sequence[Dim]) -> Dim:
    """The sum of ``dims``: an int, one symbol plus zeros, or None."""
    nonzero = [d for d in dims if d != 0]
    if all(isinstance(d, int) for d in nonzero):
        return sum(nonzero)
    if len(nonzero) == 1:
        return nonzero[0]
    return None


def int_values(ctx: InferContext, i: int) -> Optional[list[int]]:
    """The values of input i when they are all known ints (a constant or a propagated shape)."""
    if not ctx.has_input(i):
        return None
    vals = ctx.symbolic(i)
    if vals is None or not all(isinstance(v, int) for v in vals):
        return None
    return list(vals)


def unknown_dims(ctx: InferContext, i: int) -> Optional[tuple]:
    """Dims for a shape given by 1-D input i whose values are unknown: as many Nones as it
    has elements when its length is static, else None (unknown rank)."""
    t = ctx.inputs[i] if i < len(ctx.inputs) else None
    if t is None or t.shape is None or len(t.shape) != 1 or not isinstance(t.shape[0], int):
        return None
    return (None,) * t.shape[0]


def check_axis(ctx: InferContext, axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` mapped into [0, rank); an inference failure naming the node if out of range."""
    try:
        return normalize_axis(axis, rank, what)
    except ValueError as e:
        ctx.fail(str(e))


def check_axes(ctx: InferContext, axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    """Each axis mapped into [0, rank); out of range or repeated axes fail."""
    out = [check_axis(ctx, a, rank, what) for a in axes]
    if len(set(out)) != len(out):
        ctx.fail(f"{what} {list(axes)} name an axis twice")
    return out


def scalar_input(ctx: InferContext, i: int, what: str) -> TensorType:
    """The type of input i, which must hold exactly one element."""
    t = ctx.input(i)
    if t.shape is not None and (len(t.shape) > 1 or any(isinstance(d, int) and d != 1 for d in t.shape)):
        ctx.fail(f"{what} must be a scalar (or a 1-element tensor), got shape {list(t.shape)}")
    return t


def same_values(infer: Callable[[InferContext], TensorType]) -> Callable[[InferContext], Optional[tuple]]:
    """A ``propagate`` rule for ops that keep the elements of a small int tensor in order
    (Identity, Reshape, Squeeze, Unsqueeze): the values pass through when the output is 1-D
    or a scalar, the only shapes symbolic values describe."""

    def propagate(ctx: InferContext) -> Optional[tuple]:
        out = infer(ctx)
        if out.shape is None or len(out.shape) > 1:
            return None
        return ctx.symbolic(0)

    return propagate


def as_int_list(a: Optional[np.ndarray]) -> Optional[list[int]]:
    """A reference-side reader: an int tensor input as a Python list (None stays None)."""
    return None if a is None else [int(v) for v in np.asarray(a).reshape(-1)]
