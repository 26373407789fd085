"""``DequantizeLinear`` on the GPU: int8 weights back to float in one kernel (weight-only int8, issue 18).

Why: a model loaded with ``weights="int8"`` keeps its MatMul/Gemm weights as int8 with one scale per output
channel (ir/passes/quantize.py's format) and dequantizes each weight right before its GEMM. The op's
numpy reference on device arrays (shape.py) is four CuPy kernels and two float32 temporaries per weight;
this is one pass: read 1 byte, write the scale's type (float32, float16, or bfloat16 as uint16 words).

How: ``y[i] = x[i] * scale[(i / inner) % channels]`` with the float product rounded once to the output type,
eight elements a thread, for int8/uint8 data of a multiple of 8 elements without a zero point (kiln's own
quantization is symmetric) and a scalar or 1-D scale.
Other forms (a zero point, int32 or 16-bit data, blocked scales, an output_dtype) take the reference, except
bfloat16 outputs, which the reference would read as integers: those raise.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.errors import KilnError
from kiln.runtime.kernels.cuda import kernel, out_dtype
from kiln.runtime.kernels.cuda.codegen import HALF_CONVERSIONS

# Eight elements a thread (an 8-byte load of int8, a 16- or 32-byte store), 32-bit indices: a weight
# dequantized per call must cost about its bytes, not its element count in divisions (the first version,
# one element and a 64-bit division per thread, made BERT's int8 run 0.4 ms slower at batch 1).
_SOURCE = r"""
template <typename U, int W> struct alignas(sizeof(U) * W) VW { U v[W]; };
extern "C" __global__ void kiln_dequantize(const XT* __restrict__ x, const SC* __restrict__ scale, SC* __restrict__ y,
                                           int n8, int inner, int channels) {
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < n8; v += gridDim.x * blockDim.x) {
        const VW<XT, 8> q = reinterpret_cast<const VW<XT, 8>*>(x)[v];
        VW<SC, 8> o;
        const int i0 = v * 8;
        if (channels == 1) {
            const float s = LD(scale[0]);
#pragma unroll
            for (int e = 0; e < 8; ++e) o.v[e] = ST((float)q.v[e] * s);
        } else if (inner % 8 == 0) {  // one channel for all eight (a per-row scale)
            const float s = LD(scale[(i0 / inner) % channels]);
#pragma unroll
            for (int e = 0; e < 8; ++e) o.v[e] = ST((float)q.v[e] * s);
        } else {
            int c = (i0 / inner) % channels, r = i0 % inner;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                o.v[e] = ST((float)q.v[e] * LD(scale[c]));
                if (++r == inner) { r = 0; if (++c == channels) c = 0; }
            }
        }
        reinterpret_cast<VW<SC, 8>*>(y)[v] = o;
    }
}
"""
_IO = {
    "float32": "#define SC float\n#define LD(v) (v)\n#define ST(v) (v)\n",
    "float16": HALF_CONVERSIONS + "#define SC unsigned short\n#define LD(v) kiln_h2f(v)\n#define ST(v) kiln_f2h(v)\n",
    "uint16": HALF_CONVERSIONS + "#define SC unsigned short\n#define LD(v) kiln_bf2f(v)\n#define ST(v) kiln_f2bf(v)\n",
}
_XT = {"int8": "signed char", "uint8": "unsigned char"}
_KERNELS: dict = {}
LAUNCHES = {"kernel": 0, "reference": 0}


def _kernel(xt: str, st: str):
    k = _KERNELS.get((xt, st))
    if k is None:
        from kiln.runtime.kernels.cuda.codegen import compile_kernel
        k = _KERNELS[(xt, st)] = compile_kernel(f"#define XT {_XT[xt]}\n" + _IO[st] + _SOURCE, "kiln_dequantize")
    return k


def dequantize(x, scale, axis: int):
    """y = x * scale (per-axis along ``axis``, or per-tensor), or None when this kernel does not take the form."""
    if x.dtype.name not in _XT or scale.dtype.name not in _IO or scale.ndim > 1 or not x.flags.c_contiguous:
        return None
    axis = axis + x.ndim if axis < 0 else axis
    channels = 1 if scale.size == 1 else scale.size
    if channels > 1 and (x.ndim == 0 or not 0 <= axis < x.ndim or x.shape[axis] != channels):
        return None
    inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64)) if channels > 1 else 1
    n = x.size
    if n % 8 or n >= 2**31 or x.data.ptr % 8:
        return None  # the reference then (a weight's element count is a multiple of 8 in practice)
    y = cp.empty(x.shape, scale.dtype)
    if n:
        block = 256
        n8 = n // 8
        blocks = min(-(-n8 // block), 65535 * 4)
        _kernel(x.dtype.name, scale.dtype.name)((blocks,), (block,),
                                                 (x, cp.ascontiguousarray(scale.reshape(-1)), y, np.int32(n8),
                                                  np.int32(max(inner, 1)), np.int32(channels)))
    return y


@kernel("DequantizeLinear")
def dequantize_linear(node, attrs) -> Optional[Callable[..., Any]]:
    from kiln.runtime.kernels.cuda.shape import device_reference
    axis = attrs["axis"]
    ref = device_reference(node, attrs)
    words = np.dtype(out_dtype(node) or np.float32).name == "bfloat16"
    # The kernel writes the scale's type, per-tensor or per-axis: blocked scales and output_dtype take the reference.
    plain = not attrs.get("block_size", 0) and not attrs.get("output_dtype", 0)
    # A bfloat16 scale lives on the device as uint16 words, which the reference would multiply as integers: it
    # gets the scale widened to float32 (exact), which changes nothing where output_dtype fixes the result type
    # (a bfloat16 result has no reference path: ``words`` raises below).
    bf16_scale = node.inputs[1].type is not None and node.inputs[1].type.dtype.short == "bfloat16"

    def run(x, scale, zero_point=None):
        if zero_point is None and plain:
            y = dequantize(x, scale, axis)
            if y is not None:
                LAUNCHES["kernel"] += 1
                return y
        if words:
            raise KilnError(f"{node.describe()}: a bfloat16 DequantizeLinear of {x.dtype} data with "
                            f"{'a zero point' if zero_point is not None else 'this scale'} has no GPU path yet")
        LAUNCHES["reference"] += 1
        if bf16_scale:
            scale = (scale.astype(cp.uint32) << 16).view(cp.float32)
        return ref(x, scale) if zero_point is None else ref(x, scale, zero_point)
    return run


__all__ = ["dequantize", "LAUNCHES"]
