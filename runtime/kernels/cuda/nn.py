"""Convolution, pooling, normalizations and softmax on the GPU with CuPy.

Conv (1-D, 2-D and 3-D) has two paths. The CuPy-only one is im2col + cuBLAS: the padded input
is viewed as [N, C, *k, *out] windows through strides (no per-tap loop), copied once into the
column buffer, and multiplied by the weights ([group, M/group, C/group*prod(k)], a view of the
one device copy of the weights) in one batched GEMM; a 1x1 conv with no padding is one GEMM on a
view. The other is cuDNN through nvidia-cudnn-frontend (cudnn.py: float32, bias fused, TF32
engines deselected unless allowed; 1-D as 2-D with a unit height), used where that library
imports and passes its self-test. Which one runs is decided per convolution shape (input shape,
weight shape, pads, strides, dilations, group, epilogue) the first time it is seen outside a
stream capture. In the default "auto" mode the rule is by batch: cuDNN from ``CUDNN_MIN_BATCH``
samples up (on an H200 it ran ResNet-50's convolution classes 1.3-2.4x faster than im2col at
batch 32), im2col below it. Timing both paths per shape on first use was tried and dropped: at
batch 1 both times are host and launch overhead, which picked cuDNN everywhere and made
ResNet-50 at batch 1 under CUDA graphs 1.1 -> 2.1 ms. ``CONV_CHOICES`` records each shape's
decision; a shape cuDNN refuses stays on im2col. The program's ``CudaOptions.conv`` (default
KILN_CUDA_CONV=cudnn|im2col, or the deprecated ``cudnn.set_mode``) forces one path; it is bound
into each Conv kernel at load, with the program's TF32 switch, cuDNN workspace cap and epilogue
fusion, and is part of the ``CONV_CHOICES`` key (so are those three), so programs with different
settings never reuse each other's decisions. Each Conv kernel also records the paths it took
(``run.conv_paths``: {(input shape, residual?, relu?): path}; ``CudaProgram.conv_paths`` sums them per
program). While a stream is capturing, an undecided shape
runs im2col (nothing is built or timed inside a capture), and so does every shape if cuDNN's
execute failed the capture probe. The Conv kernel also takes an epilogue (a residual add, a
ReLU: ``run.with_epilogue``, used by ``kiln.FusedEpilogue``): inside the cuDNN graph where an
engine fuses it, else in one pass after the product (with the bias, on the im2col path).
Pools (1-D to 3-D) reduce the same window view, except float MaxPool over 1 or 2 dims: one
direct kernel (``_maxpool_direct``).
Softmax, LogSoftmax (last axis) and LayerNormalization (float32/float64) are one fused kernel
each (rowwise.py); other axes, InstanceNormalization and other dtypes are a few CuPy passes.

Kernels that keep their own device copy of a constant input (Conv's reshaped weights, the
folded BatchNorm) say which input positions they never read in ``run.ignores``: CudaProgram
then skips uploading that constant unless another node reads it, so weights are held once.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import cupy as cp
import numpy as np
from cupy.lib.stride_tricks import as_strided

from kiln.errors import KilnError
from kiln.ir.dtypes import DType
from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.ir.types import normalize_axis
from kiln.runtime.kernels.cuda import FLOATS, U16, codegen, const_input, device_array, in_dtype, kernel, options

HALF = np.dtype(np.float16)
FLOATS16 = FLOATS + (HALF,)  # what the kernels below also take in float16 (issue 18)
CUDNN_FLOATS = (np.dtype(np.float32), HALF)  # what goes to cuDNN (float64 stays on im2col)
# What the row kernels (LayerNorm, Softmax, LogSoftmax) and Conv also take: bfloat16 (uint16 words on the
# device), only through rowwise.py / cuDNN; their CuPy fallbacks would compute on the words, so a bfloat16
# input that those do not take raises instead.
FLOATS16_BF16 = FLOATS16 + ((codegen.BF16,) if codegen.BF16 is not None else ())


def _bf16_words(x) -> None:
    if x.dtype == np.uint16:
        raise KilnError("this bfloat16 row reduction (not over the last axis, or mixed dtypes) has no GPU path "
                        "yet: convert the model with precision='fp16', or run it on the CPU")
from kiln.runtime.kernels.cuda import cudnn, rowwise
from kiln.runtime.kernels.cuda.linalg import cublas_matmul


def _windows(x, window, fill) -> tuple:
    """([N, C, *k, *out] strided window view of the padded ``x``, out): any number of spatial dims."""
    sizes = x.shape[2:]
    nsp = len(sizes)
    begin, _, reach = static_pads(window, sizes)
    out = window_out_shape(window, sizes)
    if any(begin) or any(reach):
        x = cp.pad(x, ((0, 0), (0, 0)) + tuple((b, max(r, 0)) for b, r in zip(begin, reach)), constant_values=fill)
    x = cp.ascontiguousarray(x)
    st = x.strides
    taps = tuple(window.dilations[i] * st[2 + i] for i in range(nsp))
    steps = tuple(window.strides[i] * st[2 + i] for i in range(nsp))
    view = as_strided(x, x.shape[:2] + tuple(window.kernel) + tuple(out), st[:2] + taps + steps)
    return view, out


# (x shape, w shape, pads, strides, dilations, group, epilogue, (conv mode, tf32, workspace cap,
# cudnn epilogue)) -> {"path": "cudnn"|"im2col", "why", "fused": the epilogue steps cuDNN took}:
# the decisions, shared by every Conv of that shape and those settings.
CONV_CHOICES: dict = {}
# The auto mode's rule: cuDNN for convolutions of at least this many samples (module docstring).
CUDNN_MIN_BATCH = 8

# The epilogue after an im2col GEMM, or what cuDNN did not fuse: y <- relu?(y + b + r) in place,
# one generated kernel (codegen.py: the 4-wide path when b is absent, as after cuDNN's fused bias).
_EPILOGUE_KERNELS: dict = {}


def _epilogue_kernel(dtype, bias: bool, residual: bool, relu: bool):
    key = (np.dtype(dtype), bias, residual, relu)
    k = _EPILOGUE_KERNELS.get(key)
    if k is None:
        from kiln.ir import Graph
        from kiln.ir.passes.shape_inference import infer_shapes
        from kiln.runtime.kernels.cuda import codegen
        g = Graph("conv_epilogue")
        dims = ["n", "c", "h", "w"]
        t = g.add_input("y", key[0].name, dims)
        for name, on in (("b", bias), ("r", residual)):
            if on:
                t = g.op("Add", t, g.add_input(name, key[0].name, dims))
        if relu:
            t = g.op("Relu", t)
        g.outputs = [t]
        infer_shapes(g)
        k = _EPILOGUE_KERNELS[key] = codegen.ElementwiseKernel(codegen.body_from_graph(g))
    return k


def _im2col_epilogue(y, b, r, relu: bool) -> None:
    """y <- relu?(y + b + r) in place (b, r optional): the epilogue after an im2col GEMM, or what
    cuDNN did not fuse."""
    if b is None and r is None and not relu:
        return
    # bfloat16 words (uint16: a convolution's output is a float) get the bfloat16 kernel
    k = _epilogue_kernel(codegen.BF16 if y.dtype == U16 else y.dtype, b is not None, r is not None, relu)
    k(y, *[a for a in (b, r) if a is not None], out=y)


@kernel("Conv")
def conv(node, attrs) -> Optional[Callable[..., Any]]:
    """Conv with 1, 2 or 3 spatial dims (module docstring). Besides ``run(x, w, b)``, the kernel
    offers ``run.with_epilogue(x, residual, relu)``: the convolution with the residual added and
    ReLU applied, fused into the cuDNN graph where an engine takes it, else one extra pass
    (the ``kiln.FusedEpilogue`` kernel calls it)."""
    w = const_input(node, 1)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = const_input(node, 2)
    if in_dtype(node) not in FLOATS16_BF16:
        return None
    bf16 = codegen.BF16 is not None and in_dtype(node) == codegen.BF16
    if w is None or (has_bias and bias is None):
        return None if bf16 else _conv_dynamic(attrs)  # bfloat16: through float32 (cuda_program._via_float32)
    if w.ndim not in (3, 4, 5):
        return None
    nsp = w.ndim - 2
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    group = attrs["group"]
    m, cg = w.shape[:2]
    ks = tuple(w.shape[2:])
    # One device copy of the weights; every path reads a view of it.
    wd = device_array(np.ascontiguousarray(w))
    bias_d = None if bias is None else device_array(np.ascontiguousarray(bias).reshape((1, m) + (1,) * nsp))
    pointwise = all(k == 1 for k in ks) and group == 1 and not any(window.pads) and window.auto_pad == "NOTSET" \
        and all(s == 1 for s in window.strides)
    depthwise = group == m and cg == 1 and group > 1
    if pointwise:
        w2 = wd.reshape(m, cg)
    elif depthwise:
        wdw = wd.reshape((1, m) + ks + (1,) * nsp)
    else:
        wg = wd.reshape(group, m // group, cg * math.prod(ks))
    opts = options()  # the program's, bound at load
    conv_mode, tf32 = opts.conv, opts.tf32
    settings = (conv_mode, tf32, opts.workspace_cap_bytes, opts.cudnn_epilogue)
    taken: dict = {}  # (input shape, epilogue) -> the path this kernel took
    exe = None
    if (in_dtype(node) in CUDNN_FLOATS or bf16) and conv_mode != "im2col" and cudnn.available():
        # 1-D runs as 2-D with a unit height (cuDNN's own convolutions are 2-D and 3-D).
        w_dnn = wd.reshape((m, cg, 1) + ks) if nsp == 1 else wd
        b_dnn = None if bias_d is None else (bias_d.reshape(1, m, 1, 1) if nsp == 1 else bias_d)
        exe = cudnn.Executor(w_dnn, b_dnn, ((1,) if nsp == 1 else ()) + tuple(window.strides),
                             ((1,) if nsp == 1 else ()) + tuple(window.dilations), tf32=tf32,
                             workspace_cap=opts.workspace_cap_bytes, fuse_epilogue=opts.cudnn_epilogue)

    def im2col(x, residual=None, relu=False):
        n, c = x.shape[:2]
        if pointwise:
            hw = x.shape[2:]
            y = cublas_matmul(w2, x.reshape(n, c, math.prod(hw)), tf32=tf32).reshape((n, m) + hw)
        else:
            view, out = _windows(x, window, 0)
            if depthwise:
                if x.dtype == U16:  # CuPy's product would multiply bfloat16 words as integers
                    raise KilnError("a bfloat16 depthwise convolution that cuDNN did not take has no GPU path yet: "
                                    "convert the model with precision='fp16'")
                y = (view * wdw).sum(axis=tuple(range(2, 2 + nsp)), dtype=np.float32 if x.dtype == HALF else None)
                y = y.astype(x.dtype, copy=False)
            else:
                cols = cp.ascontiguousarray(view).reshape(n, group, cg * math.prod(ks), math.prod(out))
                y = cublas_matmul(wg, cols, tf32=tf32).reshape((n, m) + tuple(out))
        _im2col_epilogue(y, bias_d, residual, relu)
        return y

    def decide(key, x, pre, post, ep) -> str:
        """The path for this shape: cuDNN where it builds and (in auto mode) the batch is large."""
        entry = {"path": "im2col"}
        try:
            entry["fused"] = exe.plan_for(x.shape, pre, post, ep).fused
            if conv_mode == "cudnn" or x.shape[0] >= CUDNN_MIN_BATCH or x.dtype in (HALF, U16):
                # (float16: cuDNN channels-last beats the half im2col at every batch, issue 18)
                entry["path"] = "cudnn"
            else:
                entry["why"] = f"batch {x.shape[0]} < {CUDNN_MIN_BATCH}: im2col (see the module docstring)"
        except cudnn.Unsupported as e:
            entry["why"] = str(e)
        CONV_CHOICES[key] = entry
        return entry["path"]

    def with_epilogue(x, residual=None, relu=False):
        if exe is not None and (x.dtype in CUDNN_FLOATS or x.dtype == U16) and x.ndim == nsp + 2:
            begin, end, _ = static_pads(window, x.shape[2:])
            out = window_out_shape(window, x.shape[2:])
            x4 = x
            if nsp == 1:
                x4, begin, end, out = x.reshape(x.shape[:2] + (1, x.shape[2])), [0] + begin, [0] + end, [1] + out
            r4 = residual
            if nsp == 1 and residual is not None:
                r4 = residual.reshape(residual.shape[:2] + (1, residual.shape[2]))
            ep = exe.epilogue(residual is not None, relu)
            # The dtype is part of the key: float32 and float16 programs of one model decide apart (a shared
            # decision once ran float32 at batch 1 on cuDNN, 2x slower, after a float16 program decided first).
            key = (x4.shape, x.dtype.str, w.shape, tuple(begin), tuple(end), window.strides, window.dilations, group,
                   ep, settings)
            entry = CONV_CHOICES.get(key)
            if cudnn.capturing():
                path = entry["path"] if entry is not None and cudnn.capture_ok() else "im2col"
            else:
                path = entry["path"] if entry is not None else decide(key, x4, begin, end, ep)
            if path == "cudnn":
                try:
                    y = exe(x4, begin, end, out, residual=r4, relu=relu, finish=_im2col_epilogue)
                    taken[(x.shape, residual is not None, relu)] = "cudnn"
                    return y.reshape((x.shape[0], m) + tuple(out[1:])) if nsp == 1 else y
                except cudnn.Unsupported:  # e.g. a plan first needed inside a capture
                    pass
        taken[(x.shape, residual is not None, relu)] = "im2col"
        return im2col(x, residual, relu)

    def run(x, w_unused, b_unused=None):
        return with_epilogue(x)
    run.with_epilogue = with_epilogue
    run.conv_paths = taken
    run.ignores = (1, 2)  # the weights and bias are read from the copies prepared above
    return run


def _conv_dynamic(attrs):
    """Conv whose weights (or bias) are computed in the graph, not constants: im2col + cuBLAS on
    the arrays as they come (their layouts prepared per call; no cuDNN plan per weight)."""
    tf32 = options().tf32

    def run(x, w, b=None):
        if w.ndim not in (3, 4, 5) or x.ndim != w.ndim:
            raise ValueError(f"Conv: X of rank {x.ndim} and W of rank {w.ndim}")
        nsp = w.ndim - 2
        window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                             dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
        group = attrs["group"]
        m, cg = w.shape[:2]
        n = x.shape[0]
        view, out = _windows(x, window, 0)
        k = cg * math.prod(w.shape[2:])
        cols = cp.ascontiguousarray(view).reshape(n, group, k, math.prod(out))
        y = cublas_matmul(cp.ascontiguousarray(w).reshape(group, m // group, k), cols, tf32=tf32).reshape(
            (n, m) + tuple(out))
        if b is not None:
            y += b.reshape((1, m) + (1,) * nsp)
        return y
    return run


@kernel("ConvTranspose")
def conv_transpose(node, attrs) -> Optional[Callable[..., Any]]:
    """ConvTranspose (1-D to 3-D, grouped, output_padding / output_shape / auto_pad as ONNX says):
    one batched GEMM gives every input position's contribution to every kernel tap
    ([N, group, M/g * prod(k), L] = W_g^T @ x_g, the weights transposed once at load), then each
    tap is added into a zeroed buffer at stride * i + dilation * tap (the reference's scatter,
    ir/ops/nn.py, one strided add per tap) and the result is cropped. All kernels are cuBLAS and
    CuPy elementwise launches, so it runs inside a CUDA graph too."""
    w = const_input(node, 1)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    bias = const_input(node, 2)
    if in_dtype(node) not in FLOATS16:
        return None
    if w is None or (has_bias and bias is None):  # weights computed in the graph: laid out per call
        def dynamic(x, w_arg, b_arg=None):
            if w_arg.ndim not in (3, 4, 5):
                raise ValueError(f"ConvTranspose: W of rank {w_arg.ndim}")
            return _conv_transpose(x, w_arg, b_arg, attrs)
        return dynamic
    if w.ndim not in (3, 4, 5):
        return None
    bias_d = None if bias is None else cp.asarray(bias)
    layout = _conv_transpose_layout(cp.asarray(w), attrs)  # only this layout stays on the device

    def run(x, w_unused, b_unused=None):
        return _conv_transpose(x, None, bias_d, attrs, layout)
    run.ignores = (1, 2)
    return run


def _conv_transpose_layout(w, attrs) -> tuple:
    """(window, group, C/g, M/g, kernel, [group, M/g * prod(k), C/g] weights for the GEMM)."""
    window = make_window(attrs["kernel_shape"] or w.shape[2:], strides=attrs["strides"],
                         dilations=attrs["dilations"], pads=attrs["pads"], auto_pad=attrs["auto_pad"])
    group = attrs["group"]
    c_in, m_g = w.shape[:2]
    ks = tuple(w.shape[2:])
    c_g = c_in // group
    wt = cp.ascontiguousarray(cp.ascontiguousarray(w).reshape(group, c_g, m_g * math.prod(ks)).transpose(0, 2, 1))
    return window, group, c_g, m_g, ks, wt


def _conv_transpose(x, w, bias, attrs, layout=None):
    from kiln.ir.ops.nn import _transpose_geometry
    window, group, c_g, m_g, ks, wt = layout if layout is not None else _conv_transpose_layout(w, attrs)
    nsp = len(ks)
    geo_attrs = {"output_padding": attrs["output_padding"], "output_shape": attrs["output_shape"]}
    bias_d = None if bias is None else bias.reshape((1, -1) + (1,) * nsp)
    n, ins = x.shape[0], x.shape[2:]
    geo = _transpose_geometry(geo_attrs, window, ins)
    lo = [min(0, b) for b in geo.begin]
    size = [max(f, b + o) - lo_i for f, b, o, lo_i in zip(geo.full, geo.begin, geo.out, lo)]
    xg = cp.ascontiguousarray(x).reshape(n, group, c_g, math.prod(ins))
    # Per group, [M/g*K, C/g] @ [N, C/g, L] (the weight's batch stride 0: nothing copied).
    parts = [cublas_matmul(wt[g], xg[:, g]) for g in range(group)]
    cols = parts[0] if group == 1 else cp.stack(parts, axis=1)
    cols = cols.reshape((n, group * m_g) + ks + tuple(ins))
    buf = cp.zeros((n, group * m_g) + tuple(size), x.dtype)
    for tap in np.ndindex(*ks):
        target = tuple(slice(t * d - lo_i, t * d - lo_i + s * (sz - 1) + 1, s)
                       for t, d, lo_i, s, sz in zip(tap, window.dilations, lo, window.strides, ins))
        buf[(slice(None), slice(None)) + target] += cols[(slice(None), slice(None)) + tap]
    crop = tuple(slice(b - lo_i, b - lo_i + o) for b, lo_i, o in zip(geo.begin, lo, geo.out))
    y = buf[(slice(None), slice(None)) + crop]
    if bias_d is not None:
        y = y + bias_d
    return cp.ascontiguousarray(y)


def _pool_window(attrs: dict, dilations=True):
    return make_window(attrs["kernel_shape"], strides=attrs["strides"],
                       dilations=attrs.get("dilations") if dilations else None,
                       pads=attrs["pads"], auto_pad=attrs["auto_pad"], ceil_mode=attrs["ceil_mode"])


_MAXPOOL_SOURCE = r"""
extern "C" __global__ void kiln_maxpool2d(const S* __restrict__ x, S* __restrict__ y, long long total,
        int H, int W, int OH, int OW, int KH, int KW, int SH, int SW, int PH, int PW, int DH, int DW) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int ow = (int)(i % OW);
        const long long t = i / OW;
        const int oh = (int)(t % OH);
        const S* p = x + (t / OH) * H * W;
        T m = LOWEST;
        const int h0 = oh * SH - PH, w0 = ow * SW - PW;
        for (int a = 0; a < KH; ++a) {
            const int h = h0 + a * DH;
            if (h < 0 || h >= H) continue;
            for (int b = 0; b < KW; ++b) {
                const int w = w0 + b * DW;
                if (w < 0 || w >= W) continue;
                const T v = LD(p[h * W + w]);
                m = (v > m || v != v) ? v : m;  // NaN wins, as in the reference's max
            }
        }
        y[i] = ST(m);
    }
}
"""
_MAXPOOL_TYPES = {np.dtype(np.float32): ("float", "__int_as_float(0xff800000)"),  # -inf (NVRTC has no INFINITY)
                  np.dtype(np.float64): ("double", "__longlong_as_double(0xfff0000000000000LL)"),
                  HALF: ("float", "__int_as_float(0xff800000)")}  # compared in float, stored as half
_HALF_IO = r"""
#define S unsigned short
__device__ __forceinline__ float LD(unsigned short h) { float f; asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short ST(float f) { unsigned short h; asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f)); return h; }
"""


def _maxpool_direct(dt: np.dtype, window):
    """MaxPool over 1 or 2 spatial dims as one kernel (one thread an output, the window read in
    place, padding and ceil_mode overhang skipped): no padded copy of the input, no strided
    reduction. On an H200 the strided-view reduction took 0.95 ms for ResNet-50's stem pool at
    batch 32, 8% of the model."""
    from kiln.runtime.kernels.cuda.codegen import compile_kernel
    ctype, lowest = _MAXPOOL_TYPES[dt]
    io = _HALF_IO if dt == HALF else f"#define S {ctype}\n#define LD(v) (v)\n#define ST(v) (v)\n"
    kern = compile_kernel(f"#define T {ctype}\n#define LOWEST {lowest}\n" + io + _MAXPOOL_SOURCE, "kiln_maxpool2d")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    one_d = window.rank == 1

    def run(x):
        sizes = x.shape[2:]
        begin, _, _ = static_pads(window, sizes)
        out = window_out_shape(window, sizes)
        if one_d:
            h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw = (1, sizes[0], 1, out[0], 1, window.kernel[0], 1,
                                                            window.strides[0], 0, begin[0], 1, window.dilations[0])
        else:
            (h, w), (oh, ow), (kh, kw) = sizes, out, window.kernel
            (sh, sw), (ph, pw), (dh, dw) = window.strides, begin, window.dilations
        x = cp.ascontiguousarray(x)
        y = cp.empty(x.shape[:2] + tuple(out), x.dtype)
        total = y.size
        if total:
            blocks = max(1, min(-(-total // 256), sms * 32))
            kern((blocks,), (256,), (x, y, np.int64(total), *(np.int32(v) for v in
                                                               (h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw))))
        return y
    return run


@kernel("MaxPool")
def max_pool(node, attrs) -> Optional[Callable[..., Any]]:
    dt = in_dtype(node)
    if dt is None or dt.kind not in "fiu" or dt.itemsize < 4 and dt.kind == "f" and dt != HALF or \
            len(attrs["kernel_shape"]) not in (1, 2, 3) or len(node.outputs) > 1:
        return None
    window = _pool_window(attrs)
    if dt in _MAXPOOL_TYPES and window.rank in (1, 2):
        return _maxpool_direct(dt, window)
    lowest = -np.inf if dt.kind == "f" else np.iinfo(dt).min
    axes = tuple(range(2, 2 + len(attrs["kernel_shape"])))

    def run(x):
        view, out = _windows(x, window, lowest)
        return view.max(axis=axes)
    return run


def _average_counts(sizes: tuple, window, include_pad: int) -> np.ndarray:
    """[1, 1, *out] how many positions each window averages (the reference's rule: padding
    counts with ``count_include_pad``, a ceil_mode overhang past the padding never does)."""
    begin, end, reach = static_pads(window, sizes)
    ones = np.ones(sizes)
    if include_pad:
        mask = np.pad(ones, [(b, e) for b, e in zip(begin, end)], constant_values=1)
        mask = np.pad(mask, [(0, max(r - e, 0)) for r, e in zip(reach, end)], constant_values=0)
    else:
        mask = np.pad(ones, [(b, max(r, 0)) for b, r in zip(begin, reach)], constant_values=0)
    out = window_out_shape(window, sizes)
    st = mask.strides
    view = np.lib.stride_tricks.as_strided(mask, tuple(window.kernel) + tuple(out),
                                           st + tuple(s * st[i] for i, s in enumerate(window.strides)))
    return view.sum(axis=tuple(range(len(sizes))))[None, None]


@kernel("AveragePool")
def average_pool(node, attrs) -> Optional[Callable[..., Any]]:
    if in_dtype(node) not in FLOATS16 or len(attrs["kernel_shape"]) not in (1, 2, 3) or any(
            d != 1 for d in attrs.get("dilations") or ()):
        return None  # dilated averages run on the host
    window = _pool_window(attrs, dilations=False)
    include_pad = attrs["count_include_pad"]
    axes = tuple(range(2, 2 + len(attrs["kernel_shape"])))
    counts: dict = {}

    def run(x):
        view, out = _windows(x, window, 0)
        key = (x.shape[2:], x.dtype)
        if key not in counts:
            counts[key] = cp.asarray(_average_counts(x.shape[2:], window, include_pad).astype(x.dtype))
        if x.dtype == HALF:  # summed in float32
            return (view.sum(axis=axes, dtype=np.float32) / counts[key]).astype(HALF)
        return view.sum(axis=axes) / counts[key]
    return run


@kernel("GlobalAveragePool")
def global_average_pool(node, attrs):
    if in_dtype(node) == HALF:  # averaged in float32
        return lambda x: x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=np.float32).astype(HALF)
    if in_dtype(node) not in FLOATS:
        return None
    return lambda x: x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)


@kernel("GlobalMaxPool")
def global_max_pool(node, attrs):
    if in_dtype(node) not in FLOATS16:
        return None
    return lambda x: x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


@kernel("BatchNormalization")
def batch_norm(node, attrs):
    stats = [const_input(node, i) for i in range(1, 5)]
    dt = in_dtype(node)
    if dt not in FLOATS or any(s is None for s in stats) or len(node.outputs) > 1 or attrs["training_mode"]:
        return None
    scale, b, mean, var = (s.astype(dt) for s in stats)
    k = scale / np.sqrt(var + dt.type(attrs["epsilon"]))
    t = b - mean * k
    kd, td = cp.asarray(k), cp.asarray(t)

    def run(x, *unused):
        shape = (-1,) + (1,) * (x.ndim - 2)
        y = x * kd.reshape(shape)
        y += td.reshape(shape)
        return y
    run.ignores = (1, 2, 3, 4)
    return run


@kernel("LayerNormalization")
def layer_norm(node, attrs):
    if in_dtype(node) not in FLOATS16_BF16:
        return None
    eps = attrs["epsilon"]
    stash = DType(attrs["stash_type"]).numpy
    n_out = len(node.outputs)

    def run(x, scale, b=None):
        if rowwise.supported(x.dtype) and scale.dtype == x.dtype and (b is None or b.dtype == x.dtype):
            axis = normalize_axis(attrs["axis"], x.ndim)
            if n_out > 1:
                _bf16_words(x)  # the statistics' cast to the stash type would read words as integers
            out = rowwise.layer_norm(x, scale, b, axis, eps, stats=n_out > 1)
            if n_out > 1:
                y, mean, inv_std = out
                return (y, mean.astype(stash, copy=False), inv_std.astype(stash, copy=False))[:n_out]
            return out
        _bf16_words(x)
        axes = tuple(range(normalize_axis(attrs["axis"], x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        inv_std = 1.0 / cp.sqrt(cp.square(d).mean(axis=axes, keepdims=True) + x.dtype.type(eps))
        d *= inv_std
        d *= scale
        if b is not None:
            d += b
        if n_out > 1:
            return (d, mean.astype(stash), inv_std.astype(stash))[:n_out]
        return d
    return run


@kernel("InstanceNormalization")
def instance_norm(node, attrs):
    if in_dtype(node) not in FLOATS:
        return None
    eps = attrs["epsilon"]

    def run(x, scale, b):
        axes = tuple(range(2, x.ndim))
        shape = (1, -1) + (1,) * (x.ndim - 2)
        mean = x.mean(axis=axes, keepdims=True)
        d = x - mean
        var = cp.square(d).mean(axis=axes, keepdims=True)
        d /= cp.sqrt(var + x.dtype.type(eps))
        d *= scale.reshape(shape)
        d += b.reshape(shape)
        return d
    return run


@kernel("Softmax")
def softmax(node, attrs):
    if in_dtype(node) not in FLOATS16_BF16:
        return None
    axis = attrs["axis"]

    def run(x):
        if x.ndim and normalize_axis(axis, x.ndim) == x.ndim - 1 and rowwise.supported(x.dtype):
            return rowwise.softmax_last(x)
        _bf16_words(x)
        y = x - x.max(axis=axis, keepdims=True)
        cp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        return y
    return run


@kernel("LogSoftmax")
def log_softmax(node, attrs):
    if in_dtype(node) not in FLOATS16_BF16:
        return None
    axis = attrs["axis"]

    def run(x):
        if x.ndim and normalize_axis(axis, x.ndim) == x.ndim - 1 and rowwise.supported(x.dtype):
            return rowwise.softmax_last(x, log=True)
        _bf16_words(x)
        s = x - x.max(axis=axis, keepdims=True)
        s -= cp.log(cp.exp(s).sum(axis=axis, keepdims=True))
        return s
    return run
