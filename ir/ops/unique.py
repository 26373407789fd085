"""``Unique`` (ai.onnx 11; 28 only adds bfloat16): the distinct elements of X (``axis`` absent: of X flattened),
or its distinct slices along ``axis``, with three optional int64 outputs: ``indices`` (where each first occurs
in X, along the axis or in the flattened X), ``inverse_indices`` (for each element or slice of X, its
position in Y) and ``counts``.

``sorted=1`` (the default) orders Y ascending (slices lexicographically, as numpy.unique); ``sorted=0`` keeps
the order of first occurrence. Values compare as numbers: 0.0 and -0.0 are one value (the one that occurs
first is kept), NaNs are one value when ``axis`` is absent (numpy.unique's ``equal_nan``), and a slice holding
a NaN equals no other slice. bfloat16 and float16 are compared in float32, which holds each of their values
exactly.

Output sizes depend on X's values: inference knows them only when X is a constant (or has 0 or 1 elements
along the unique axis).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import ALL, compute_dtype
from kiln.ir.ops._dims import check_axis, dim_product
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import Dim, TensorType, normalize_axis

_INT64 = frozenset({DType.INT64})


def _count(ctx: InferContext, n: Dim) -> Dim:
    """The number of distinct elements (slices): known for a constant X or one of 0 or 1 elements (slices)."""
    c = ctx.const(0)
    if c is not None:
        return int(unique(np.asarray(c), axis=ctx.attrs["axis"])[3].size)  # one count per distinct element
    return n if n in (0, 1) else None


def _infer_unique(ctx: InferContext) -> list:
    x = ctx.input(0)
    if ctx.attrs["sorted"] not in (0, 1):
        ctx.fail(f"sorted must be 0 or 1, got {ctx.attrs['sorted']}")
    axis = ctx.attrs["axis"]
    if x.shape is None:
        y = TensorType(x.dtype, (None,) if axis is None else None)
        outs = [y] + [TensorType(DType.INT64, (None,))] * 3
        return outs[:ctx.num_outputs]
    if axis is None:
        n = dim_product(x.shape)
        count = _count(ctx, n)
        y_shape: tuple = (count,)
    else:
        if not x.shape:
            ctx.fail("X is a scalar: it has no axis to take unique slices along (leave axis out to flatten)")
        a = check_axis(ctx, axis, len(x.shape))
        n = x.shape[a]
        count = _count(ctx, n)
        y_shape = tuple(x.shape[:a]) + (count,) + tuple(x.shape[a + 1:])
    outs = [TensorType(x.dtype, y_shape), TensorType(DType.INT64, (count,)), TensorType(DType.INT64, (n,)),
            TensorType(DType.INT64, (count,))]
    return outs[:ctx.num_outputs]


@op("Unique", inputs=[In("X", ALL)],
    outputs=["Y", Out("indices", _INT64, optional=True), Out("inverse_indices", _INT64, optional=True),
             Out("counts", _INT64, optional=True)],
    attrs=[Attr("axis", AttrKind.INT, None), Attr("sorted", AttrKind.INT, 1)],
    infer=_infer_unique)
def unique(x, *, axis: Optional[int] = None, sorted: int = 1):  # noqa: A002 - ONNX's attribute name
    """(Y, indices, inverse_indices, counts), as the module docstring says."""
    work = x.astype(compute_dtype(x.dtype), copy=False)  # bfloat16/float16: exact in float32 (numpy sorts it)
    if axis is None:
        y, first, inverse, counts = np.unique(work.reshape(-1), return_index=True, return_inverse=True,
                                              return_counts=True)
        take_axis = 0
    else:
        if x.ndim == 0:
            raise ValueError("Unique: X is a scalar, it has no axis to take unique slices along")
        take_axis = normalize_axis(axis, x.ndim)
        y, first, inverse, counts = np.unique(work, return_index=True, return_inverse=True, return_counts=True,
                                              axis=take_axis)
    inverse = inverse.reshape(-1)
    if not sorted:  # first-occurrence order: sort the distinct values by where they first occur
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size, dtype=order.dtype)
        y, first, counts, inverse = np.take(y, order, axis=take_axis), first[order], counts[order], rank[inverse]
    i64 = np.int64
    return y.astype(x.dtype, copy=False), first.astype(i64), inverse.astype(i64), counts.astype(i64)
