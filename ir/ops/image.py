"""Image-layout ops of ai.onnx: ``AffineGrid`` (20), ``Col2Im`` (18), ``CenterCropPad`` (18) and ``MaxUnpool``
(11; 9 and 22 import as it). Semantics and rounding follow ONNX's reference evaluator (onnx/reference/ops); each
kernel here is vectorized (Col2Im and MaxUnpool loop over the block's taps / nothing, never over elements).

``AffineGrid(theta [N, 2, 3] | [N, 3, 4], size [N, C, H, W] | [N, C, D, H, W])``: the sampling grid
[N, H, W, 2] (or [N, D, H, W, 3]) that GridSample takes: theta applied to the homogeneous positions [x, y, (z), 1]
of a grid spaced evenly over [-1, 1] in each spatial dim (x along W, innermost). ``align_corners=1`` puts -1 and 1
on the centers of the corner pixels (position i of n: -1 + 2i / (n - 1)), ``align_corners=0`` on their outer edges
((2i + 1) / n - 1). Computed in float64 and rounded once to theta's type. A dim of 1 with ``align_corners=1`` has
no defined position: kiln puts it at -1, as ONNX's reference evaluator does (the op's ONNX function body gives NaN
there, onnxruntime 1, PyTorch's affine_grid 0). size's N must be theta's N (ONNX's reference reads N from theta,
its shape inference from size: kiln takes a model where they differ as invalid).

``Col2Im(input [N, C * prod(block_shape), L], image_shape [n], block_shape [n])``: the inverse of im2col
(PyTorch's ``fold``) in n spatial dims: column k of block l is added at image position
l_i * strides_i - pads_begin_i + k_i * dilations_i (the block enumerated row-major over the blocks grid, its
elements row-major over block_shape); L must be the number of blocks,
prod((image_i + pads_begin_i + pads_end_i - (dilations_i * (block_i - 1) + 1)) // strides_i + 1). Overlaps sum:
16-bit floats in float32 rounded once, integers in their own type (wrapping as numpy does), bool as a logical or
(numpy's ``+=`` on bool, which ONNX's reference uses).

``CenterCropPad(input_data, shape [len(axes)])``: each listed axis (``axes``, default all; negative counts from
the back) cropped to a centered window or zero-padded around the input: the window starts at
floor((dim - target) / 2), the padding puts floor((target - dim) / 2) before (the odd element after).

``MaxUnpool(X [N, C, D1..Dr], I [same shape], output_shape [r + 2]?)``: X's elements written at the flat
positions I gives (row-major over the whole output N x C x D1..Dr, as MaxPool's Indices), zeros elsewhere. The
output is the shape unpooling infers, (D_i - 1) * strides_i - pads_begin_i - pads_end_i + kernel_shape_i per
spatial dim; an ``output_shape`` that is larger (same N and C, each spatial dim at least the inferred one) extends
it with zeros at the end of each spatial axis, the indices still addressing the inferred shape. That is ONNX's
reference evaluator and its backend test ``test_maxunpool_export_with_output_shape``; onnxruntime reads the indices
as positions in ``output_shape`` instead, so the two runtimes differ when output_shape is not the inferred shape.
An index written twice keeps the later element of X (row-major order), as the reference's loop does; an index
outside [0, size of the inferred shape) is an error. MaxUnpool-9 differs from 11 only in that 11 documents strides'
default of 1 (onnx's version converter upgrades 10 -> 11 with a CompatibleAdapter); 22 adds bfloat16.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np

from kiln.ir.ops._common import ALL, FLOAT, INDEX, compute_dtype
from kiln.ir.ops._dims import INT64, check_axes, unknown_dims
from kiln.ir.registry import REQUIRED, Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, dims_compatible, merge_dim


def _known(d: Dim) -> bool:
    return isinstance(d, int)


def _shape_values(ctx: InferContext, i: int) -> Optional[tuple]:
    """The values of 1-D shape input i as dims (ints, symbols or None), or None when unknown."""
    if not ctx.has_input(i):
        return None
    return ctx.symbolic(i)


def _length(ctx: InferContext, i: int) -> Optional[int]:
    """How many elements 1-D input i has, when known."""
    dims = unknown_dims(ctx, i)
    return None if dims is None else len(dims)


# --------------------------------------------------------------------------- AffineGrid


def _infer_affine_grid(ctx: InferContext) -> TensorType:
    theta = ctx.input(0)
    if ctx.attrs["align_corners"] not in (0, 1):
        ctx.fail(f"align_corners must be 0 or 1, not {ctx.attrs['align_corners']}")
    r = None
    n: Dim = None
    if theta.shape is not None:
        if len(theta.shape) != 3:
            ctx.fail(f"theta must have rank 3 ([N, 2, 3] for 2-D, [N, 3, 4] for 3-D), got {list(theta.shape)}")
        n, rows, cols = theta.shape
        if _known(rows) and rows not in (2, 3):
            ctx.fail(f"theta must be [N, 2, 3] (2-D) or [N, 3, 4] (3-D), got {list(theta.shape)}")
        if _known(rows):
            r = rows
        if _known(cols) and (cols not in (3, 4) or (r is not None and cols != r + 1)):
            ctx.fail(f"theta must be [N, 2, 3] (2-D) or [N, 3, 4] (3-D), got {list(theta.shape)}")
        if r is None and _known(cols):
            r = cols - 1
    length = _length(ctx, 1)
    if length is not None:
        if length not in (4, 5) or (r is not None and length != r + 2):
            want = "4 ([N, C, H, W])" if r == 2 else "5 ([N, C, D, H, W])" if r == 3 else "4 or 5"
            ctx.fail(f"size must hold {want} elements for theta {list(theta.shape or [])}, got {length}")
        r = length - 2
    size = _shape_values(ctx, 1)
    if r is None:
        return TensorType(theta.dtype, None)
    if size is None:
        return TensorType(theta.dtype, (n,) + (None,) * r + (r,))
    if len(size) != r + 2:
        ctx.fail(f"size must hold {r + 2} elements for theta {list(theta.shape or [])}, got {list(size)}")
    if any(_known(d) and d < 0 for d in size):
        ctx.fail(f"size {list(size)} has a negative dim")
    if not dims_compatible(n, size[0]):
        ctx.fail(f"size's batch {size[0]} is not theta's {n}")
    n = merge_dim(n, size[0])
    return TensorType(theta.dtype, (n, *size[2:], r))


def _grid_axis(n: int, align_corners: int) -> np.ndarray:
    """The n evenly spaced positions over [-1, 1] along one spatial dim (float64)."""
    i = np.arange(n, dtype=np.float64)
    if align_corners:
        return np.full(n, -1.0) if n == 1 else -1.0 + i * (2.0 / (n - 1))
    return (2.0 * i + 1.0) / n - 1.0


@op("AffineGrid", inputs=[In("theta", FLOAT, rank=3), In("size", INT64, rank=1)], outputs=["grid"],
    attrs=[Attr("align_corners", AttrKind.INT, 0)], infer=_infer_affine_grid)
def affine_grid(theta, size, *, align_corners=0):
    """theta applied to a grid spaced evenly over [-1, 1] (module docstring)."""
    n, r, cols = theta.shape
    if (r, cols) not in ((2, 3), (3, 4)):
        raise ValueError(f"theta must be [N, 2, 3] (2-D) or [N, 3, 4] (3-D), got {list(theta.shape)}")
    dims = [int(d) for d in np.asarray(size).reshape(-1)]
    if len(dims) != r + 2:
        raise ValueError(f"size must hold {r + 2} elements for theta {list(theta.shape)}, got {dims}")
    if dims[0] != n:
        raise ValueError(f"size's batch {dims[0]} is not theta's {n}")
    spatial = dims[2:]
    if any(d < 0 for d in spatial):
        raise ValueError(f"size {dims} has a negative dim")
    # Homogeneous positions [x, y, (z), 1] over the spatial grid (x varies along the last dim).
    axes = np.meshgrid(*(_grid_axis(d, align_corners) for d in spatial), indexing="ij")
    base = np.stack([*reversed(axes), np.ones(spatial)], axis=-1).reshape(-1, r + 1)
    t = theta.astype(np.float64)
    grid = np.matmul(base, np.swapaxes(t, 1, 2))  # [N, prod(spatial), r]
    return grid.reshape((n, *spatial, r)).astype(theta.dtype)


# --------------------------------------------------------------------------- Col2Im


def _col2im_attrs(attrs: dict, n: int, fail) -> tuple:
    """(strides, dilations, pads_begin, pads_end) for n spatial dims, checked."""
    strides = [1] * n if attrs.get("strides") is None else [int(v) for v in attrs["strides"]]
    dilations = [1] * n if attrs.get("dilations") is None else [int(v) for v in attrs["dilations"]]
    pads = [0] * (2 * n) if attrs.get("pads") is None else [int(v) for v in attrs["pads"]]
    if len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
        fail(f"strides {strides}, dilations {dilations} and pads {pads} must have {n}, {n} and {2 * n} entries "
             f"for {n} spatial dims")
    if any(v < 1 for v in strides) or any(v < 1 for v in dilations):
        fail(f"strides {strides} and dilations {dilations} must be >= 1")
    if any(v < 0 for v in pads):
        fail(f"pads {pads} must be >= 0")
    return strides, dilations, pads[:n], pads[n:]


def _col2im_blocks(image: Sequence[int], block: Sequence[int], strides, dilations, begin, end, fail) -> list:
    """The number of blocks along each spatial dim."""
    counts = []
    for i, (d, b, s, dl, pb, pe) in enumerate(zip(image, block, strides, dilations, begin, end)):
        span = dl * (b - 1) + 1
        if d + pb + pe < span:
            fail(f"the block along spatial dim {i} spans {span} (block {b}, dilation {dl}), more than the padded "
                 f"image ({d} + pads {pb} + {pe})")
        counts.append((d + pb + pe - span) // s + 1)
    return counts


def _infer_col2im(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    for i, what in ((1, "image_shape"), (2, "block_shape")):
        t = ctx.input(i)
        if t.shape is not None and len(t.shape) != 1:
            ctx.fail(f"{what} must be a 1-D tensor, got shape {list(t.shape)}")
    if x.shape is not None and len(x.shape) != 3:
        ctx.fail(f"input must have rank 3 ([N, C * prod(block_shape), L]), got {list(x.shape)}")
    image, block = _shape_values(ctx, 1), _shape_values(ctx, 2)
    n_img, n_blk = _length(ctx, 1), _length(ctx, 2)
    if n_img is not None and n_blk is not None and n_img != n_blk:
        ctx.fail(f"image_shape has {n_img} elements and block_shape {n_blk}; one per spatial dim each")
    n = next((v for v in (n_img, n_blk, None if image is None else len(image), None if block is None else len(block))
              if v is not None), None)
    if n is not None:
        if n < 1:
            ctx.fail("image_shape and block_shape must name at least one spatial dim")
        strides, dilations, begin, end = _col2im_attrs(ctx.attrs, n, ctx.fail)
    if block is not None and any(_known(b) and b < 1 for b in block):
        ctx.fail(f"block_shape {list(block)} must be >= 1")
    if image is not None and any(_known(d) and d < 0 for d in image):
        ctx.fail(f"image_shape {list(image)} has a negative dim")
    if x.shape is None:
        return TensorType(x.dtype, None if n is None else (None,) * (n + 2))
    batch, channels, blocks = x.shape
    c: Dim = None
    if block is not None and all(_known(b) for b in block):
        k = int(np.prod(block))
        if _known(channels):
            if channels % k:
                ctx.fail(f"input's dim 1 ({channels}) is not a multiple of prod(block_shape {list(block)}) = {k}")
            c = channels // k
        if image is not None and all(_known(d) for d in image):
            counts = _col2im_blocks(image, block, strides, dilations, begin, end, ctx.fail)
            if _known(blocks) and blocks != int(np.prod(counts)):
                ctx.fail(f"input has {blocks} blocks (dim 2), but image_shape {list(image)}, block_shape "
                         f"{list(block)}, strides {strides}, dilations {dilations} and pads {begin + end} make "
                         f"{' x '.join(map(str, counts))} = {int(np.prod(counts))}")
    if n is None:
        return TensorType(x.dtype, None)
    spatial = tuple(image) if image is not None else (None,) * n
    return TensorType(x.dtype, (batch, c, *spatial))


@op("Col2Im", inputs=[In("input", ALL, rank=3), In("image_shape", INT64, rank=1), In("block_shape", INT64, rank=1)],
    outputs=["output"],
    attrs=[Attr("dilations", AttrKind.INTS, None), Attr("pads", AttrKind.INTS, None), Attr("strides", AttrKind.INTS, None)],
    infer=_infer_col2im)
def col2im(x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Column blocks summed back into an image (module docstring): one strided add per block tap."""
    image = [int(d) for d in np.asarray(image_shape).reshape(-1)]
    block = [int(b) for b in np.asarray(block_shape).reshape(-1)]

    def fail(msg):
        raise ValueError(msg)

    n = len(image)
    if n < 1 or len(block) != n:
        fail(f"image_shape {image} and block_shape {block} must have one (and the same number of) entry per "
             f"spatial dim")
    if any(b < 1 for b in block) or any(d < 0 for d in image):
        fail(f"block_shape {block} must be >= 1 and image_shape {image} >= 0")
    st, dl, begin, end = _col2im_attrs({"strides": strides, "dilations": dilations, "pads": pads}, n, fail)
    counts = _col2im_blocks(image, block, st, dl, begin, end, fail)
    batch, channels, blocks = x.shape
    k = int(np.prod(block))
    if channels % k:
        fail(f"input's dim 1 ({channels}) is not a multiple of prod(block_shape {block}) = {k}")
    if blocks != int(np.prod(counts)):
        fail(f"input has {blocks} blocks (dim 2), but the image and block shapes make "
             f"{' x '.join(map(str, counts))} = {int(np.prod(counts))}")
    c = channels // k
    acc = compute_dtype(x.dtype) if x.dtype.kind not in "b" else x.dtype
    cols = x.astype(acc).reshape((batch, c, *block, *counts))
    canvas = np.zeros((batch, c, *(d + pb + pe for d, pb, pe in zip(image, begin, end))), acc)
    for tap in itertools.product(*(range(b) for b in block)):
        where = tuple(slice(t * d, t * d + s * (m - 1) + 1, s) for t, d, s, m in zip(tap, dl, st, counts))
        canvas[(slice(None), slice(None), *where)] += cols[(slice(None), slice(None), *tap)]
    out = canvas[(slice(None), slice(None), *(slice(pb, pb + d) for pb, d in zip(begin, image)))]
    return np.ascontiguousarray(out).astype(x.dtype)


# --------------------------------------------------------------------------- CenterCropPad


def _infer_center_crop_pad(ctx: InferContext) -> TensorType:
    x, shape_t = ctx.input(0), ctx.input(1)
    if shape_t.shape is not None and len(shape_t.shape) != 1:
        ctx.fail(f"shape must be a 1-D tensor, got shape {list(shape_t.shape)}")
    if x.shape is None:
        return TensorType(x.dtype, None)
    rank = len(x.shape)
    given = ctx.attrs.get("axes")
    axes = list(range(rank)) if given is None else check_axes(ctx, [int(a) for a in given], rank)
    length = _length(ctx, 1)
    if length is not None and length != len(axes):
        ctx.fail(f"shape has {length} elements but there are {len(axes)} axes "
                 f"({'all of the input' if given is None else list(given)}); one target size per axis")
    target = _shape_values(ctx, 1)
    if target is not None and any(_known(d) and d < 0 for d in target):
        ctx.fail(f"shape {list(target)} has a negative dim")
    out = list(x.shape)
    for i, a in enumerate(axes):
        out[a] = target[i] if target is not None else None
    return TensorType(x.dtype, out)


@op("CenterCropPad", inputs=[In("input_data", ALL), In("shape", INDEX, rank=1)], outputs=["output_data"],
    attrs=[Attr("axes", AttrKind.INTS, None)], infer=_infer_center_crop_pad)
def center_crop_pad(x, shape, *, axes=None):
    """Each axis cropped to a centered window or zero-padded around the input (module docstring)."""
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [int(a) for a in axes]
    if any(not -rank <= a < rank for a in axes):
        raise ValueError(f"axes {axes} out of range for an input of rank {rank}")
    axes = [a % rank for a in axes]
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {axes} name an axis twice")
    target = [int(v) for v in np.asarray(shape).reshape(-1)]
    if len(target) != len(axes):
        raise ValueError(f"shape {target} must have one element per axis ({len(axes)})")
    if any(t < 0 for t in target):
        raise ValueError(f"shape {target} has a negative dim")
    out_shape = list(x.shape)
    src = [slice(None)] * rank
    dst = [slice(None)] * rank
    for a, t in zip(axes, target):
        d = x.shape[a]
        out_shape[a] = t
        if t < d:
            start = (d - t) // 2
            src[a] = slice(start, start + t)
        elif t > d:
            start = (t - d) // 2
            dst[a] = slice(start, start + d)
    out = np.zeros(out_shape, x.dtype)
    out[tuple(dst)] = x[tuple(src)]
    return out


# --------------------------------------------------------------------------- MaxUnpool


def _unpool_attrs(attrs: dict, r: int, fail) -> tuple:
    """(kernel_shape, strides, pads_begin, pads_end) for r spatial dims, checked."""
    kernel = [int(v) for v in attrs["kernel_shape"]]
    strides = [1] * r if attrs.get("strides") is None else [int(v) for v in attrs["strides"]]
    pads = [0] * (2 * r) if attrs.get("pads") is None else [int(v) for v in attrs["pads"]]
    if len(kernel) != r or len(strides) != r or len(pads) != 2 * r:
        fail(f"kernel_shape {kernel}, strides {strides} and pads {pads} must have {r}, {r} and {2 * r} entries "
             f"for X with {r} spatial dims")
    if any(v < 1 for v in kernel) or any(v < 1 for v in strides):
        fail(f"kernel_shape {kernel} and strides {strides} must be >= 1")
    if any(v < 0 for v in pads):
        fail(f"pads {pads} must be >= 0")
    return kernel, strides, pads[:r], pads[r:]


def _unpooled(d: Dim, k: int, s: int, pb: int, pe: int, axis: int, fail) -> Dim:
    if not _known(d):
        return None
    out = (d - 1) * s - pb - pe + k
    if out < 0:
        fail(f"spatial dim {axis} unpools to {out} ((X's {d} - 1) * stride {s} - pads {pb} + {pe} + kernel {k})")
    return out


def _infer_max_unpool(ctx: InferContext) -> TensorType:
    x, idx = ctx.input(0), ctx.input(1)
    if x.shape is None:
        length = _length(ctx, 2)
        return TensorType(x.dtype, None if length is None else (None,) * length)
    rank = len(x.shape)
    if rank < 3:
        ctx.fail(f"X must have rank >= 3 ([N, C, D1, ...]), got {list(x.shape)}")
    r = rank - 2
    kernel, strides, begin, end = _unpool_attrs(ctx.attrs, r, ctx.fail)
    if idx.shape is not None:
        if len(idx.shape) != rank:
            ctx.fail(f"I must have X's shape {list(x.shape)}, got {list(idx.shape)}")
        if not all(dims_compatible(dx, di) for dx, di in zip(x.shape, idx.shape)):
            ctx.fail(f"I must have X's shape {list(x.shape)}, got {list(idx.shape)}")
    inferred = [*x.shape[:2], *(_unpooled(d, k, s, pb, pe, i, ctx.fail)
                                 for i, (d, k, s, pb, pe) in enumerate(zip(x.shape[2:], kernel, strides, begin, end)))]
    if not ctx.has_input(2):
        return TensorType(x.dtype, inferred)
    length = _length(ctx, 2)
    if length is not None and length != rank:
        ctx.fail(f"output_shape must have {rank} elements (X's rank), got {length}")
    given = _shape_values(ctx, 2)
    if given is None:
        return TensorType(x.dtype, (x.shape[0], x.shape[1]) + (None,) * r)
    if not all(dims_compatible(given[a], x.shape[a]) for a in (0, 1)):
        ctx.fail(f"output_shape {list(given)} must keep X's N and C ({x.shape[0]}, {x.shape[1]})")
    for a in range(2, rank):
        if _known(given[a]) and _known(inferred[a]) and given[a] < inferred[a]:
            ctx.fail(f"output_shape {list(given)} is smaller than the unpooled shape {inferred} on dim {a}")
    return TensorType(x.dtype, (merge_dim(given[0], x.shape[0]), merge_dim(given[1], x.shape[1]), *given[2:]))


@op("MaxUnpool", inputs=[In("X", FLOAT), In("I", INT64), In("output_shape", INT64, optional=True, rank=1)],
    outputs=["output"],
    attrs=[Attr("kernel_shape", AttrKind.INTS, REQUIRED), Attr("pads", AttrKind.INTS, None),
           Attr("strides", AttrKind.INTS, None)],
    infer=_infer_max_unpool)
def max_unpool(x, indices, output_shape=None, *, kernel_shape, pads=None, strides=None):
    """X scattered to the flat positions I into zeros of the unpooled shape (module docstring)."""
    def fail(msg):
        raise ValueError(msg)

    if x.ndim < 3:
        fail(f"X must have rank >= 3 ([N, C, D1, ...]), got {list(x.shape)}")
    if indices.shape != x.shape:
        fail(f"I must have X's shape {list(x.shape)}, got {list(indices.shape)}")
    r = x.ndim - 2
    kernel, st, begin, end = _unpool_attrs({"kernel_shape": kernel_shape, "strides": strides, "pads": pads}, r, fail)
    inferred = [*x.shape[:2], *(_unpooled(d, k, s, pb, pe, i, fail)
                                for i, (d, k, s, pb, pe) in enumerate(zip(x.shape[2:], kernel, st, begin, end)))]
    size = int(np.prod(inferred))
    flat_i = indices.reshape(-1)
    if flat_i.size and (flat_i.min() < 0 or flat_i.max() >= size):
        bad = int(flat_i[(flat_i < 0) | (flat_i >= size)][0])
        raise IndexError(f"index {bad} is outside [0, {size}), the unpooled shape {inferred}")
    y = np.zeros(size, x.dtype)
    # The last write of an index wins, as in the reference's loop: keep each index's last occurrence.
    _, last = np.unique(flat_i[::-1], return_index=True)
    keep = flat_i.size - 1 - last
    y[flat_i[keep]] = x.reshape(-1)[keep]
    y = y.reshape(inferred)
    if output_shape is None:
        return y
    shape = [int(v) for v in np.asarray(output_shape).reshape(-1)]
    if len(shape) != x.ndim or shape[:2] != inferred[:2] or any(g < i for g, i in zip(shape[2:], inferred[2:])):
        fail(f"output_shape {shape} must keep X's N and C and be at least the unpooled shape {inferred}")
    out = np.zeros(shape, x.dtype)
    out[tuple(slice(0, d) for d in inferred)] = y
    return out
