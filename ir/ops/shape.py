"""Shape ops: Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Concat, Split, Shape, Size,
Expand and Tile (ONNX opset 18 semantics).

Ops that compute on shape tensors register ``propagate`` rules, so ``Shape(x)`` flowing through
Gather/Slice/Concat/Unsqueeze/... keeps symbolic dims that Reshape/Expand/Tile then read back
with ``ctx.symbolic``. The rest of the family lives in ``indexing.py`` (Slice, Gather,
GatherElements, ScatterND, Trilu) and ``layout.py`` (Pad, DepthToSpace, SpaceToDepth), imported
below so that importing this module registers the whole family.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import ANY_TYPES as ANY
from kiln.ir.dtypes import DType
from kiln.ir.ops import indexing, layout  # noqa: F401  (register the rest of the family)
from kiln.ir.ops._common import ALL
from kiln.ir.ops._dims import (INT64, check_axes, check_axis, dim_mul, dim_product, dim_sum, factor,
                               factors_to_dim, int_values, same_values, unknown_dims)
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, broadcast_shapes, dims_compatible, merge_dim

# --------------------------------------------------------------------------- Reshape


def _reshape_dim(ctx: InferContext, i: int, d: Dim, in_shape: Optional[tuple]) -> Dim:
    """Output dim i for target value d (not -1): 0 copies the input dim unless allowzero."""
    if isinstance(d, int) and d < 0:
        ctx.fail(f"shape value {d} is invalid (only -1 may be negative)")
    if d != 0 or ctx.attrs["allowzero"]:
        return d
    if in_shape is None:
        return None
    if i >= len(in_shape):
        ctx.fail(f"shape value 0 at position {i} copies an input dim, but the input has rank {len(in_shape)}")
    return in_shape[i]


def _inferred_dim(ctx: InferContext, in_shape: tuple, known: list) -> Dim:
    """The dim a -1 stands for: the input's size divided by the other output dims."""
    total = factor(in_shape)
    rest = factor(known)
    if total.unknown or rest.unknown or rest.coef == 0:
        return None
    if rest.symbols - total.symbols:
        return None
    if total.coef % rest.coef != 0:
        if not total.symbols and not rest.symbols:
            ctx.fail(f"cannot reshape {list(in_shape)} into {known} with -1: sizes do not divide")
        return None
    total.coef //= rest.coef
    total.symbols -= rest.symbols
    return factors_to_dim(total)


def _check_same_size(ctx: InferContext, in_shape: tuple, out: list) -> None:
    a = factor(in_shape)
    b = factor(out)
    if a.unknown or b.unknown or a.symbols != b.symbols:
        return
    if a.coef != b.coef:
        ctx.fail(f"cannot reshape {list(in_shape)} into {out}: element counts differ")


def _infer_reshape(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    target = ctx.symbolic(1)
    if target is None:
        return TensorType(x.dtype, unknown_dims(ctx, 1))
    ints = [d for d in target if isinstance(d, int)]
    if ints.count(-1) > 1:
        ctx.fail(f"shape {list(target)} has more than one -1")
    if ctx.attrs["allowzero"] and -1 in ints and 0 in ints:
        ctx.fail(f"shape {list(target)} has both 0 and -1, which allowzero=1 forbids")
    out = [None if d == -1 else _reshape_dim(ctx, i, d, x.shape) for i, d in enumerate(target)]
    if x.shape is None:
        return TensorType(x.dtype, out)
    if -1 in ints:
        at = list(target).index(-1)
        out[at] = _inferred_dim(ctx, x.shape, out[:at] + out[at + 1:])
    else:
        _check_same_size(ctx, x.shape, out)
    return TensorType(x.dtype, out)


@op("Reshape", inputs=[In("data", ANY), In("shape", INT64, rank=1)], outputs=["reshaped"],
    attrs=[Attr("allowzero", AttrKind.INT, 0)], infer=_infer_reshape, propagate=same_values(_infer_reshape))
def reshape(data, shape, *, allowzero=0):
    target = [int(s) for s in shape]
    if not allowzero:
        target = [data.shape[i] if s == 0 else s for i, s in enumerate(target)]
    return data.reshape(target)


# --------------------------------------------------------------------------- Flatten


def _infer_flatten(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, (None, None))
    rank = len(x.shape)
    axis = ctx.attrs["axis"]
    if not -rank <= axis <= rank:
        ctx.fail(f"axis {axis} is out of range [-{rank}, {rank}] for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    return TensorType(x.dtype, (dim_product(x.shape[:axis]), dim_product(x.shape[axis:])))


@op("Flatten", inputs=[In("input", ANY)], outputs=["output"], attrs=[Attr("axis", AttrKind.INT, 1)],
    infer=_infer_flatten)
def flatten(x, *, axis=1):
    axis = axis + x.ndim if axis < 0 else axis
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    inner = int(np.prod(x.shape[axis:], dtype=np.int64))
    return x.reshape(outer, inner)


# --------------------------------------------------------------------------- Transpose


def _infer_transpose(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    perm = ctx.attrs["perm"]
    if x.shape is None:
        return TensorType(x.dtype, None if perm is None else (None,) * len(perm))
    rank = len(x.shape)
    if perm is None:
        perm = tuple(reversed(range(rank)))
    if sorted(perm) != list(range(rank)):
        ctx.fail(f"perm {list(perm)} is not a permutation of the {rank} input axes")
    return TensorType(x.dtype, [x.shape[p] for p in perm])


@op("Transpose", inputs=[In("data", ANY)], outputs=["transposed"], attrs=[Attr("perm", AttrKind.INTS, None)],
    infer=_infer_transpose)
def transpose(x, *, perm=None):
    return np.transpose(x, perm)


# --------------------------------------------------------------------------- Squeeze / Unsqueeze


def _infer_squeeze(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if not ctx.has_input(1):
        # Without axes every size-1 dim goes: the rank is known only if every dim is.
        if not all(isinstance(d, int) for d in x.shape):
            return TensorType(x.dtype, None)
        return TensorType(x.dtype, [d for d in x.shape if d != 1])
    axes = int_values(ctx, 1)
    if axes is None:
        n = unknown_dims(ctx, 1)
        return TensorType(x.dtype, None if n is None else (None,) * (len(x.shape) - len(n)))
    axes = check_axes(ctx, axes, len(x.shape))
    for a in axes:
        if isinstance(x.shape[a], int) and x.shape[a] != 1:
            ctx.fail(f"cannot squeeze axis {a} of size {x.shape[a]} (input {list(x.shape)})")
    return TensorType(x.dtype, [d for i, d in enumerate(x.shape) if i not in axes])


@op("Squeeze", inputs=[In("data", ANY), In("axes", INT64, optional=True, rank=(0, 1))], outputs=["squeezed"],
    infer=_infer_squeeze, propagate=same_values(_infer_squeeze))
def squeeze(data, axes=None):
    if axes is None:
        return np.squeeze(data)
    return np.squeeze(data, axis=tuple(int(a) for a in axes.reshape(-1)))


def _infer_unsqueeze(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    axes = int_values(ctx, 1)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if axes is None:
        n = unknown_dims(ctx, 1)
        return TensorType(x.dtype, None if n is None else (None,) * (len(x.shape) + len(n)))
    rank = len(x.shape) + len(axes)
    axes = check_axes(ctx, axes, rank)
    rest = iter(x.shape)
    return TensorType(x.dtype, [1 if i in axes else next(rest) for i in range(rank)])


@op("Unsqueeze", inputs=[In("data", ANY), In("axes", INT64, rank=(0, 1))], outputs=["expanded"],
    infer=_infer_unsqueeze, propagate=same_values(_infer_unsqueeze))
def unsqueeze(data, axes):
    return np.expand_dims(data, tuple(int(a) for a in axes.reshape(-1)))


# --------------------------------------------------------------------------- Concat / Split


def _infer_concat(ctx: InferContext) -> TensorType:
    types = [ctx.input(i) for i in range(len(ctx.inputs))]
    dtype = types[0].dtype
    if any(t.dtype is not dtype for t in types):
        ctx.fail(f"inputs have different dtypes: {', '.join(str(t.dtype) for t in types)}")
    shapes = [t.shape for t in types if t.shape is not None]
    if not shapes:
        return TensorType(dtype, None)
    rank = len(shapes[0])
    if rank == 0 or any(len(s) != rank for s in shapes):
        ctx.fail(f"inputs must have one rank >= 1, got {', '.join(str(t) for t in types)}")
    axis = check_axis(ctx, ctx.attrs["axis"], rank)
    out = list(shapes[0])
    for s in shapes[1:]:
        for i, d in enumerate(s):
            if i == axis:
                continue
            if not dims_compatible(out[i], d):
                ctx.fail(f"inputs differ in dim {i} off the concat axis: {', '.join(str(t) for t in types)}")
            out[i] = merge_dim(out[i], d)
    all_known = len(shapes) == len(types)
    out[axis] = dim_sum([s[axis] for s in shapes]) if all_known else None
    return TensorType(dtype, out)


# Values are followed through Concat for shape vectors: a longer tensor is data, not a shape.
_SHAPE_PIECES = 64


def _propagate_concat(ctx: InferContext) -> Optional[tuple]:
    parts = [ctx.symbolic(i) for i in range(len(ctx.inputs))]
    for i, p in enumerate(parts):
        t = ctx.inputs[i]
        if p is None and t is not None and t.shape is not None and len(t.shape) == 1 and \
                isinstance(t.shape[0], int) and t.shape[0] <= _SHAPE_PIECES:
            parts[i] = (None,) * t.shape[0]  # values unknown, count known: the other parts stay known
    if any(p is None for p in parts):
        return None
    return sum(parts, ())


@op("Concat", inputs=[In("inputs", ALL, variadic=True)], outputs=["concat_result"],
    attrs=[Attr("axis", AttrKind.INT)], infer=_infer_concat, propagate=_propagate_concat)
def concat(*inputs, axis):
    return np.concatenate(inputs, axis=axis)


def _split_sizes(ctx: InferContext, dim: Dim) -> list:
    n = ctx.num_outputs
    num_outputs = ctx.attrs["num_outputs"]
    if ctx.has_input(1) == (num_outputs is not None):
        ctx.fail("give exactly one of the 'split' input and the 'num_outputs' attribute")
    if num_outputs is not None:
        if num_outputs != n:
            ctx.fail(f"num_outputs={num_outputs} but the node has {n} outputs")
        if not isinstance(dim, int):
            return [None] * n
        return _chunks(dim, n)
    sizes = int_values(ctx, 1)
    if sizes is None:
        return [None] * n
    if len(sizes) != n or any(s < 0 for s in sizes):
        ctx.fail(f"split {sizes} must hold {n} non-negative sizes, one per output")
    if isinstance(dim, int) and sum(sizes) != dim:
        ctx.fail(f"split {sizes} sums to {sum(sizes)}, the axis has size {dim}")
    return sizes


def _chunks(dim: int, n: int) -> list[int]:
    """ONNX's num_outputs split: ceil(dim / n) per chunk, the last ones smaller. Where n chunks of ceil(dim / n)
    overrun the axis (5 into 4: 2, 2, 1 and then nothing), the chunks past the end are clipped to it, as ONNX's
    reference evaluator and onnxruntime compute it: sizes 2, 2, 1, 0."""
    chunk = -(-dim // n)
    return [min(chunk, max(0, dim - chunk * i)) for i in range(n)]


def _infer_split(ctx: InferContext) -> list[TensorType]:
    x = ctx.input(0)
    if x.shape is None:
        _split_sizes(ctx, None)
        return [TensorType(x.dtype, None)] * ctx.num_outputs
    axis = check_axis(ctx, ctx.attrs["axis"], len(x.shape))
    sizes = _split_sizes(ctx, x.shape[axis])
    return [TensorType(x.dtype, x.shape[:axis] + (s,) + x.shape[axis + 1:]) for s in sizes]


@op("Split", inputs=[In("input", ALL), In("split", INT64, optional=True, rank=1)],
    outputs=[In("outputs", ALL, variadic=True)],
    attrs=[Attr("axis", AttrKind.INT, 0), Attr("num_outputs", AttrKind.INT, None)], infer=_infer_split)
def split(x, split=None, *, axis=0, num_outputs=None):
    sizes = _chunks(x.shape[axis], num_outputs) if split is None else [int(s) for s in split]
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=axis))


# --------------------------------------------------------------------------- Shape / Size


def _shape_dims(ctx: InferContext) -> Optional[tuple]:
    x = ctx.input(0)
    if x.shape is None:
        return None
    # Python slicing clamps exactly as ONNX does (negative counts from the back, then [0, rank]).
    return tuple(x.shape[slice(ctx.attrs["start"], ctx.attrs["end"])])


def _infer_shape(ctx: InferContext) -> TensorType:
    dims = _shape_dims(ctx)
    return TensorType(DType.INT64, (None if dims is None else len(dims),))


@op("Shape", inputs=[In("data", ANY)], outputs=["shape"],
    attrs=[Attr("start", AttrKind.INT, 0), Attr("end", AttrKind.INT, None)], infer=_infer_shape,
    propagate=_shape_dims)
def shape(x, *, start=0, end=None):
    return np.array(x.shape[start:end], dtype=np.int64)


def _propagate_size(ctx: InferContext) -> Optional[tuple]:
    x = ctx.input(0)
    return None if x.shape is None else (dim_product(x.shape),)


@op("Size", inputs=[In("data", ANY)], outputs=["size"], infer=lambda ctx: TensorType(DType.INT64, ()),
    propagate=_propagate_size)
def size(x):
    return np.array(x.size, dtype=np.int64)


# --------------------------------------------------------------------------- Expand / Tile


def _infer_expand(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    target = ctx.symbolic(1)
    if target is None:
        n = unknown_dims(ctx, 1)
        if n is None or x.shape is None:
            return TensorType(x.dtype, None)
        return TensorType(x.dtype, (None,) * max(len(n), len(x.shape)))
    if any(isinstance(d, int) and d < 0 for d in target):
        ctx.fail(f"shape {list(target)} has a negative dim")
    try:
        return TensorType(x.dtype, broadcast_shapes(x.shape, target))
    except ValueError as e:
        ctx.fail(f"input {x} does not broadcast to shape {list(target)}: {e}")


@op("Expand", inputs=[In("input", ALL), In("shape", INT64, rank=1)], outputs=["output"], infer=_infer_expand)
def expand(x, shape):
    out_shape = np.broadcast_shapes(x.shape, tuple(int(s) for s in shape))
    return np.array(np.broadcast_to(x, out_shape))


def _infer_tile(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    reps = ctx.symbolic(1)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if reps is None:
        return TensorType(x.dtype, (None,) * len(x.shape))
    if len(reps) != len(x.shape):
        ctx.fail(f"repeats {list(reps)} must have one entry per input axis ({len(x.shape)})")
    if any(isinstance(r, int) and r < 0 for r in reps):
        ctx.fail(f"repeats {list(reps)} must not be negative")
    return TensorType(x.dtype, [dim_mul(d, r) for d, r in zip(x.shape, reps)])


@op("Tile", inputs=[In("input", ALL), In("repeats", INT64, rank=1)], outputs=["output"], infer=_infer_tile)
def tile(x, repeats):
    return np.tile(x, [int(r) for r in repeats])
