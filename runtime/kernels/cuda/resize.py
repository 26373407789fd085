"""Resize on the GPU: the op's own per-axis tables, computed on the host, applied by RawKernels.

The tables (kiln.ir.ops.resize.resize_plan: for each output index of each resized axis, its input
indices and weights, and tf_crop_and_resize's outside mask) depend on shapes and parameters only,
so they are made once per input shape, uploaded, and kept (a CUDA-graph replay finds them ready:
the eager warm-up before a capture fills the cache). Because the GPU reads the same tables as the
CPU kernel and the reference, every coordinate mode, rounding rule, antialias filter and edge rule
is the reference's by construction; the kernels only gather and accumulate:

- ``kiln_resize_nearest``: one thread an output element, any rank, one table lookup per resized
  axis; elements are moved as raw 1/2/4/8-byte words, so every dtype runs.
- ``kiln_resize_2d``: linear/cubic (any taps, antialias included) over the last two axes in one
  pass, ``sum_a wh[a] * sum_b ww[b] * x[ih[a], iw[b]]`` (a bilinear/bicubic upsample: no
  intermediate), while the taps of both axes multiply to at most ``DIRECT_MAX_TAPS``.
- ``kiln_resize_axis``: anything else (trilinear, resized leading axes, wide antialias filters)
  one axis per launch over the tensor seen as [outer, axis, inner].

float32 and float16 accumulate in float32 (half is read and written through PTX conversions,
which needs no header under NVRTC), float64 in float64. tf_crop_and_resize writes the
extrapolation value wherever an axis is outside the roi (the separable path writes it per axis and
later axes carry it with weights summing to one, as the reference's separable form does).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.ir.ops.resize import DEFAULTS, resize_plan, saturate
from kiln.runtime.kernels.cuda import host, in_dtype, kernel

DIRECT_MAX_TAPS = 64
LAUNCHES = {"nearest": 0, "2d": 0, "axis": 0}

_HALF = r"""
__device__ __forceinline__ float kiln_h2f(unsigned short h) {
    float f; asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short kiln_f2h(float f) {
    unsigned short h; asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f)); return h;
}
"""
# dtype -> (storage type, accumulator type, load, store)
_TYPES = {
    np.dtype(np.float32): ("float", "float", "(v)", "(v)"),
    np.dtype(np.float64): ("double", "double", "(v)", "(v)"),
    np.dtype(np.float16): ("unsigned short", "float", "kiln_h2f(v)", "kiln_f2h(v)"),
}
_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_NEAREST = r"""
extern "C" __global__ void kiln_resize_nearest(const W* __restrict__ x, W* __restrict__ y, long long total,
        int rank, const long long* __restrict__ out_shape, const long long* __restrict__ in_strides,
        const int* __restrict__ table, const int* __restrict__ offsets, const unsigned char* __restrict__ outside,
        int extrapolate, W fill) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long rem = i, src = 0;
        bool out = false;
        for (int d = rank - 1; d >= 0; --d) {
            const long long c = rem % out_shape[d];
            rem /= out_shape[d];
            const int off = offsets[d];
            if (off < 0) {
                src += c * in_strides[d];
            } else {
                src += (long long)table[off + c] * in_strides[d];
                out = out || (extrapolate && outside[off + c]);
            }
        }
        y[i] = out ? fill : x[src];
    }
}
"""

_PASSES = r"""
#define LOAD(v) LOAD_EXPR
#define STORE(v) STORE_EXPR

extern "C" __global__ void kiln_resize_2d(const T* __restrict__ x, T* __restrict__ y, long long total,
        int H, int W, int OH, int OW, int TH, int TW,
        const int* __restrict__ ih, const ACC* __restrict__ wh, const int* __restrict__ iw,
        const ACC* __restrict__ ww, const unsigned char* __restrict__ out_h,
        const unsigned char* __restrict__ out_w, int extrapolate, ACC fill) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int ow = (int)(i % OW);
        const long long t = i / OW;
        const int oh = (int)(t % OH);
        const T* plane = x + (t / OH) * (long long)H * W;
        ACC acc = 0;
        for (int a = 0; a < TH; ++a) {
            const T* row = plane + (long long)ih[oh * TH + a] * W;
            ACC racc = 0;
            for (int b = 0; b < TW; ++b) {
                const T v = row[iw[ow * TW + b]];
                racc += ww[ow * TW + b] * LOAD(v);
            }
            acc += wh[oh * TH + a] * racc;
        }
        if (extrapolate && (out_h[oh] || out_w[ow])) acc = fill;
        const ACC v = acc;
        y[i] = STORE(v);
    }
}

extern "C" __global__ void kiln_resize_axis(const T* __restrict__ x, T* __restrict__ y, long long total,
        int in_k, int out_k, long long inner, int taps, const int* __restrict__ index,
        const ACC* __restrict__ weight, const unsigned char* __restrict__ outside, int extrapolate, ACC fill) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i % inner;
        const long long t = i / inner;
        const int o = (int)(t % out_k);
        const T* base = x + (t / out_k) * in_k * inner + r;
        ACC acc = 0;
        for (int k = 0; k < taps; ++k) {
            const T v = base[(long long)index[o * taps + k] * inner];
            acc += weight[o * taps + k] * LOAD(v);
        }
        if (extrapolate && outside[o]) acc = fill;
        const ACC v = acc;
        y[i] = STORE(v);
    }
}
"""


def _compile(source: str, name: str):
    from kiln.runtime.kernels.cuda.codegen import compile_kernel
    return compile_kernel(source, name)


def _nearest_kernel(itemsize: int):
    return _compile(f"#define W {_WORDS[itemsize]}\n" + _NEAREST, "kiln_resize_nearest")


def _pass_kernels(dt: np.dtype):
    storage, acc, load, store = _TYPES[dt]
    src = (_HALF if dt == np.float16 else "") + f"#define T {storage}\n#define ACC {acc}\n" + \
        _PASSES.replace("LOAD_EXPR", load).replace("STORE_EXPR", store)
    return _compile(src, "kiln_resize_2d"), _compile(src, "kiln_resize_axis")


_SMS: dict = {}


def _grid(total: int) -> tuple:
    """Grid-stride launches of 256 threads, at most 32 blocks per multiprocessor (as MaxPool's)."""
    sms = _SMS.get("n")
    if sms is None:
        sms = _SMS["n"] = cp.cuda.Device().attributes["MultiProcessorCount"]
    return (max(1, min(-(-total // 256), sms * 32)),), (256,)


def _words(a, itemsize: int):
    return a.view(np.dtype(f"u{itemsize}")) if itemsize in _WORDS else None


class _Tables:
    """The device copies of one plan's tables and how to launch them."""

    def __init__(self, plan, x_shape: tuple, acc: Optional[np.dtype], direct: bool):
        self.plan = plan
        self.out_shape = plan.out_shape
        self.axes = []
        if acc is None:  # nearest
            table, outside, offsets = [], [], [-1] * len(x_shape)
            for t in plan.axes:
                offsets[t.axis] = sum(len(a) for a in table)
                table.append(t.index[:, 0].astype(np.int32))
                outside.append(np.zeros(t.out_size, np.uint8) if t.outside is None else t.outside.astype(np.uint8))
            strides = np.cumprod((1,) + tuple(x_shape[::-1]))[:-1][::-1].astype(np.int64)
            self.table = cp.asarray(np.concatenate(table) if table else np.zeros(1, np.int32))
            self.outside = cp.asarray(np.concatenate(outside) if outside else np.zeros(1, np.uint8))
            self.offsets = cp.asarray(np.array(offsets, np.int32))
            self.shape = cp.asarray(np.array(self.out_shape, np.int64))
            self.strides = cp.asarray(strides)
            return
        self.direct = direct
        for t in plan.axes:
            outside = t.outside if t.outside is not None and t.outside.any() else None
            self.axes.append((t.axis, t.in_size, t.out_size, t.taps,
                              cp.asarray(t.index.astype(np.int32)), cp.asarray(t.weight.astype(acc)),
                              None if outside is None else cp.asarray(outside.astype(np.uint8))))
        self.none = cp.zeros(1, np.uint8)
        # The direct kernel reads both axes' masks whenever either axis extrapolates: an axis
        # without one gets zeros of its length (a 1-element stand-in was read out of bounds).
        self.masks = [cp.zeros(a[2], np.uint8) if a[6] is None else a[6] for a in self.axes] if direct else []


def _direct(plan, rank: int) -> bool:
    axes = [t.axis for t in plan.axes]
    return axes == [rank - 2, rank - 1] and plan.axes[0].taps * plan.axes[1].taps <= DIRECT_MAX_TAPS


def _resize_kernel(attrs: dict, dt: np.dtype, constant: bool):
    nearest = attrs["mode"] == "nearest"
    if nearest:
        word = _nearest_kernel(dt.itemsize)
        # tf_crop_and_resize's value, rounded to the dtype as the reference does, as a raw word.
        word_fill = saturate(np.array([attrs["extrapolation_value"]], np.float64), dt).view(f"u{dt.itemsize}")[0]
    else:
        k2d, kaxis = _pass_kernels(dt)
        acc = np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)
        fill = acc.type(attrs["extrapolation_value"])
    cache: dict = {}

    def tables(x, roi, scales, sizes) -> _Tables:
        params = () if constant else tuple(None if a is None else (a.dtype.str, a.tobytes())
                                           for a in (roi, scales, sizes))
        key = (x.shape, params)
        t = cache.get(key)
        if t is None:
            if len(cache) > 64:
                cache.clear()
            plan = resize_plan(x.shape, roi, scales, sizes, attrs)
            t = _Tables(plan, x.shape, None if nearest else acc, not nearest and _direct(plan, x.ndim))
            cache[key] = t
        return t

    def run(x, roi=None, scales=None, sizes=None):
        t = tables(x, host(roi), host(scales), host(sizes))
        x = cp.ascontiguousarray(x)
        if not t.plan.axes:
            return x.copy()
        y = cp.empty(t.out_shape, x.dtype)
        if y.size == 0:
            return y
        if nearest:
            LAUNCHES["nearest"] += 1
            word(*_grid(y.size), (_words(x, dt.itemsize), _words(y, dt.itemsize), np.int64(y.size),
                                  np.int32(x.ndim), t.shape, t.strides, t.table, t.offsets, t.outside,
                                  np.int32(t.plan.extrapolates), word_fill))
            return y
        if t.direct:
            (_, h, oh, th, ih, wh, outh), (_, w, ow, tw, iw, ww, outw) = t.axes
            extrapolate = outh is not None or outw is not None
            LAUNCHES["2d"] += 1
            k2d(*_grid(y.size), (x, y, np.int64(y.size), np.int32(h), np.int32(w), np.int32(oh), np.int32(ow),
                                 np.int32(th), np.int32(tw), ih, wh, iw, ww, t.masks[0], t.masks[1],
                                 np.int32(extrapolate), fill))
            return y
        cur = x
        for i, (axis, n_in, n_out, taps, index, weight, outside) in enumerate(t.axes):
            shape = list(cur.shape)
            shape[axis] = n_out
            nxt = y if i == len(t.axes) - 1 else cp.empty(shape, x.dtype)
            inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
            LAUNCHES["axis"] += 1
            kaxis(*_grid(nxt.size), (cur, nxt, np.int64(nxt.size), np.int32(n_in), np.int32(n_out),
                                     np.int64(inner), np.int32(taps), index, weight,
                                     t.none if outside is None else outside, np.int32(outside is not None), fill))
            cur = nxt
        return y
    return run


@kernel("Resize", host=(1, 2, 3))
def resize(node, attrs) -> Optional[Callable[..., Any]]:
    dt = in_dtype(node)
    attrs = {**DEFAULTS, **attrs}
    if dt is None:
        return None
    if attrs["mode"] == "nearest":
        if dt.itemsize not in _WORDS:
            return None
    elif dt not in _TYPES:
        return None  # integer linear/cubic (rounds half to even) and bfloat16 run on the host
    given = [i for i in (1, 2, 3) if i < len(node.inputs) and node.inputs[i] is not None]
    constant = all(node.inputs[i].const is not None for i in given)
    return _resize_kernel(attrs, dt, constant)
