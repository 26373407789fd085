"""``GridSample`` (ai.onnx 16/20/22): sample X [N, C, D1..Dr] at the normalized positions of a grid
[N, O1..Or, r] (the last axis lists the coordinates innermost dim first, x then y [then z]), with nearest, linear
or cubic (Keys, a = -0.75) interpolation and zeros, border or reflection padding; ``align_corners`` maps -1 and 1
to the centers (else the outer edges) of the corner pixels. The rules, including where ONNX rounds (nearest
rounds half to even, as PyTorch; a reflected index truncates toward zero), follow ONNX's reference evaluator; this
one is vectorized over the output (one gather per interpolation tap).

kiln implements GridSample-20/22 (any rank, modes 'linear'/'nearest'/'cubic') and imports GridSample-16, the
4-D form whose modes are spelled 'bilinear' and 'bicubic', as it is: those spellings are taken as 'linear' and
'cubic'.
"""
from __future__ import annotations

import itertools

import numpy as np

from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, merge_dim

_MODES = {"linear": "linear", "bilinear": "linear", "nearest": "nearest", "cubic": "cubic", "bicubic": "cubic"}
_PADDING = ("zeros", "border", "reflection")


def _infer_grid_sample(ctx: InferContext) -> TensorType:
    x, grid = ctx.input(0), ctx.input(1)
    if ctx.attrs["mode"] not in _MODES:
        ctx.fail(f"mode must be one of {sorted(_MODES)}, not {ctx.attrs['mode']!r}")
    if ctx.attrs["padding_mode"] not in _PADDING:
        ctx.fail(f"padding_mode must be one of {list(_PADDING)}, not {ctx.attrs['padding_mode']!r}")
    if grid.dtype is not x.dtype:
        ctx.fail(f"grid is {grid.dtype} but X is {x.dtype}; kiln takes one float type for both")
    if x.shape is None or grid.shape is None:
        return TensorType(x.dtype, None)
    r = len(x.shape) - 2
    if r < 1:
        ctx.fail(f"X must have rank >= 3 ([N, C, D1, ...]), got {list(x.shape)}")
    if len(grid.shape) != r + 2:
        ctx.fail(f"grid must have rank {r + 2} ([N, O1..O{r}, {r}]) for X of rank {r + 2}, got {list(grid.shape)}")
    if isinstance(grid.shape[-1], int) and grid.shape[-1] != r:
        ctx.fail(f"grid's last dim must be {r} (one coordinate per spatial dim of X), got {grid.shape[-1]}")
    if ctx.attrs["mode"] in ("cubic", "bicubic") and r != 2:
        ctx.fail(f"cubic mode takes 4-D X (2 spatial dims), got {r} spatial dims")
    try:
        n = merge_dim(x.shape[0], grid.shape[0])
    except ValueError:
        ctx.fail(f"X has batch {x.shape[0]} and grid {grid.shape[0]}")
    return TensorType(x.dtype, (n, x.shape[1], *grid.shape[1:-1]))


def _reflect(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflect by the near border until inside [lo, hi] (ONNX's _gs_reflect, vectorized)."""
    span = hi - lo
    if span <= 0:
        return np.full_like(v, lo)
    below, above = v < lo, v > hi
    dx = np.where(below, lo - v, np.where(above, v - hi, 0.0))
    n = np.trunc(dx / span)
    r = dx - n * span
    even = np.fmod(n, 2) == 0
    out = np.where(below, np.where(even, lo + r, hi - r), v)
    return np.where(above, np.where(even, hi - r, lo + r), out)


def _cubic_weights(t: np.ndarray) -> list:
    a = -0.75
    t = np.abs(t)
    u = 1 - t
    return [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * u - (a + 3)) * u * u + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]


@op("GridSample", inputs=[In("X", FLOAT), In("grid", FLOAT)], outputs=["Y"],
    attrs=[Attr("align_corners", AttrKind.INT, 0), Attr("mode", AttrKind.STRING, "linear"),
           Attr("padding_mode", AttrKind.STRING, "zeros")],
    infer=_infer_grid_sample)
def grid_sample(x, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    """X sampled at the grid's positions (module docstring)."""
    mode = _MODES[mode]
    acc = np.float64
    n_batch, channels, *dims = x.shape
    r = len(dims)
    out_shape = grid.shape[1:-1]
    if n_batch == 0 or channels == 0 or 0 in out_shape:
        return np.zeros((n_batch, channels, *out_shape), x.dtype)
    g = grid.astype(acc)
    lo = [0.0 if align_corners else -0.5 for _ in dims]
    hi = [d - 1.0 if align_corners else d - 0.5 for d in dims]
    coords = []
    for i, d in enumerate(dims):
        c = g[..., r - 1 - i]
        c = (c + 1) / 2 * (d - 1) if align_corners else ((c + 1) * d - 1) / 2
        if mode == "nearest":
            c = np.rint(c)
        outside = (c < lo[i]) | (c > hi[i])
        if padding_mode == "border":
            c = np.where(outside, np.clip(c, 0, d - 1), c)
        elif padding_mode == "reflection":
            c = np.where(outside, _reflect(c, lo[i], hi[i]), c)
        coords.append(c)

    data = np.moveaxis(x.astype(compute_dtype(x.dtype)).astype(acc), 1, -1)  # [N, D1..Dr, C]
    batch = np.arange(n_batch).reshape((n_batch,) + (1,) * len(out_shape))

    def taps(i: int) -> list:
        """(index, weight) pairs along spatial dim i."""
        c = coords[i]
        if mode == "nearest":
            return [(c.astype(np.int64), None)]
        base = np.floor(c)
        t = c - base
        base = base.astype(np.int64)
        if mode == "linear":
            return [(base, 1 - t), (base + 1, t)]
        return [(base + k - 1, w) for k, w in enumerate(_cubic_weights(t))]

    def lookup(i: int, idx: np.ndarray) -> tuple:
        """(index clipped into the dim, mask of valid taps or None) under the padding rule."""
        d = dims[i]
        if padding_mode == "zeros":
            return np.clip(idx, 0, d - 1), (idx >= 0) & (idx < d)
        if padding_mode == "border":
            return np.clip(idx, 0, d - 1), None
        return np.trunc(_reflect(idx.astype(acc), lo[i], hi[i])).astype(np.int64).clip(0, d - 1), None

    y = np.zeros((n_batch, *out_shape, channels), acc)
    for combo in itertools.product(*(taps(i) for i in range(r))):
        weight = np.ones((n_batch, *out_shape), acc)
        index = []
        for i, (idx, w) in enumerate(combo):
            clipped, valid = lookup(i, idx)
            index.append(clipped)
            if w is not None:
                weight = weight * w
            if valid is not None:
                weight = weight * valid
        y += weight[..., None] * data[(batch, *index)]
    return np.moveaxis(y, -1, 1).astype(x.dtype)
