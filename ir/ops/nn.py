"""Convolutions: Conv and ConvTranspose (1-D, 2-D, 3-D; ONNX semantics), plus the sliding-window
geometry (kernel, strides, dilations, pads, auto_pad, ceil_mode) that the pooling ops share.

Layouts are ONNX's: X is [N, C, *spatial]; Conv's W is [M, C/group, *kernel]; ConvTranspose's
W is [C, M/group, *kernel]. The references are written for clarity: Conv multiplies windows
(a strided view, no copy) with the weights, ConvTranspose scatters each kernel tap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, dims_compatible

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _per_dim(name: str, values: Optional[Sequence[int]], n: int, default: int, minimum: int) -> tuple:
    if values is None:
        return (default,) * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values, expected {n}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} must be >= {minimum}, got {list(values)}")
    return tuple(values)


@dataclass(frozen=True)
class Window:
    """Validated sliding-window attributes, one entry per spatial dim (kernel dims may be
    None or a symbol during inference, when W's shape is not static)."""

    kernel: tuple
    strides: tuple
    dilations: tuple
    pads: tuple  # begin..., end...: the explicit pads (zeros unless auto_pad is NOTSET)
    auto_pad: str
    ceil_mode: bool

    @property
    def rank(self) -> int:
        return len(self.kernel)

    def span(self, i: int) -> Optional[int]:
        """How many input positions one window covers along dim i (dilation included)."""
        k = self.kernel[i]
        return (k - 1) * self.dilations[i] + 1 if isinstance(k, int) else None


def make_window(kernel: Sequence[Dim], *, strides: Optional[Sequence[int]] = None,
                dilations: Optional[Sequence[int]] = None, pads: Optional[Sequence[int]] = None,
                auto_pad: str = "NOTSET", ceil_mode: int = 0) -> Window:
    """Check the attributes of a conv/pool node against its number of spatial dims."""
    n = len(kernel)
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad must be one of {', '.join(AUTO_PADS)}, got '{auto_pad}'")
    if pads is not None and auto_pad != "NOTSET" and any(pads):
        raise ValueError(f"pads {list(pads)} cannot be combined with auto_pad '{auto_pad}'")
    if any(isinstance(k, int) and k < 1 for k in kernel):
        raise ValueError(f"kernel_shape must be >= 1, got {list(kernel)}")
    return Window(
        kernel=tuple(kernel),
        strides=_per_dim("strides", strides, n, 1, 1),
        dilations=_per_dim("dilations", dilations, n, 1, 1),
        pads=(0,) * (2 * n) if auto_pad != "NOTSET" else _per_dim("pads", pads, 2 * n, 0, 0),
        auto_pad=auto_pad,
        ceil_mode=bool(ceil_mode))


def window_out_dim(w: Window, i: int, size: Dim) -> Dim:
    """Output size of spatial dim i for an input of ``size`` (None when it cannot be known)."""
    s = w.strides[i]
    if w.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if isinstance(size, int):
            return -(-size // s)
        return size if s == 1 else None
    span = w.span(i)
    pb, pe = w.pads[i], w.pads[i + w.rank]
    if span is None:
        return None
    if not isinstance(size, int):
        # A window of one position that moves one step over an unpadded dim keeps its size.
        return size if span == 1 and s == 1 and pb == 0 and pe == 0 else None
    room = size + pb + pe - span
    if room < 0:
        raise ValueError(f"spatial dim {i}: input size {size} padded by ({pb}, {pe}) is smaller "
                         f"than the window extent {span}")
    if not w.ceil_mode:
        return room // s + 1
    out = -(-room // s) + 1
    # ceil_mode may add a last window; it must start inside the input or the begin padding.
    if (out - 1) * s >= size + pb:
        out -= 1
    return out


def window_out_shape(w: Window, sizes: Sequence[Dim]) -> list:
    return [window_out_dim(w, i, d) for i, d in enumerate(sizes)]


def static_pads(w: Window, sizes: Sequence[int]) -> tuple:
    """(begin, end, end_reach) per dim for static sizes: the pads in effect (auto_pad resolved)
    and how far past the input the last window reaches (end plus any ceil_mode overhang)."""
    begin, end, reach = [], [], []
    for i, size in enumerate(sizes):
        out = window_out_dim(w, i, size)
        need = (out - 1) * w.strides[i] + w.span(i)
        if w.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, need - size)
            # SAME_UPPER puts the odd padding at the end, SAME_LOWER at the beginning.
            b = total // 2 if w.auto_pad == "SAME_UPPER" else total - total // 2
            e = total - b
        else:
            b, e = w.pads[i], w.pads[i + w.rank]
        begin.append(b)
        end.append(e)
        reach.append(max(e, need - size - b))
    return begin, end, reach


def windows(xp: np.ndarray, w: Window, out: Sequence[int]) -> np.ndarray:
    """A strided view [N, C, *out, *kernel] of every window of the padded input ``xp``."""
    n = w.rank
    spans = tuple(w.span(i) for i in range(n))
    view = sliding_window_view(xp, spans, axis=tuple(range(2, 2 + n)))
    positions = tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, w.strides))
    taps = tuple(slice(None, None, d) for d in w.dilations)
    return view[(slice(None), slice(None)) + positions + taps]


def pad_spatial(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: float = 0) -> np.ndarray:
    widths = [(0, 0), (0, 0)] + [(b, e) for b, e in zip(begin, end)]
    return np.pad(x, widths, constant_values=value)


def conv_window_attrs(attrs: dict, kernel: Sequence[Dim]) -> Window:
    """The Window of a Conv/ConvTranspose node from its attributes and its kernel dims."""
    return make_window(kernel, strides=attrs["strides"], dilations=attrs["dilations"],
                       pads=attrs["pads"], auto_pad=attrs["auto_pad"])


_CONV_ATTRS = [Attr("auto_pad", AttrKind.STRING, "NOTSET"), Attr("dilations", AttrKind.INTS, None),
               Attr("group", AttrKind.INT, 1), Attr("kernel_shape", AttrKind.INTS, None),
               Attr("pads", AttrKind.INTS, None), Attr("strides", AttrKind.INTS, None)]


# --------------------------------------------------------------------------- inference shared by both convs


def check_conv_shapes(ctx: InferContext, xs: Optional[tuple], ws: Optional[tuple], names=("X", "W")) -> None:
    """group, the ranks of X and W ([N, C, *spatial], one rank) and kernel_shape against W; shapes may be None.
    ``names`` are what messages call X and W (the quantized convs' x and w take these rules too)."""
    xn, wn = names
    if ctx.attrs["group"] < 1:
        ctx.fail(f"group must be >= 1, got {ctx.attrs['group']}")
    for name, s in ((xn, xs), (wn, ws)):
        if s is not None and len(s) < 3:
            ctx.fail(f"{name} must have rank >= 3 ([N, C, *spatial]), got shape {list(s)}")
    if xs is not None and ws is not None and len(xs) != len(ws):
        ctx.fail(f"{xn} of shape {list(xs)} and {wn} of shape {list(ws)} must have the same rank")
    ks = ctx.attrs["kernel_shape"]
    if ks is not None and ws is not None:
        if len(ks) != len(ws) - 2 or not all(dims_compatible(k, d) for k, d in zip(ks, ws[2:])):
            ctx.fail(f"kernel_shape {list(ks)} does not match {wn} of shape {list(ws)}")


def _conv_inputs(ctx: InferContext) -> tuple:
    """(dtype, X shape, W shape) with dtypes, ranks and kernel_shape checked; shapes may be None."""
    x, w = ctx.input(0), ctx.input(1)
    if x.dtype is not w.dtype or (ctx.has_input(2) and ctx.input(2).dtype is not x.dtype):
        ctx.fail(f"X, W and B must share one dtype, got X {x.dtype}, W {w.dtype}")
    check_conv_shapes(ctx, x.shape, w.shape)
    return x.dtype, x.shape, w.shape


def _kernel(ctx: InferContext, ws: Optional[tuple], n: int) -> tuple:
    if ctx.attrs["kernel_shape"] is not None:
        return tuple(ctx.attrs["kernel_shape"])
    if ws is not None:
        return tuple(ws[2:])
    return (None,) * n


def _check_bias(ctx: InferContext, m: Dim) -> None:
    if not ctx.has_input(2):
        return
    b = ctx.input(2).shape
    if b is not None and (len(b) != 1 or not dims_compatible(b[0], m)):
        ctx.fail(f"bias B must have shape [{m}] (one value per output channel), got {list(b)}")


def _check_divisible(ctx: InferContext, what: str, d: Dim, group: int) -> None:
    if isinstance(d, int) and d % group:
        ctx.fail(f"{what} ({d}) is not divisible by group ({group})")


# --------------------------------------------------------------------------- Conv


def conv_output_shape(ctx: InferContext, xs: tuple, ws: Optional[tuple], names=("X", "W")) -> list:
    """Conv's output dims for X of shape ``xs`` (known rank) and W of shape ``ws`` (or None), with the channel
    and group checks; after :func:`check_conv_shapes`."""
    xn, wn = names
    group = ctx.attrs["group"]
    kernel = _kernel(ctx, ws, len(xs) - 2)
    m = ws[0] if ws is not None else None
    if ws is not None:
        c_per_group = ws[1]
        if isinstance(xs[1], int) and isinstance(c_per_group, int) and xs[1] != c_per_group * group:
            ctx.fail(f"{xn} has {xs[1]} channels but {wn}{list(ws)} with group={group} expects "
                     f"{c_per_group * group}")
        _check_divisible(ctx, "output channels M", m, group)
    _check_divisible(ctx, "input channels C", xs[1], group)
    return [xs[0], m] + window_out_shape(conv_window_attrs(ctx.attrs, kernel), xs[2:])


def infer_conv(ctx: InferContext) -> TensorType:
    dtype, xs, ws = _conv_inputs(ctx)
    if xs is None:
        return TensorType(dtype, None)
    _check_bias(ctx, ws[0] if ws is not None else None)
    return TensorType(dtype, conv_output_shape(ctx, xs, ws))


@op("Conv", traits=("anchor",), inputs=[In("X", FLOAT), In("W", FLOAT), In("B", FLOAT, optional=True)],
    attrs=_CONV_ATTRS, infer=infer_conv)
def conv(x, w, b=None, *, auto_pad, dilations, group, kernel_shape, pads, strides):
    """Cross-correlation of each group of input channels with its group of filters."""
    window = make_window(kernel_shape or w.shape[2:], strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad)
    n = window.rank
    acc = compute_dtype(x.dtype)
    out = window_out_shape(window, x.shape[2:])
    begin, end, _ = static_pads(window, x.shape[2:])
    cols = windows(pad_spatial(x.astype(acc), begin, end), window, out)  # [N, C, *out, *k]
    c_g, m_g = x.shape[1] // group, w.shape[0] // group
    tap_axes = list(range(2 + n, 2 + 2 * n))
    parts = []
    for g in range(group):
        xg = cols[:, g * c_g:(g + 1) * c_g]
        wg = w[g * m_g:(g + 1) * m_g].astype(acc)  # [M/g, C/g, *k]
        y = np.tensordot(xg, wg, axes=([1] + tap_axes, list(range(1, 2 + n))))  # [N, *out, M/g]
        parts.append(np.moveaxis(y, -1, 1))
    y = np.concatenate(parts, axis=1)
    if b is not None:
        y = y + b.astype(acc).reshape((-1,) + (1,) * n)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- ConvTranspose


@dataclass(frozen=True)
class _TransposeGeometry:
    full: tuple  # size of the uncropped result: stride * (in - 1) + span + output_padding
    begin: tuple  # how much of the full result the output skips at the start; < 0 adds zeros
    out: tuple


def _transpose_output_shape(attrs: dict, n: int) -> Optional[tuple]:
    shape = attrs["output_shape"]
    if shape is None:
        return None
    # ONNX gives the spatial dims; a full [N, C, *spatial] is accepted too.
    shape = tuple(shape[2:]) if len(shape) == n + 2 else tuple(shape)
    if len(shape) != n:
        raise ValueError(f"output_shape {list(attrs['output_shape'])} must list the {n} spatial dims")
    return shape


def transpose_out_dim(attrs: dict, w: Window, i: int, size: Dim) -> tuple:
    """(full size, begin crop, output size) of spatial dim i; each may be None when unknown."""
    s, d, k = w.strides[i], w.dilations[i], w.kernel[i]
    extra = _per_dim("output_padding", attrs["output_padding"], w.rank, 0, 0)[i]
    target = _transpose_output_shape(attrs, w.rank)
    full: Dim = None
    if isinstance(size, int) and isinstance(k, int):
        full = s * (size - 1) + extra + (k - 1) * d + 1
    if target is None and w.auto_pad in ("NOTSET", "VALID"):
        pb, pe = w.pads[i], w.pads[i + w.rank]
        if full is None:
            keeps = isinstance(k, int) and s == 1 and (k - 1) * d + extra == pb + pe
            return None, pb, (size if keeps else None)
        if full - pb - pe < 1:
            raise ValueError(f"spatial dim {i}: pads ({pb}, {pe}) leave no output from {full} positions")
        return full, pb, full - pb - pe
    if target is not None:
        out = target[i]
    else:
        out = size * s if isinstance(size, int) else (size if s == 1 else None)
    if full is None or out is None:
        return full, None, out
    total = full - out
    # SAME_UPPER crops the smaller half at the start; NOTSET and SAME_LOWER the larger one.
    begin = total // 2 if w.auto_pad == "SAME_UPPER" else total - total // 2
    return full, begin, out


def _transpose_geometry(attrs: dict, w: Window, sizes: Sequence[Dim]) -> _TransposeGeometry:
    dims = [transpose_out_dim(attrs, w, i, d) for i, d in enumerate(sizes)]
    return _TransposeGeometry(*(tuple(col) for col in zip(*dims)))


def infer_conv_transpose(ctx: InferContext) -> TensorType:
    dtype, xs, ws = _conv_inputs(ctx)
    if xs is None:
        return TensorType(dtype, None)
    group = ctx.attrs["group"]
    n = len(xs) - 2
    m: Dim = None
    if ws is not None:
        if not dims_compatible(xs[1], ws[0]):
            ctx.fail(f"X has {xs[1]} channels but W of shape {list(ws)} expects {ws[0]}")
        m = ws[1] * group if isinstance(ws[1], int) else (ws[1] if group == 1 else None)
    _check_divisible(ctx, "input channels C", xs[1], group)
    _check_bias(ctx, m)
    window = conv_window_attrs(ctx.attrs, _kernel(ctx, ws, n))
    geo = _transpose_geometry(ctx.attrs, window, xs[2:])
    return TensorType(dtype, [xs[0], m] + list(geo.out))


@op("ConvTranspose", inputs=[In("X", FLOAT), In("W", FLOAT), In("B", FLOAT, optional=True)],
    attrs=_CONV_ATTRS + [Attr("output_padding", AttrKind.INTS, None),
                         Attr("output_shape", AttrKind.INTS, None)],
    infer=infer_conv_transpose)
def conv_transpose(x, w, b=None, *, auto_pad, dilations, group, kernel_shape, output_padding,
                   output_shape, pads, strides):
    """The gradient of Conv with respect to its input: every input element scatters
    x * W[c, m, tap] to position stride * i + dilation * tap; the result is then cropped."""
    window = make_window(kernel_shape or w.shape[2:], strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad)
    n = window.rank
    acc = compute_dtype(x.dtype)
    geo = _transpose_geometry({"output_padding": output_padding, "output_shape": output_shape}, window,
                              x.shape[2:])
    # The full result lives in a buffer that also covers any output region beyond it
    # (output_shape may ask for more than the full size: those positions stay zero).
    lo = [min(0, bg) for bg in geo.begin]
    buf_size = [max(f, bg + o) - lo_i for f, bg, o, lo_i in zip(geo.full, geo.begin, geo.out, lo)]
    c_g, m_g = x.shape[1] // group, w.shape[1]
    buf = np.zeros((x.shape[0], m_g * group, *buf_size), acc)
    for g in range(group):
        xg = x[:, g * c_g:(g + 1) * c_g].astype(acc)
        wg = w[g * c_g:(g + 1) * c_g].astype(acc)  # [C/g, M/g, *k]
        contrib = np.moveaxis(np.tensordot(xg, wg, axes=([1], [0])), 1 + n, 1)  # [N, M/g, *in, *k]
        _scatter_taps(buf[:, g * m_g:(g + 1) * m_g], contrib, window, lo)
    crop = tuple(slice(bg - lo_i, bg - lo_i + o) for bg, lo_i, o in zip(geo.begin, lo, geo.out))
    y = buf[(slice(None), slice(None)) + crop]
    if b is not None:
        y = y + b.astype(acc).reshape((-1,) + (1,) * n)
    return y.astype(x.dtype)


def _scatter_taps(buf: np.ndarray, contrib: np.ndarray, window: Window, lo: Sequence[int]) -> None:
    """Add each kernel tap's products [N, M, *in] into ``buf`` at stride * i + dilation * tap
    (shifted by ``lo``, where the buffer starts before the full result)."""
    n = window.rank
    in_sizes = contrib.shape[2:2 + n]
    for tap in np.ndindex(*window.kernel):
        starts = [t * d - lo_i for t, d, lo_i in zip(tap, window.dilations, lo)]
        target = tuple(slice(st, st + s * (size - 1) + 1, s)
                       for st, s, size in zip(starts, window.strides, in_sizes))
        buf[(slice(None), slice(None)) + target] += contrib[(Ellipsis,) + tap]
