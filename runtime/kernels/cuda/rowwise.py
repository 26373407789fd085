"""Fused row-wise reductions: Softmax, LogSoftmax and LayerNormalization in one kernel each.

Why: written as CuPy array expressions, a softmax is five passes over the tensor (max, subtract,
exp, sum, divide) and a LayerNorm about eight, each a kernel launch and a full read + write of
device memory. BERT-base at batch 32 runs 12 softmaxes over [32, 12, 128, 128] and 25 LayerNorms
over [4096, 768]; those passes made kiln slower than torch eager there. One kernel per op reads
the input once and writes the output once.

Layout: the input is viewed as ``rows x d`` (contiguous; ``d`` = the reduced extent: the last
axis for the softmaxes, ``prod(shape[axis:])`` for LayerNorm), and each row is reduced by

- **one warp** when ``d <= 1024``: each lane keeps its ``ceil(d / 32)`` elements in registers
  (the count is a compile-time bucket 1, 2, 4, ... 32, so the loops unroll), max and sum are
  warp shuffles; the row is read from memory once. Where the row length is a multiple of 16
  bytes' worth of elements and the rows and affine vectors are 16-byte aligned, each lane reads
  16-byte vectors (8 halves or 4 floats) instead of single elements (issue 18: LayerNorm was
  the third-largest kernel of GPT-2 in half precision). Blocks hold 4 warps (4 rows), or 1 when
  there are few rows, so that small problems still spread over the SMs.
- **one block** (256 to 1024 threads) otherwise: each pass strides over the row, partial
  results meet through warp shuffles and a 33-word shared array; the later passes re-read the
  row, which L1/L2 mostly serve (a 1024+-element row is at most a few KiB).

Numerics: math in the input dtype (float32 stays float32, as the CuPy path it replaces did; float16 is
computed in float32, its statistics too, and rounded once on the way out;
the references compute in float64 and round once, so results differ by a few ulps). Softmax
subtracts the row max before ``exp`` (no overflow); LayerNorm is two-pass (mean, then the mean
of squared deviations from it, from registers in the warp kernel), not E[x^2] - E[x]^2, so it
does not cancel on rows with a large mean. A NaN in a row makes the whole row NaN, as in the
reference.

Kernels are compiled on first use per (dtype, op, bucket, options) through
``codegen.compile_kernel`` (in-memory cache by source hash, CuPy's disk cache below it).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kiln.runtime.kernels.cuda.codegen import HALF_CONVERSIONS, compile_kernel

WARP_MAX_D = 1024          # rows up to this long: one warp per row, values in registers
SOFTMAX, LOG_SOFTMAX, LAYER_NORM = 0, 1, 2
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.float16): "float"}
# Storage type and its load/store: float16 (issue 18) is read into float, computed in float (the max, the
# sums, the statistics) and rounded once when written.
_STORAGE = {np.dtype(np.float16): ("unsigned short", "kiln_h2f(v)", "kiln_f2h(v)"),
            # bfloat16 lives on the device as uint16 words (cuda/__init__.py: device_array); these kernels
            # take only float types, so a uint16 array here is bfloat16.
            np.dtype(np.uint16): ("unsigned short", "kiln_bf2f(v)", "kiln_f2bf(v)")}
_CTYPE[np.dtype(np.uint16)] = "float"
LAUNCHES = {"warp": 0, "block": 0, "vector": 0}  # launches per variant (tests check which path ran)

_COMMON = r"""
#define NEG_INF ((T)__longlong_as_double(0xfff0000000000000LL))
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) { T u = __shfl_xor_sync(0xffffffffu, v, o); v = u > v ? u : v; }
    return v;
}
__device__ __forceinline__ float my_exp(float v) { return expf(v); }
__device__ __forceinline__ double my_exp(double v) { return exp(v); }
__device__ __forceinline__ float my_log(float v) { return logf(v); }
__device__ __forceinline__ double my_log(double v) { return log(v); }
__device__ __forceinline__ float my_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double my_sqrt(double v) { return sqrt(v); }
"""

# One warp per row; E = elements per lane (a power of two, 32 * E >= d).
_WARP = r"""
extern "C" __global__ void kiln_rows(const S* __restrict__ x, S* __restrict__ y,
                                     const S* __restrict__ scale, const S* __restrict__ bias,
                                     T* __restrict__ mean_out, T* __restrict__ rstd_out,
                                     long long rows, int d, T eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together: the shuffles below stay full
    const S* xr = x + row * (long long)d;
    S* yr = y + row * (long long)d;
    T v[E];
#if MODE == 2
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; v[i] = c < d ? LD(xr[c]) : (T)0; }
    T s = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) s += v[i];
    const T mean = warp_sum(s) / (T)d;
    T q = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; if (c < d) { T t = v[i] - mean; q += t * t; } }
    const T rstd = (T)1 / my_sqrt(warp_sum(q) / (T)d + eps);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        int c = lane + 32 * i;
        if (c < d) {
            T o = (v[i] - mean) * rstd * LD(scale[c]);
#if HAS_BIAS
            o += LD(bias[c]);
#endif
            yr[c] = ST(o);
        }
    }
#if STATS
    if (lane == 0) { mean_out[row] = mean; rstd_out[row] = rstd; }
#endif
#else
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; v[i] = c < d ? LD(xr[c]) : NEG_INF; }
    T m = v[0];
#pragma unroll
    for (int i = 1; i < E; ++i) m = v[i] > m ? v[i] : m;
    m = warp_max(m);
    T s = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; if (c < d) { v[i] -= m; s += my_exp(v[i]); } }
    s = warp_sum(s);
#if MODE == 1
    const T ls = my_log(s);
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; if (c < d) yr[c] = ST(v[i] - ls); }
#else
#pragma unroll
    for (int i = 0; i < E; ++i) { int c = lane + 32 * i; if (c < d) yr[c] = ST(my_exp(v[i]) / s); }
#endif
#endif
}
"""

# One block per row (blockDim a multiple of 32, at most 1024).
_BLOCK = r"""
__device__ __forceinline__ T block_sum(T v, T* sh) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sh[lane] : (T)0;
        v = warp_sum(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    v = sh[32];
    __syncthreads();  // sh is reused by the next reduction
    return v;
}
__device__ __forceinline__ T block_max(T v, T* sh) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sh[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    v = sh[32];
    __syncthreads();
    return v;
}
extern "C" __global__ void kiln_rows(const S* __restrict__ x, S* __restrict__ y,
                                     const S* __restrict__ scale, const S* __restrict__ bias,
                                     T* __restrict__ mean_out, T* __restrict__ rstd_out,
                                     long long rows, int d, T eps) {
    __shared__ T sh[33];
    const long long row = blockIdx.x;
    const S* xr = x + row * (long long)d;
    S* yr = y + row * (long long)d;
#if MODE == 2
    T s = 0;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s += LD(xr[c]);
    const T mean = block_sum(s, sh) / (T)d;
    T q = 0;
    for (int c = threadIdx.x; c < d; c += blockDim.x) { T t = LD(xr[c]) - mean; q += t * t; }
    const T rstd = (T)1 / my_sqrt(block_sum(q, sh) / (T)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        T o = (LD(xr[c]) - mean) * rstd * LD(scale[c]);
#if HAS_BIAS
        o += LD(bias[c]);
#endif
        yr[c] = ST(o);
    }
#if STATS
    if (threadIdx.x == 0) { mean_out[row] = mean; rstd_out[row] = rstd; }
#endif
#else
    T m = NEG_INF;
    for (int c = threadIdx.x; c < d; c += blockDim.x) { T t = LD(xr[c]); m = t > m ? t : m; }
    m = block_max(m, sh);
    T s = 0;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s += my_exp(LD(xr[c]) - m);
    s = block_sum(s, sh);
#if MODE == 1
    const T ls = my_log(s);
    for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = ST((LD(xr[c]) - m) - ls);
#else
    for (int c = threadIdx.x; c < d; c += blockDim.x) yr[c] = ST(my_exp(LD(xr[c]) - m) / s);
#endif
#endif
}
"""

# One warp per row, vector loads (issue 18): each lane reads VEC contiguous elements at a time (16 bytes:
# 8 halves or 4 floats) instead of one, E vectors a lane (a power of two, 32 * E * VEC >= d). For rows
# whose length is a multiple of VEC with aligned rows and affine vectors; the math is the warp kernel's.
_WARP_VEC = r"""
template <typename U, int W> struct alignas(sizeof(U) * W) VW { U v[W]; };
extern "C" __global__ void kiln_rows(const S* __restrict__ x, S* __restrict__ y,
                                     const S* __restrict__ scale, const S* __restrict__ bias,
                                     T* __restrict__ mean_out, T* __restrict__ rstd_out,
                                     long long rows, int d, T eps) {
    typedef VW<S, VEC> V;
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together: the shuffles below stay full
    const V* xr = reinterpret_cast<const V*>(x + row * (long long)d);
    V* yr = reinterpret_cast<V*>(y + row * (long long)d);
    const int nv = d / VEC;
    T v[E][VEC];
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int j = lane + 32 * i;
        if (j < nv) {
            const V t = xr[j];
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[i][k] = LD(t.v[k]);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[i][k] = MODE == 2 ? (T)0 : NEG_INF;
        }
    }
#if MODE == 2
    T s = 0;
#pragma unroll
    for (int i = 0; i < E; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += v[i][k];
    const T mean = warp_sum(s) / (T)d;
    T q = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        if (lane + 32 * i < nv) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) { T t = v[i][k] - mean; q += t * t; }
        }
    }
    const T rstd = (T)1 / my_sqrt(warp_sum(q) / (T)d + eps);
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int j = lane + 32 * i;
        if (j < nv) {
            const V sc = reinterpret_cast<const V*>(scale)[j];
#if HAS_BIAS
            const V bi = reinterpret_cast<const V*>(bias)[j];
#endif
            V o;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                T t = (v[i][k] - mean) * rstd * LD(sc.v[k]);
#if HAS_BIAS
                t += LD(bi.v[k]);
#endif
                o.v[k] = ST(t);
            }
            yr[j] = o;
        }
    }
#if STATS
    if (lane == 0) { mean_out[row] = mean; rstd_out[row] = rstd; }
#endif
#else
    T m = v[0][0];
#pragma unroll
    for (int i = 0; i < E; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) m = v[i][k] > m ? v[i][k] : m;
    m = warp_max(m);
    T s = 0;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        if (lane + 32 * i < nv) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) { v[i][k] -= m; s += my_exp(v[i][k]); }
        }
    }
    s = warp_sum(s);
#if MODE == 1
    const T ls = my_log(s);
#endif
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int j = lane + 32 * i;
        if (j < nv) {
            V o;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
#if MODE == 1
                o.v[k] = ST(v[i][k] - ls);
#else
                o.v[k] = ST(my_exp(v[i][k]) / s);
#endif
            }
            yr[j] = o;
        }
    }
#endif
}
"""
# Elements a vector load reads, per dtype (16 bytes); float64 keeps the element-wise warp kernel.
VEC = {np.dtype(np.float16): 8, np.dtype(np.uint16): 8, np.dtype(np.float32): 4}


def supported(dtype) -> bool:
    return np.dtype(dtype) in _CTYPE


def elements_per_lane(d: int) -> int:
    """The warp kernel's register bucket for rows of ``d`` elements: the least power of two
    ``e`` with ``32 * e >= d`` (``d <= WARP_MAX_D``)."""
    return 1 << max(0, math.ceil(math.log2(max(1, math.ceil(d / 32)))))


def source(dtype, mode: int, d: int, *, has_bias: bool = False, stats: bool = False, vec: int = 0) -> str:
    """CUDA source of the row kernel for this dtype/op/row length (warp or block variant; ``vec``: the
    warp variant with vector loads of that many elements)."""
    dt = np.dtype(dtype)
    storage, load, store = _STORAGE.get(dt, (_CTYPE[dt], "(v)", "(v)"))
    head = (f"#define T {_CTYPE[dt]}\n#define S {storage}\n#define MODE {mode}\n#define HAS_BIAS {int(has_bias)}\n"
            f"#define STATS {int(stats)}\n" + (HALF_CONVERSIONS if dt in _STORAGE else "")
            + f"#define LD(v) {load}\n#define ST(v) {store}\n")
    if d <= WARP_MAX_D and vec:
        return head + f"#define VEC {vec}\n#define E {elements_per_lane(-(-d // vec))}\n" + _COMMON + _WARP_VEC
    if d <= WARP_MAX_D:
        return head + f"#define E {elements_per_lane(d)}\n" + _COMMON + _WARP
    return head + _COMMON + _BLOCK


def _sm_count() -> int:
    import cupy as cp
    dev = cp.cuda.Device()
    key = dev.id
    n = _SMS.get(key)
    if n is None:
        n = _SMS[key] = dev.attributes["MultiProcessorCount"]
    return n


_SMS: dict = {}


def launch(mode: int, x, rows: int, d: int, *, scale=None, bias=None, eps: float = 0.0, stats: bool = False):
    """Run the row kernel over contiguous ``x`` viewed as ``rows x d``; returns ``y`` (x's
    shape and dtype), plus ``(mean, rstd)`` of shape ``[rows]`` with ``stats`` (LayerNorm)."""
    import cupy as cp
    y = cp.empty_like(x)
    mean = rstd = None
    if stats:
        # In the compute type (float32 for 16-bit x): LayerNormalization's stash_type is float32, and a mean
        # rounded to x's 16 bits first was 4e-4 off (the op suite on the GPU found it).
        stat_dtype = np.float32 if np.dtype(x.dtype) in _STORAGE else x.dtype
        mean, rstd = cp.empty(rows, stat_dtype), cp.empty(rows, stat_dtype)
    if rows == 0 or d == 0:
        if stats and rows:  # an empty normalized extent: mean 0/0, as numpy's mean gives
            mean.fill(np.nan)
            rstd.fill(np.nan)
        return (y, mean, rstd) if stats else y
    vec = VEC.get(np.dtype(x.dtype), 0)
    if vec and not (d % vec == 0 and d <= WARP_MAX_D and all(a is None or a.data.ptr % 16 == 0 for a in (x, y, scale, bias))):
        vec = 0
    kern = compile_kernel(source(x.dtype, mode, d, has_bias=bias is not None, stats=stats, vec=vec), name="kiln_rows")
    # Unused pointer parameters get x: the kernel never dereferences them (compile-time flags).
    args = (x, y, x if scale is None else scale, x if bias is None else bias,
            x if mean is None else mean, x if rstd is None else rstd,
            np.int64(rows), np.int32(d), (np.float32 if x.dtype in _STORAGE else x.dtype.type)(eps))
    if d <= WARP_MAX_D:
        warps = 4 if rows >= 4 * _sm_count() else 1
        kern(((rows + warps - 1) // warps,), (32 * warps,), args)
        LAUNCHES["warp"] += 1
        LAUNCHES["vector"] += bool(vec)
    else:
        threads = 1024 if d >= 8192 else 512 if d >= 2048 else 256
        kern((rows,), (threads,), args)
        LAUNCHES["block"] += 1
    return (y, mean, rstd) if stats else y


def softmax_last(x, log: bool = False):
    """Softmax (or LogSoftmax) of ``x`` over its last axis."""
    import cupy as cp
    x = cp.ascontiguousarray(x)
    d = x.shape[-1] if x.ndim else 1
    rows = x.size // d if d else 0
    return launch(LOG_SOFTMAX if log else SOFTMAX, x, rows, d)


def layer_norm(x, scale, bias, axis: int, eps: float, stats: bool = False):
    """LayerNormalization of ``x`` over dims ``axis..`` (``axis`` normalized, >= 0); with
    ``stats`` also the mean and inverse std (float32 for 16-bit x, else x's dtype) shaped
    ``x.shape[:axis] + (1,) * ...``."""
    import cupy as cp
    x = cp.ascontiguousarray(x)
    tail = x.shape[axis:]
    d = math.prod(tail)
    rows = math.prod(x.shape[:axis])
    scale = _affine(scale, tail, x.dtype)
    bias = None if bias is None else _affine(bias, tail, x.dtype)
    out = launch(LAYER_NORM, x, rows, d, scale=scale, bias=bias, eps=eps, stats=stats)
    if not stats:
        return out
    y, mean, rstd = out
    shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    return y, mean.reshape(shape), rstd.reshape(shape)


def _affine(a, tail: tuple, dtype) -> Optional[object]:
    """Scale/B as a contiguous vector over the normalized dims (a no-op for the usual exact shape)."""
    import cupy as cp

    from kiln.runtime.kernels.cuda import device_array
    a = device_array(a) if isinstance(a, np.ndarray) else cp.asarray(a)
    if a.dtype != dtype:
        a = a.astype(dtype)
    if a.shape != tail:
        a = cp.broadcast_to(a, tail)
    return cp.ascontiguousarray(a).reshape(-1)
