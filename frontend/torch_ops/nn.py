"""Convolution and pooling layers (conv*, conv_transpose*, max/avg pools and their adaptive forms),
F.pad, pixel shuffles and F.unfold (resizing: resize.py).

Normalizations and embeddings live in norm.py; attention in attention.py. torch's conv/pool
also take unbatched [C, *spatial] inputs: those gain a batch dim of 1 for the IR op and lose it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.frontend.tracer import kiln_dtype

_AXIS0 = np.array([0], np.int64)


def ntuple(v: Any, n: int) -> list:
    """torch's int-or-sequence arguments (kernel_size=3, stride=(2, 1)) as a list of n ints."""
    if isinstance(v, (list, tuple, torch.Size)):
        if len(v) == 1:
            return [int(v[0])] * n
        return [int(x) for x in v]
    return [int(v)] * n


def batched(t, input: torch.Tensor, n: int, dtype=None):
    """(IR value with a batch dim, whether one was added) for an op over n spatial dims."""
    x = t.value(input, dtype)
    if input.dim() == n + 1:
        return t.emit("Unsqueeze", x, t.constant(_AXIS0, "axes")), True
    return x, False


def unbatched(t, y, added: bool):
    return t.emit("Squeeze", y, t.constant(_AXIS0, "axes")) if added else y


# ---------------------------------------------------------------------------- convolutions
def _same_pads(kernel: Sequence[int], dilation: Sequence[int]) -> list:
    """torch's padding='same': the odd pad goes at the end of each dim."""
    total = [d * (k - 1) for k, d in zip(kernel, dilation)]
    begin = [p // 2 for p in total]
    return begin + [p - b for p, b in zip(total, begin)]


def _conv_pads(padding: Any, kernel: Sequence[int], dilation: Sequence[int], n: int) -> list:
    if padding == "same":
        return _same_pads(kernel, dilation)
    if padding == "valid":
        return [0] * (2 * n)
    p = ntuple(padding, n)
    return p + p


def _conv(t, res, n: int, input, weight, bias, stride, padding, dilation, groups):
    dt = kiln_dtype(res.dtype)
    kernel = list(weight.shape[2:])
    dilation = ntuple(dilation, n)
    x, added = batched(t, input, n, dt)
    inputs = [x, t.value(weight, dt)] + ([t.value(bias, dt)] if bias is not None else [])
    y = t.emit("Conv", *inputs, kernel_shape=kernel, strides=ntuple(stride, n), dilations=dilation,
               pads=_conv_pads(padding, kernel, dilation, n), group=int(groups))
    return unbatched(t, y, added)


@maps(torch.conv1d)
def conv1d(t, res, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(t, res, 1, input, weight, bias, stride, padding, dilation, groups)


@maps(torch.conv2d)
def conv2d(t, res, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(t, res, 2, input, weight, bias, stride, padding, dilation, groups)


@maps(torch.conv3d)
def conv3d(t, res, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(t, res, 3, input, weight, bias, stride, padding, dilation, groups)


def _conv_transpose(t, res, n: int, input, weight, bias, stride, padding, output_padding, groups, dilation):
    dt = kiln_dtype(res.dtype)
    x, added = batched(t, input, n, dt)
    inputs = [x, t.value(weight, dt)] + ([t.value(bias, dt)] if bias is not None else [])
    pads = ntuple(padding, n)
    # ONNX adds output_padding at the end of each dim, as torch does.
    y = t.emit("ConvTranspose", *inputs, kernel_shape=list(weight.shape[2:]), strides=ntuple(stride, n),
               dilations=ntuple(dilation, n), pads=pads + pads, output_padding=ntuple(output_padding, n),
               group=int(groups))
    return unbatched(t, y, added)


@maps(torch.conv_transpose1d)
def conv_transpose1d(t, res, input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    return _conv_transpose(t, res, 1, input, weight, bias, stride, padding, output_padding, groups, dilation)


@maps(torch.conv_transpose2d)
def conv_transpose2d(t, res, input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    return _conv_transpose(t, res, 2, input, weight, bias, stride, padding, output_padding, groups, dilation)


@maps(torch.conv_transpose3d)
def conv_transpose3d(t, res, input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    return _conv_transpose(t, res, 3, input, weight, bias, stride, padding, output_padding, groups, dilation)


# ---------------------------------------------------------------------------- max / average pools
def _window(n: int, kernel_size, stride, padding) -> dict:
    kernel = ntuple(kernel_size, n)
    # stride=None (F.*) or [] (torch.*) means stride = kernel.
    strides = kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) else ntuple(stride, n)
    pads = ntuple(padding, n)
    return {"kernel_shape": kernel, "strides": strides, "pads": pads + pads}


def _max_pool(t, res, n: int, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, name):
    if return_indices:
        raise UnsupportedOpError(f"{t.where()}: {name}(return_indices=True) is not supported: kiln's MaxPool "
                                 "has no indices output")
    x, added = batched(t, input, n)
    y = t.emit("MaxPool", x, dilations=ntuple(dilation, n), ceil_mode=int(bool(ceil_mode)),
               **_window(n, kernel_size, stride, padding))
    return unbatched(t, y, added)


@maps(F.max_pool1d, torch.max_pool1d)
def max_pool1d(t, res, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool(t, res, 1, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                     "max_pool1d")


@maps(F.max_pool2d, torch.max_pool2d)
def max_pool2d(t, res, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool(t, res, 2, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                     "max_pool2d")


@maps(F.max_pool3d, torch.max_pool3d)
def max_pool3d(t, res, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool(t, res, 3, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices,
                     "max_pool3d")


# F.max_pool2d(..., return_indices=True) dispatches to these in Python, before the tracer sees it.
@maps(F.max_pool1d_with_indices, F.max_pool2d_with_indices, F.max_pool3d_with_indices,
      F.adaptive_max_pool1d_with_indices, F.adaptive_max_pool2d_with_indices, F.adaptive_max_pool3d_with_indices)
def max_pool_with_indices(t, res, input, *args, **kwargs):
    raise UnsupportedOpError(f"{t.where()}: max pooling with return_indices=True is not supported: kiln's "
                             "MaxPool has no indices output")


def _avg_pool(t, res, n: int, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
              divisor_override=None):
    if divisor_override is not None:
        raise UnsupportedOpError(f"{t.where()}: avg_pool{n}d(divisor_override={divisor_override}) is not "
                                 "supported: kiln's AveragePool divides by the window size")
    x, added = batched(t, input, n)
    y = t.emit("AveragePool", x, ceil_mode=int(bool(ceil_mode)), count_include_pad=int(bool(count_include_pad)),
               **_window(n, kernel_size, stride, padding))
    return unbatched(t, y, added)


@maps(F.avg_pool1d)
def avg_pool1d(t, res, input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    return _avg_pool(t, res, 1, input, kernel_size, stride, padding, ceil_mode, count_include_pad)


@maps(F.avg_pool2d)
def avg_pool2d(t, res, input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(t, res, 2, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@maps(F.avg_pool3d)
def avg_pool3d(t, res, input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(t, res, 3, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


# ---------------------------------------------------------------------------- adaptive pools
def _adaptive_window(t, input, n: int, output_size: list, name: str) -> Optional[dict]:
    """None for a global pool (every output size 1); else the even window that gives the output
    sizes; UnsupportedOpError when the input sizes are not known multiples of them."""
    sizes = t.value(input).type.shape[-n:]
    # An output size of None keeps the input's size.
    out = [s if o is None else int(o) for o, s in zip(output_size, sizes)]
    if all(o == 1 for o in out):
        return None
    if all(isinstance(s, int) and isinstance(o, int) and s % o == 0 for s, o in zip(sizes, out)):
        kernel = [s // o for s, o in zip(sizes, out)]
        return {"kernel_shape": kernel, "strides": kernel, "pads": [0] * (2 * n)}
    raise UnsupportedOpError(
        f"{t.where()}: {name} from spatial size {list(sizes)} to {out} is not supported: kiln maps adaptive "
        "pooling to global pooling or to an even window, which needs static input sizes divisible by the output")


def _adaptive_list(output_size, n: int) -> list:
    if isinstance(output_size, (list, tuple, torch.Size)):
        return list(output_size) if len(output_size) == n else list(output_size) * n
    return [output_size] * n


def _adaptive(t, input, n: int, output_size, global_op: str, window_op: str, name: str):
    window = _adaptive_window(t, input, n, _adaptive_list(output_size, n), name)
    x, added = batched(t, input, n)
    y = t.emit(global_op, x) if window is None else t.emit(window_op, x, **window)
    return unbatched(t, y, added)


@maps(F.adaptive_avg_pool1d)
def adaptive_avg_pool1d(t, res, input, output_size):
    return _adaptive(t, input, 1, output_size, "GlobalAveragePool", "AveragePool", "adaptive_avg_pool1d")


@maps(F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d)
def adaptive_avg_pool2d(t, res, input, output_size):
    return _adaptive(t, input, 2, output_size, "GlobalAveragePool", "AveragePool", "adaptive_avg_pool2d")


@maps(F.adaptive_avg_pool3d, torch._C._nn.adaptive_avg_pool3d)
def adaptive_avg_pool3d(t, res, input, output_size):
    return _adaptive(t, input, 3, output_size, "GlobalAveragePool", "AveragePool", "adaptive_avg_pool3d")


def _adaptive_max(t, input, n: int, output_size, return_indices: bool):
    name = f"adaptive_max_pool{n}d"
    if return_indices:
        raise UnsupportedOpError(f"{t.where()}: {name}(return_indices=True) is not supported: kiln's MaxPool "
                                 "has no indices output")
    return _adaptive(t, input, n, output_size, "GlobalMaxPool", "MaxPool", name)


@maps(F.adaptive_max_pool1d)
def adaptive_max_pool1d(t, res, input, output_size, return_indices=False):
    return _adaptive_max(t, input, 1, output_size, return_indices)


@maps(F.adaptive_max_pool2d)
def adaptive_max_pool2d(t, res, input, output_size, return_indices=False):
    return _adaptive_max(t, input, 2, output_size, return_indices)


@maps(F.adaptive_max_pool3d)
def adaptive_max_pool3d(t, res, input, output_size, return_indices=False):
    return _adaptive_max(t, input, 3, output_size, return_indices)


# ---------------------------------------------------------------------------- padding
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def _circular(t, x, begins: list, ends: list, axes: list):
    """Wrap-around padding: the last ``begin`` entries go in front, the first ``end`` behind."""
    big = np.iinfo(np.int64).max
    for b, e, a in zip(begins, ends, axes):
        ax = t.constant(np.array([a], np.int64), "axes")
        parts = [x]
        if b:
            parts.insert(0, t.emit("Slice", x, t.constant(np.array([-b], np.int64)),
                                   t.constant(np.array([big], np.int64)), ax))
        if e:
            parts.append(t.emit("Slice", x, t.constant(np.array([0], np.int64)),
                                t.constant(np.array([e], np.int64)), ax))
        x = t.emit("Concat", *parts, axis=a) if len(parts) > 1 else x
    return x


@maps(F.pad, torch._C._nn.pad)
def functional_pad(t, res, input, pad, mode="constant", value=None):
    return _pad(t, input, pad, mode, value)


@maps(torch.constant_pad_nd)
def constant_pad_nd(t, res, input, pad, value=0):
    return _pad(t, input, pad, "constant", value)


def _pad(t, input, pad, mode, value):
    if mode not in _PAD_MODES and mode != "circular":
        raise UnsupportedOpError(f"{t.where()}: F.pad(mode='{mode}') is not supported")
    pad = list(pad)
    rank = input.dim()
    # torch lists (begin, end) pairs from the last dim backwards; ONNX wants begins then ends.
    axes = [rank - 1 - i for i in range(len(pad) // 2)]
    begins, ends = pad[0::2], pad[1::2]
    x = t.value(input)
    if mode == "circular":
        if any(int(p) < 0 for p in pad):
            raise UnsupportedOpError(f"{t.where()}: F.pad(mode='circular') with negative pads is not supported")
        return _circular(t, x, [int(b) for b in begins], [int(e) for e in ends], axes)
    inputs = [x, t.shape_value(begins + ends)]
    if mode == "constant":
        inputs.append(t.scalar(0 if value is None else value, x.type.dtype))
    else:
        inputs.append(None)
    inputs.append(t.constant(np.array(axes, np.int64), "axes"))
    return t.emit("Pad", *inputs, mode=_PAD_MODES[mode])


# ---------------------------------------------------------------------------- pixel shuffles
@maps(F.pixel_shuffle)
def pixel_shuffle(t, res, input, upscale_factor):
    if input.dim() not in (3, 4):
        raise UnsupportedOpError(f"{t.where()}: pixel_shuffle of a {input.dim()}-D tensor is not supported "
                                 "(kiln maps [N, C, H, W] and [C, H, W])")
    x, added = batched(t, input, 2)
    # torch reads the channel axis as (depth, block row, block col): DepthToSpace's CRD order.
    y = t.emit("DepthToSpace", x, blocksize=int(upscale_factor), mode="CRD")
    return unbatched(t, y, added)


@maps(F.pixel_unshuffle)
def pixel_unshuffle(t, res, input, downscale_factor):
    r = int(downscale_factor)
    lead = [dim_of(t, input, i) for i in range(input.dim() - 3)]
    c, h, w = (dim_of(t, input, i) for i in range(-3, 0))
    # out[..., c*r*r + i*r + j, y, x] = in[..., c, y*r + i, x*r + j]
    split = t.emit("Reshape", t.value(input), t.shape_value(lead + [c, h // r, r, w // r, r]))
    k = len(lead)
    perm = list(range(k)) + [k, k + 2, k + 4, k + 1, k + 3]
    moved = t.emit("Transpose", split, perm=perm)
    return t.emit("Reshape", moved, t.shape_value(lead + [c * (r * r), h // r, w // r]))


# ---------------------------------------------------------------------------- unfold (im2col)
@maps(torch._C._nn.im2col)
def im2col(t, res, input, kernel_size, dilation, padding, stride):
    """F.unfold / nn.Unfold: every kernel tap of every channel as a row. A grouped Conv with one
    group per channel and a one-hot filter per tap computes exactly that, in torch's row order
    (channel, then tap row, then tap column), with torch's padding, stride and dilation."""
    kh, kw = ntuple(kernel_size, 2)
    c = input.shape[-3]
    shape = t.value(input).type.shape
    if shape is None or not isinstance(shape[-3], int):
        raise UnsupportedOpError(f"{t.where()}: F.unfold of a tensor whose channel dim is symbolic is not supported")
    dt = kiln_dtype(res.dtype)
    taps = np.eye(kh * kw, dtype=dt.numpy).reshape(kh * kw, 1, kh, kw)
    weight = t.constant(np.ascontiguousarray(np.tile(taps, (c, 1, 1, 1))), "unfold_taps")
    x, added = batched(t, input, 2, dt)
    pads = ntuple(padding, 2)
    y = t.emit("Conv", x, weight, kernel_shape=[kh, kw], strides=ntuple(stride, 2), dilations=ntuple(dilation, 2),
               pads=pads + pads, group=int(c))
    y = t.emit("Reshape", y, t.shape_value([0, c * kh * kw, -1]))
    return unbatched(t, y, added)
