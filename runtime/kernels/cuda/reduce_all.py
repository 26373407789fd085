"""Reductions over every element (``x.max()``, ``mask.all()``, ``x.sum()``) in two small kernels.

A model's checks reduce a whole tensor to one value (``if mask.all():``, ``if x.abs().amax() >
1e4:``), and so do the guards a trace leaves on them. CuPy's reduction machinery serves such a
call with one block per output: ResNet-50's input check (4.8 M floats at batch 32) took 40 us,
a fifth of the H100's bandwidth. Here stage 1 gives every SM a few blocks, each reading 16-byte
vectors in a grid-stride loop and leaving one partial; stage 2 (one block) reduces the partials.
Both are plain launches, so CUDA graphs capture them.

Semantics are the references': max/min propagate NaN (numpy's ``max``), and a float32 sum is
accumulated in float64 and rounded once (closer to the exact sum than numpy's pairwise float32
sum, which the reference uses; both are well inside the op tests' tolerance). Integer sums
accumulate in 64 bits. Other reductions, and reductions over some axes only, take the caller's
path.
"""
from __future__ import annotations

from typing import Optional

import cupy as cp
import numpy as np

from kiln.runtime.kernels.cuda.codegen import compile_kernel

OPS = ("max", "min", "sum")
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.int32): "int",
          np.dtype(np.int64): "long long", np.dtype(np.uint8): "unsigned char", np.dtype(np.int8): "signed char"}
BLOCK = 256

_SOURCE = r"""
#include <cuda/std/limits>
template <typename A> __device__ __forceinline__ A combine(A a, A b) {
#if OP == 0
    if (IS_FLOAT && (a != a || b != b)) return a != a ? a : b;
    return a > b ? a : b;
#elif OP == 1
    if (IS_FLOAT && (a != a || b != b)) return a != a ? a : b;
    return a < b ? a : b;
#else
    return a + b;
#endif
}

__device__ __forceinline__ ACC block_reduce(ACC v) {
    __shared__ ACC part[32];
    for (int o = 16; o > 0; o >>= 1) v = combine<ACC>(v, __shfl_down_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x >> 5) ? part[lane] : IDENTITY;
        for (int o = 16; o > 0; o >>= 1) v = combine<ACC>(v, __shfl_down_sync(0xffffffffu, v, o));
    }
    return v;
}

extern "C" __global__ void kiln_reduce_all_1(const T* __restrict__ x, long long n, ACC* __restrict__ partial) {
    ACC v = IDENTITY;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nvec = VEC > 1 && ((unsigned long long)x % 16 == 0) ? n / VEC : 0;
    for (long long i = first; i < nvec; i += stride) {
        const VTYPE w = reinterpret_cast<const VTYPE*>(x)[i];
        const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v = combine<ACC>(v, (ACC)e[k]);
    }
    for (long long i = nvec * VEC + first; i < n; i += stride) v = combine<ACC>(v, (ACC)x[i]);
    v = block_reduce(v);
    if (threadIdx.x == 0) partial[blockIdx.x] = v;
}

extern "C" __global__ void kiln_reduce_all_2(const ACC* __restrict__ partial, int n, T* __restrict__ y) {
    ACC v = IDENTITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v = combine<ACC>(v, partial[i]);
    v = block_reduce(v);
    if (threadIdx.x == 0) y[0] = (T)v;
}
"""


def _identity(op: str, acc: str) -> str:
    if op == "sum":
        return "(ACC)0"
    if acc in ("float", "double"):
        return "(-cuda::std::numeric_limits<ACC>::infinity())" if op == "max" else \
            "(cuda::std::numeric_limits<ACC>::infinity())"
    return "cuda::std::numeric_limits<ACC>::lowest()" if op == "max" else "cuda::std::numeric_limits<ACC>::max()"


def _kernels(op: str, dt: np.dtype):
    t = _CTYPE[dt]
    is_float = dt.kind == "f"
    if op == "sum":
        acc = "double" if is_float else "long long"
    else:  # warp shuffles take no 8-bit types: small ints compare as int
        acc = t if dt.itemsize >= 4 else "int"
    vec = 16 // dt.itemsize  # one 16-byte load a step
    defines = (f"#define T {t}\n#define ACC {acc}\n#define OP {OPS.index(op)}\n#define IS_FLOAT {int(is_float)}\n"
               f"#define VEC {vec}\n#define VTYPE int4\n#define IDENTITY {_identity(op, acc)}\n")
    src = defines + _SOURCE
    acc_dtype = {"double": np.float64, "long long": np.int64, "int": np.int32, "float": np.float32}[acc]
    return compile_kernel(src, "kiln_reduce_all_1"), compile_kernel(src, "kiln_reduce_all_2"), np.dtype(acc_dtype)


_SMS: list = []


def _blocks(n: int) -> int:
    if not _SMS:
        _SMS.append(cp.cuda.Device().attributes["MultiProcessorCount"])
    return max(1, min(4 * _SMS[0], -(-n // (BLOCK * 16))))


def supported(op: str, dt: Optional[np.dtype]) -> bool:
    """Whether ``op`` over all of a ``dt`` tensor runs here (sums: 32/64-bit types only, whose
    reference keeps the dtype)."""
    if op not in OPS or dt is None or np.dtype(dt) not in _CTYPE:
        return False
    return op != "sum" or np.dtype(dt).itemsize >= 4


def reduce_all(op: str, x: "cp.ndarray", keepdims: bool) -> "cp.ndarray":
    """``op`` over every element of ``x`` (contiguous or not), as a 0-d array or, with
    ``keepdims``, one of shape ``(1,) * x.ndim``; in x's dtype."""
    x = cp.ascontiguousarray(x)
    stage1, stage2, acc = _kernels(op, x.dtype)
    blocks = _blocks(x.size)
    partial = cp.empty(blocks, acc)
    y = cp.empty((1,) * x.ndim if keepdims else (), x.dtype)
    stage1((blocks,), (BLOCK,), (x, np.int64(x.size), partial))
    stage2((1,), (BLOCK,), (partial, np.int32(blocks), y))
    return y
