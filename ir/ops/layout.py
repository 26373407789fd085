"""Layout ops of the shape family: Pad (Pad-19: modes constant, reflect, edge and wrap), DepthToSpace and
SpaceToDepth (SpaceToDepth-28: modes DCR and CRD)."""
from __future__ import annotations

import numpy as np

from kiln.ir.ops._common import ALL, INDEX
from kiln.ir.ops._dims import INT64, as_int_list, check_axes, dim_mul, dim_sum, int_values, scalar_input
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType

# --------------------------------------------------------------------------- Pad

_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _padded_dim(ctx: InferContext, d: Dim, begin: int, end: int) -> Dim:
    out = dim_sum([d, begin, end])
    if isinstance(out, int) and out < 0:
        ctx.fail(f"pads ({begin}, {end}) crop more than the axis of size {d} holds")
    return out


def _infer_pad(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if ctx.attrs["mode"] not in _PAD_MODES:
        ctx.fail(f"mode '{ctx.attrs['mode']}' is not one of {', '.join(_PAD_MODES)}")
    if ctx.has_input(2) and scalar_input(ctx, 2, "constant_value").dtype is not x.dtype:
        ctx.fail(f"constant_value is {ctx.input(2).dtype}, data is {x.dtype}")
    if x.shape is None:
        return x
    rank = len(x.shape)
    axes = int_values(ctx, 3) if ctx.has_input(3) else list(range(rank))
    if axes is None:
        return TensorType(x.dtype, (None,) * rank)
    axes = check_axes(ctx, axes, rank)
    pads = int_values(ctx, 1)
    if pads is None:
        return TensorType(x.dtype, [None if i in axes else d for i, d in enumerate(x.shape)])
    if len(pads) != 2 * len(axes):
        ctx.fail(f"pads {pads} must hold 2 values per padded axis ({len(axes)} axes)")
    out = list(x.shape)
    for j, a in enumerate(axes):
        out[a] = _padded_dim(ctx, out[a], pads[j], pads[j + len(axes)])
    return TensorType(x.dtype, out)


@op("Pad", inputs=[In("data", ALL), In("pads", INT64, rank=1), In("constant_value", ALL, optional=True, max_elements=1),
                   In("axes", INDEX, optional=True, rank=1)], outputs=["output"],
    attrs=[Attr("mode", AttrKind.STRING, "constant")], infer=_infer_pad)
def pad(data, pads, constant_value=None, axes=None, *, mode="constant"):
    """Pad-19. Negative pads crop. For ``wrap`` (the data as a torus: an axis continues with its first
    elements) the crop comes first and the cropped data is what wraps, as onnxruntime does; the other modes
    read only the edge they pad, so the order does not matter there."""
    rank = data.ndim
    axes = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in as_int_list(axes)]
    pads = as_int_list(pads)
    widths = [(0, 0)] * rank
    for j, a in enumerate(axes):
        widths[a] = (pads[j], pads[j + len(axes)])
    # Positive pads grow the axis (numpy's "constant", "reflect" and "edge" match ONNX's);
    # negative ones crop it afterwards.
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    if mode == "wrap":
        # Output position i of a padded axis reads (i - begin) mod n: pads longer than the axis wrap more than
        # once (as numpy's pad does; CuPy's pad does not, so the indices are spelled out).
        out = data[tuple(slice(-min(b, 0), n + min(e, 0)) for n, (b, e) in zip(data.shape, widths))]
        for a, (b, e) in enumerate(grow):
            if b or e:
                n = out.shape[a]
                if n == 0:
                    raise ValueError(f"mode 'wrap' cannot pad axis {a} by ({b}, {e}): the axis holds no elements "
                                     f"(after cropping) to wrap around")
                out = np.take(out, np.arange(-b, n + e) % n, axis=a)
        return out
    if mode == "constant":
        value = 0 if constant_value is None else np.asarray(constant_value).reshape(-1)[0]
        out = np.pad(data, grow, mode="constant", constant_values=value)
    else:
        out = np.pad(data, grow, mode=mode)
    crop = tuple(slice(-min(b, 0), n + min(e, 0)) for n, (b, e) in zip(out.shape, widths))
    return out[crop]


# --------------------------------------------------------------------------- DepthToSpace / SpaceToDepth


def _divided(ctx: InferContext, d: Dim, by: int, what: str) -> Dim:
    if by == 1:
        return d
    if not isinstance(d, int):
        return None
    if d % by:
        ctx.fail(f"{what} of size {d} is not divisible by {by}")
    return d // by


def _nchw(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is not None and len(x.shape) != 4:
        ctx.fail(f"input must be 4-D (N, C, H, W), got {x}")
    if ctx.attrs["blocksize"] < 1:
        ctx.fail(f"blocksize {ctx.attrs['blocksize']} must be >= 1")
    return x


def _infer_depth_to_space(ctx: InferContext) -> TensorType:
    x = _nchw(ctx)
    b = ctx.attrs["blocksize"]
    if ctx.attrs["mode"] not in ("DCR", "CRD"):
        ctx.fail(f"mode '{ctx.attrs['mode']}' is not DCR or CRD")
    if x.shape is None:
        return TensorType(x.dtype, (None,) * 4)
    n, c, h, w = x.shape
    return TensorType(x.dtype, (n, _divided(ctx, c, b * b, "channel axis"), dim_mul(h, b), dim_mul(w, b)))


@op("DepthToSpace", inputs=[In("input", ALL)], outputs=["output"],
    attrs=[Attr("blocksize", AttrKind.INT), Attr("mode", AttrKind.STRING, "DCR")], infer=_infer_depth_to_space)
def depth_to_space(x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = blocksize
    # DCR reads the channel axis as (block row, block col, depth); CRD as (depth, row, col).
    if mode == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(n, c // (b * b), h * b, w * b)


def _infer_space_to_depth(ctx: InferContext) -> TensorType:
    x = _nchw(ctx)
    b = ctx.attrs["blocksize"]
    if ctx.attrs["mode"] not in ("DCR", "CRD"):
        ctx.fail(f"mode '{ctx.attrs['mode']}' is not DCR or CRD")
    if x.shape is None:
        return TensorType(x.dtype, (None,) * 4)
    n, c, h, w = x.shape
    return TensorType(x.dtype, (n, dim_mul(c, b * b), _divided(ctx, h, b, "height"), _divided(ctx, w, b, "width")))


@op("SpaceToDepth", inputs=[In("input", ALL)], outputs=["output"],
    attrs=[Attr("blocksize", AttrKind.INT), Attr("mode", AttrKind.STRING, "DCR")], infer=_infer_space_to_depth)
def space_to_depth(x, *, blocksize, mode="DCR"):
    """SpaceToDepth-28: each b x b block of the spatial dims moves into the channel axis, which reads
    (block row, block col, depth) for DCR (the default, SpaceToDepth-13's only order) and (depth, block
    row, block col) for CRD; each mode inverts DepthToSpace of the same mode."""
    n, c, h, w = x.shape
    b = blocksize
    t = x.reshape(n, c, h // b, b, w // b, b)
    t = t.transpose(0, 3, 5, 1, 2, 4) if mode == "DCR" else t.transpose(0, 1, 3, 5, 2, 4)
    return t.reshape(n, c * b * b, h // b, w // b)
