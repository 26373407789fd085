"""``kiln.FusedAttention`` on the GPU: softmax(q @ kt * scale [+ mask]) @ v as one kernel.

Why: run op by op, attention writes the [.., Lq, Lk] score matrix, reads it back for the
softmax, writes the probabilities and reads them again for the second product. For BERT-base at
batch 32 that matrix is 25 MB a layer, and on an H200 the four steps took about 150 us a layer
(bench/gpu_profile.py). This kernel never stores it: a block of 256 threads takes 64 query
rows of one (batch, head), keeps them in shared memory (transposed), and walks the keys in tiles
of 32, folding each tile into a running softmax (flash-attention style: running max, running
sum, rescaled accumulator), so the scores live only in registers and a 64 x 32 staging tile.

How: both products are register-tiled like a small GEMM. Thread (ty, tx) of the 16 x 16 block
computes the scores of rows 4ty..4ty+3 against keys 2tx, 2tx+1 of the tile (8 FMAs per float4 +
float2 shared-memory read), then owns output rows 4ty..+3 and head dims 4tx..+3 of P V (16
FMAs per two float4 reads). A row's 32 scores sit in one half-warp, so its max and sum are four
shuffles each. The scale multiplies the finished dot product and the mask is added after it,
as the unfused graph does. Rows whose every key so far is masked out contribute nothing (no
NaN from exp(-inf - -inf)); a row masked entirely gives NaN, as the reference's softmax does.
Inputs are read through their strides (q, kt, v are usually transposed views of a [B, T, H, D]
projection, read without a copy); leading dims beyond two are merged. A first version that
gave each warp one query row at a time (lane = key) ran 411 us a layer on BERT-base at batch
32, slower than the unfused ops: its dependent FMA chains left the SMs waiting.

Where it does not apply (float64, a head dim over 64, fewer blocks than SMs in "auto" mode), the
body runs node by node with the CUDA kernels of its ops, as an unfused graph would. The mode is
the program's ``CudaOptions.attention`` ("auto", "cudnn", "kernel", "ops"; default KILN_ATTENTION or the
deprecated process-wide ``MODE["mode"]``), bound into each FusedAttention kernel at load (issue
17); each kernel counts the calls that took each path (``run.attention_paths``: {"cudnn": n,
"kernel": n, "ops": n}; under CUDA graphs only the eager warm-up and the capture call count, not
replays). In float16, "auto" and "cudnn" first try cuDNN's fused attention (sdpa.py: tensor cores),
at any grid size; this kernel is the fallback where cuDNN has no engine (issue 18).

The output is written [B, Lq, H, Dv] and returned as its [B, H, Lq, Dv] view (``empty_output``),
so the usual head merge after attention is a view rather than a copy.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.errors import KilnError
from kiln.runtime.cuda_options import ATTENTION_DEFAULT
from kiln.runtime.kernels.cuda import kernel, options
from kiln.runtime.kernels.cuda.codegen import HALF_CONVERSIONS

_SOURCE = r"""
#define BQ 64    // query rows a block
#define KT 32    // keys a tile
#define HD 64    // largest head dim (q/k and v)
#define QP 68    // pitch of Qt and Pt rows (floats; a multiple of 4 for float4 reads)
#define KP 34    // pitch of Kt rows (even, for float2 reads)
extern "C" __global__ void __launch_bounds__(256) kiln_attention(
        const IN* __restrict__ q, const IN* __restrict__ k, const IN* __restrict__ v,
        const IN* __restrict__ mask, IN* __restrict__ o,
        const int H, const int Lq, const int Lk, const int D, const int Dv, const float scale,
        const long long qs0, const long long qs1, const long long qs2, const long long qs3,
        const long long ks0, const long long ks1, const long long ks2, const long long ks3,
        const long long vs0, const long long vs1, const long long vs2, const long long vs3,
        const long long ms0, const long long ms1, const long long ms2, const long long ms3,
        const long long os0, const long long os1, const long long os2, const int safe) {
    __shared__ __align__(16) float Qt[HD * QP];   // q rows transposed: Qt[d][row]
    __shared__ __align__(16) float Kt[HD * KP];   // the key tile transposed: Kt[d][key]
    __shared__ __align__(16) float Vs[KT * HD];   // the value tile: Vs[key][d]
    __shared__ __align__(16) float Pt[KT * QP];   // the tile's probabilities: Pt[key][row]
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;   // 16 x 16 threads
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int row0 = blockIdx.x * BQ;
    const float NEG_INF = __int_as_float(0xff800000);
    const IN* qb = q + b * qs0 + h * qs1;
    const IN* kb = k + b * ks0 + h * ks1;
    const IN* vb = v + b * vs0 + h * vs1;
    const IN* mb = mask == nullptr ? nullptr : mask + b * ms0 + h * ms1;
    // Q: 16 loads a thread, all issued before any is stored (the trip counts are constants).
    float qreg[BQ * HD / 256];
    #pragma unroll
    for (int u = 0; u < BQ * HD / 256; ++u) {
        const int idx = tid + u * 256, r = idx / HD, d = idx - r * HD, i = row0 + r;
        qreg[u] = (i < Lq && d < D) ? LD(qb[i * qs2 + d * qs3]) : 0.f;
    }
    #pragma unroll
    for (int u = 0; u < BQ * HD / 256; ++u) {
        const int idx = tid + u * 256, r = idx / HD, d = idx - r * HD;
        Qt[d * QP + r] = qreg[u];
    }
    float m[4], l[4], acc[4][4];
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
        m[r] = NEG_INF; l[r] = 0.f;
        #pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.f;
    }
    // The key/value tiles go through registers, one tile ahead: the next tile's loads are in
    // flight while this one is computed.
    float kreg[KT * HD / 256], vreg[KT * HD / 256];
    #pragma unroll
    for (int u = 0; u < KT * HD / 256; ++u) {
        const int idx = tid + u * 256, jj = idx / HD, d = idx - jj * HD, j = jj;
        kreg[u] = (j < Lk && d < D) ? LD(kb[d * ks2 + j * ks3]) : 0.f;
        vreg[u] = (j < Lk && d < Dv) ? LD(vb[j * vs2 + d * vs3]) : 0.f;
    }
    for (int j0 = 0; j0 < Lk; j0 += KT) {
        __syncthreads();   // the previous tile is consumed (and Qt written, the first time)
        #pragma unroll
        for (int u = 0; u < KT * HD / 256; ++u) {
            const int idx = tid + u * 256, jj = idx / HD, d = idx - jj * HD;
            Kt[d * KP + jj] = kreg[u];
            Vs[jj * HD + d] = vreg[u];
        }
        __syncthreads();
        if (j0 + KT < Lk) {
            #pragma unroll
            for (int u = 0; u < KT * HD / 256; ++u) {
                const int idx = tid + u * 256, jj = idx / HD, d = idx - jj * HD, j = j0 + KT + jj;
                kreg[u] = (j < Lk && d < D) ? LD(kb[d * ks2 + j * ks3]) : 0.f;
                vreg[u] = (j < Lk && d < Dv) ? LD(vb[j * vs2 + d * vs3]) : 0.f;
            }
        }
        // Scores of rows ty*4..+3 against keys tx*2, tx*2+1 of the tile: 8 FMAs per 2 loads.
        float s[4][2];
        #pragma unroll
        for (int r = 0; r < 4; ++r) { s[r][0] = 0.f; s[r][1] = 0.f; }
        #pragma unroll 16
        for (int d = 0; d < HD; ++d) {
            const float4 qv = *reinterpret_cast<const float4*>(Qt + d * QP + ty * 4);
            const float2 kv = *reinterpret_cast<const float2*>(Kt + d * KP + tx * 2);
            s[0][0] = fmaf(qv.x, kv.x, s[0][0]); s[0][1] = fmaf(qv.x, kv.y, s[0][1]);
            s[1][0] = fmaf(qv.y, kv.x, s[1][0]); s[1][1] = fmaf(qv.y, kv.y, s[1][1]);
            s[2][0] = fmaf(qv.z, kv.x, s[2][0]); s[2][1] = fmaf(qv.z, kv.y, s[2][1]);
            s[3][0] = fmaf(qv.w, kv.x, s[3][0]); s[3][1] = fmaf(qv.w, kv.y, s[3][1]);
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = row0 + ty * 4 + r;
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = j0 + tx * 2 + c;
                float x = s[r][c] * scale;
                if (j >= Lk) x = NEG_INF;
                else if (mb != nullptr && i < Lq) x += LD(mb[i * ms2 + j * ms3]);
                s[r][c] = x;
            }
            // The row's 32 scores sit in 16 lanes (one half-warp): max and sum by shuffles.
            float mx = fmaxf(s[r][0], s[r][1]);
            #pragma unroll
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[r], mx);
            const bool none = m_new == NEG_INF;   // every key so far masked out
            const float corr = none ? 1.f : expf(m[r] - m_new);
            const float p0 = none ? 0.f : expf(s[r][0] - m_new);
            const float p1 = none ? 0.f : expf(s[r][1] - m_new);
            float ps = p0 + p1;
            #pragma unroll
            for (int off = 8; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
            l[r] = l[r] * corr + ps;
            m[r] = m_new;
            #pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] *= corr;
            Pt[(tx * 2) * QP + ty * 4 + r] = p0;
            Pt[(tx * 2 + 1) * QP + ty * 4 + r] = p1;
        }
        __syncthreads();
        // acc[rows ty*4..+3][cols tx*4..+3] += P V: 16 FMAs per 2 loads.
        #pragma unroll 8
        for (int jj = 0; jj < KT; ++jj) {
            const float4 pv = *reinterpret_cast<const float4*>(Pt + jj * QP + ty * 4);
            const float4 vv = *reinterpret_cast<const float4*>(Vs + jj * HD + tx * 4);
            const float pr[4] = {pv.x, pv.y, pv.z, pv.w};
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                acc[r][0] = fmaf(pr[r], vv.x, acc[r][0]);
                acc[r][1] = fmaf(pr[r], vv.y, acc[r][1]);
                acc[r][2] = fmaf(pr[r], vv.z, acc[r][2]);
                acc[r][3] = fmaf(pr[r], vv.w, acc[r][3]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int i = row0 + ty * 4 + r;
        if (i < Lq) {
            IN* orow = o + b * os0 + h * os1 + i * os2;
            #pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int d = tx * 4 + c;
                // l == 0 only for a row whose every key is masked out: NaN (0 / 0) as the reference's softmax,
                // or zeros for torch's safe softmax.
                if (d < Dv) orow[d] = ST(safe && l[r] == 0.f ? 0.f : acc[r][c] / l[r]);
            }
        }
    }
}
"""
MAX_HEAD = 64   # head dims (q/k and v) up to this; wider heads run the body op by op
ROWS_PER_BLOCK = 64
# Too few blocks leave most SMs idle while each block walks every key tile on its own (BERT at
# batch 1: 24 blocks on 132 SMs); then the unfused ops, each spread over the whole GPU, win.
# "auto" runs the kernel from this many blocks per SM; CudaOptions.attention (KILN_ATTENTION)
# = kernel|ops forces one. MODE: the deprecated process default (None: the environment's).
MIN_BLOCKS_PER_SM = 1.0
MODE = ATTENTION_DEFAULT
_KERNEL: dict = {}


def _sms() -> int:
    n = _KERNEL.get("sms")
    if n is None:
        n = _KERNEL["sms"] = cp.cuda.Device().attributes["MultiProcessorCount"]
    return n


# float16 (issue 18): q, k, v, the mask and the output in half; scores, softmax and P V in float32. bfloat16 is
# held as uint16 words on the device (a float-only kernel reads a uint16 array as bfloat16).
_IO = {np.dtype(np.float32): "#define IN float\n#define LD(x) (x)\n#define ST(x) (x)\n",
       np.dtype(np.float16): HALF_CONVERSIONS + "#define IN unsigned short\n#define LD(x) kiln_h2f(x)\n#define ST(x) kiln_f2h(x)\n",
       np.dtype(np.uint16): HALF_CONVERSIONS + "#define IN unsigned short\n#define LD(x) kiln_bf2f(x)\n#define ST(x) kiln_f2bf(x)\n"}


def _kernel(dtype=np.float32):
    dtype = np.dtype(dtype)
    k = _KERNEL.get(("k", dtype))
    if k is None:
        from kiln.runtime.kernels.cuda.codegen import compile_kernel
        k = _KERNEL[("k", dtype)] = compile_kernel(_IO[dtype] + _SOURCE, "kiln_attention")
    return k


def _as4(x):
    """x viewed as [B, H, rows, cols] (leading dims merged, or padded with unit dims) with its
    strides in elements; merging copies only when the leading dims cannot be merged as a view."""
    lead = x.shape[:-2]
    if len(lead) > 2:
        x = x.reshape((-1,) + x.shape[-3:])
    elif len(lead) < 2:
        x = x.reshape((1,) * (2 - len(lead)) + x.shape)
    return x, tuple(s // x.itemsize for s in x.strides)


def attention(q, kt, v, mask, scale: float, mode: Optional[str] = None, *, safe: bool = False,
              may_empty: bool = True):
    """softmax(q @ kt * scale + mask) @ v for float32 or float16 arrays of one rank >= 3 (mask broadcastable
    to the scores, or None), or None when the kernel does not apply. ``mode``: "auto" leaves
    grids smaller than the GPU to the caller; None: the bound program's option. Float16 goes
    through cuDNN's fused attention first where it has an engine (sdpa.py). ``safe``: a row whose every
    key is masked out gives zeros (torch's safe softmax), else NaN; ``may_empty``: whether the mask can
    mask out a whole row (False for no mask, or a constant one that does not)."""
    return attention_path(q, kt, v, mask, scale, mode, safe=safe, may_empty=may_empty)[0]


def attention_path(q, kt, v, mask, scale: float, mode: Optional[str] = None, *, safe: bool = False,
                   may_empty: bool = True) -> tuple:
    """``attention``'s result and the path that made it: "cudnn", "kernel", or None (not applicable)."""
    if mode is None:
        mode = options().attention
    if q.dtype not in _IO or kt.dtype != q.dtype or v.dtype != q.dtype or q.ndim < 3 \
            or not (q.ndim == kt.ndim == v.ndim) or (mask is not None and mask.dtype != q.dtype):
        return None, None
    lq, d = q.shape[-2:]
    lk, dv = kt.shape[-1], v.shape[-1]
    batch = q.shape[:-2]
    if kt.shape[:-2] != batch or v.shape[:-2] != batch or kt.shape[-2] != d or v.shape[-2] != lk:
        return None, None
    if mode in ("auto", "cudnn") and q.dtype in (np.float16, np.uint16) and d > 0 and lk > 0 and math.prod(batch) * lq * dv > 0:
        from kiln.runtime.kernels.cuda.sdpa import sdpa
        out = sdpa(q, kt, v, mask, scale, safe=safe, may_empty=may_empty and mask is not None)
        if out is not None:
            return out, "cudnn"
    if d > MAX_HEAD or dv > MAX_HEAD or d == 0:
        return None, None
    nbh = math.prod(batch)
    blocks = -(-lq // ROWS_PER_BLOCK) * nbh
    if nbh > 65535 or (mode in ("auto", "cudnn") and blocks < MIN_BLOCKS_PER_SM * _sms()):
        return None, None
    if math.prod(batch) * lq * dv == 0 or lk == 0:
        out = cp.empty(batch + (lq, dv), q.dtype)
        if lk == 0:
            out.fill(0 if safe else np.nan)  # softmax over no keys: 0 / 0, as the reference (0 if safe)
        return out, "kernel"
    q4, qs = _as4(q)
    k4, ks = _as4(kt)
    v4, vs = _as4(v)
    nb, nh = q4.shape[:2]
    if mask is not None:
        m4, ms = _as4(cp.broadcast_to(mask, batch + (lq, lk)))
    else:
        m4, ms = np.uint64(0), (0, 0, 0, 0)  # a null pointer
    out, buf, os_ = empty_output(batch, lq, dv, q.dtype)
    grid = (-(-lq // ROWS_PER_BLOCK), nb * nh)
    i32, i64 = np.int32, np.int64
    _kernel(q.dtype)(grid, (256,), (q4, k4, v4, m4, buf, i32(nh), i32(lq), i32(lk), i32(d), i32(dv), np.float32(scale),
                             *map(i64, qs), *map(i64, ks), *map(i64, vs), *map(i64, ms), *map(i64, os_), i32(safe)))
    return out, "kernel"


def empty_output(batch: tuple, lq: int, dv: int, dtype):
    """The attention output [*batch, Lq, Dv], its buffer and the buffer's (batch, head, row) strides in
    elements. For the usual [B, H, Lq, Dv] the buffer is [B, Lq, H, Dv] and the output its transposed
    view: the graph's next steps (``transpose(1, 2)`` then a reshape to [B, Lq, H * Dv], the heads
    merged for the output projection) are then views, not a copy of every layer's attention output
    (the copies around attention were 17% of BERT's half-precision profile). Other ranks: contiguous."""
    if len(batch) == 2:
        nb, nh = batch
        buf = cp.empty((nb, lq, nh, dv), dtype)
        return buf.transpose(0, 2, 1, 3), buf, (lq * nh * dv, dv, nh * dv)
    out = cp.empty(batch + (lq, dv), dtype)
    nh = 1 if len(batch) == 0 else batch[-1]
    return out, out, (nh * lq * dv, lq * dv, dv)


@kernel("FusedAttention", domain="kiln")
def fused_attention(node, attrs) -> Optional[Callable[..., Any]]:
    from kiln.ir.ops.fused import attention_parts
    from kiln.runtime.kernels.cuda.elementwise import _interpret
    body = attrs["body"]
    parts = attention_parts(body)
    scale, has_mask, safe = float(parts["scale"]), bool(parts["mask"]), bool(parts.get("safe"))
    # Whether the mask can mask out a whole row (cuDNN's answer there is checked before it is used):
    # not without a mask, nor for a constant mask with a finite score in every row (a causal mask).
    m = node.inputs[3].const if has_mask and len(node.inputs) > 3 and node.inputs[3] is not None else None
    may_empty = has_mask and (m is None or bool(np.isneginf(m).all(axis=-1).any()))
    by_nodes = _interpret(node, body)
    mode = options().attention  # the program's, bound at load
    paths = {"cudnn": 0, "kernel": 0, "ops": 0}

    def run(q, kt, v, mask=None):
        bf16 = q.dtype == np.uint16  # bfloat16 words: the body's ops node by node would compute on the words
        m = mask if has_mask else None
        out, path = (None, None) if mode == "ops" and not bf16 else attention_path(
            q, kt, v, m, scale, "cudnn" if bf16 and mode in ("auto", "ops") else mode, safe=safe, may_empty=may_empty)
        if out is None and bf16:  # kiln's kernel whatever the grid size
            out, path = attention_path(q, kt, v, m, scale, "kernel", safe=safe, may_empty=may_empty)
        if out is None and bf16:
            raise KilnError(f"bfloat16 attention of q {q.shape}, kt {kt.shape}, v {v.shape}: neither cuDNN nor kiln's kernel "
                            "takes it (head dim over 64 without cuDNN?), and the op-by-op path does not read "
                            "bfloat16: convert the model with precision='fp16'")
        if out is None:
            paths["ops"] += 1
            return by_nodes(*((q, kt, v, mask) if has_mask else (q, kt, v)))
        paths[path] += 1
        return out
    run.strategy = "fused kernel"
    run.attention_paths = paths
    run.attention_mode = mode
    return run


__all__ = ["attention", "MAX_HEAD"]
