"""``kiln.FusedAttention`` on the GPU: softmax(q @ kt * scale [+ mask]) @ v as one kernel.

Why: run op by op, attention writes the [.., Lq, Lk] score matrix, reads it back for the
softmax, writes the probabilities and reads them again for the second product. For BERT-base at
batch 32 that matrix is 25 MB a layer, and on an H200 the four steps took about 150 us a layer
(bench/gpu_profile.py). This kernel never stores it: each block keeps 32 query rows (16 when the
head is wide) in shared memory, walks the keys in tiles of 32 (K transposed and V staged in
shared memory), and folds every tile into a running softmax (flash-attention style: running
max, running sum, rescaled accumulator), so scores live only in registers.

How: one warp per query row at a time (8 or 4 rows a warp), lane j computes the score of key
j of the tile (a dot product over the head dim, q broadcast from shared memory, K stored
transposed with a padded stride so the 32 lanes hit 32 banks); the tile's max and sum are warp
shuffles; each lane owns up to 4 of the output's head dims and accumulates p_j * V[j] with p_j
broadcast by shuffle. The scale multiplies the finished dot product and the mask is added
after it, as the unfused graph does. Rows whose every key is masked out so far contribute
nothing (no NaN from exp(-inf - -inf)); a row masked entirely gives NaN, as the reference's
softmax does. Inputs are read through their strides (q, kt, v are usually transposed views of a
[B, T, H, D] projection, read without a copy); leading dims beyond two are merged.

Where it does not apply (float64, a head dim over 128, shared memory over 48 KB), the body
runs node by node with the CUDA kernels of its ops, as an unfused graph would.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.runtime.kernels.cuda import kernel

_SOURCE = r"""
#define KT 32
extern "C" __global__ void kiln_attention(
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
        const float* __restrict__ mask, float* __restrict__ o,
        const int H, const int Lq, const int Lk, const int D, const int Dv, const float scale,
        const long long qs0, const long long qs1, const long long qs2, const long long qs3,
        const long long ks0, const long long ks1, const long long ks2, const long long ks3,
        const long long vs0, const long long vs1, const long long vs2, const long long vs3,
        const long long ms0, const long long ms1, const long long ms2, const long long ms3) {
    extern __shared__ float smem[];
    const int BQ = ROWS * 4;
    float* Qs = smem;                    // [BQ][D]
    float* Kt = Qs + BQ * D;             // [D][KT + 1]: key j's vector down a column
    float* Vs = Kt + D * (KT + 1);       // [KT][Dv]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const int row0 = blockIdx.x * BQ;
    const float NEG_INF = __int_as_float(0xff800000);
    const float* qb = q + b * qs0 + h * qs1;
    const float* kb = k + b * ks0 + h * ks1;
    const float* vb = v + b * vs0 + h * vs1;
    const float* mb = mask == nullptr ? nullptr : mask + b * ms0 + h * ms1;
    for (int idx = tid; idx < BQ * D; idx += blockDim.x) {
        const int r = idx / D, d = idx - r * D, i = row0 + r;
        Qs[idx] = i < Lq ? qb[i * qs2 + d * qs3] : 0.f;
    }
    float m[ROWS], l[ROWS], acc[ROWS][4];
    #pragma unroll
    for (int t = 0; t < ROWS; ++t) {
        m[t] = NEG_INF; l[t] = 0.f;
        #pragma unroll
        for (int c = 0; c < 4; ++c) acc[t][c] = 0.f;
    }
    for (int j0 = 0; j0 < Lk; j0 += KT) {
        __syncthreads();
        for (int idx = tid; idx < KT * D; idx += blockDim.x) {
            const int jj = idx / D, d = idx - jj * D, j = j0 + jj;
            Kt[d * (KT + 1) + jj] = j < Lk ? kb[d * ks2 + j * ks3] : 0.f;
        }
        for (int idx = tid; idx < KT * Dv; idx += blockDim.x) {
            const int jj = idx / Dv, d = idx - jj * Dv, j = j0 + jj;
            Vs[idx] = j < Lk ? vb[j * vs2 + d * vs3] : 0.f;
        }
        __syncthreads();
        const int j = j0 + lane;
        #pragma unroll
        for (int t = 0; t < ROWS; ++t) {
            const int r = warp * ROWS + t, i = row0 + r;
            if (i >= Lq) break;  // the same for the whole warp
            float s = NEG_INF;
            if (j < Lk) {
                const float* qr = Qs + r * D;
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot = fmaf(qr[d], Kt[d * (KT + 1) + lane], dot);
                s = dot * scale;
                if (mb != nullptr) s += mb[i * ms2 + j * ms3];
            }
            float tmax = s;
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float m_new = fmaxf(m[t], tmax);
            const bool none = m_new == NEG_INF;  // every key so far masked out
            const float corr = none ? 1.f : expf(m[t] - m_new);
            const float p = none ? 0.f : expf(s - m_new);
            float psum = p;
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
            l[t] = l[t] * corr + psum;
            #pragma unroll
            for (int c = 0; c < 4; ++c) acc[t][c] *= corr;
            const int kmax = min(KT, Lk - j0);
            for (int jj = 0; jj < kmax; ++jj) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
                #pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int d = lane + 32 * c;
                    if (d < Dv) acc[t][c] = fmaf(pj, Vs[jj * Dv + d], acc[t][c]);
                }
            }
            m[t] = m_new;
        }
    }
    #pragma unroll
    for (int t = 0; t < ROWS; ++t) {
        const int i = row0 + warp * ROWS + t;
        if (i >= Lq) break;
        float* orow = o + ((long long)bh * Lq + i) * Dv;
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int d = lane + 32 * c;
            if (d < Dv) orow[d] = acc[t][c] / l[t];
        }
    }
}
"""
MAX_HEAD = 128          # head dims up to this (4 per lane)
SMEM_LIMIT = 48 << 10   # the default dynamic shared memory a block may take
_KERNELS: dict = {}


def _kernel(rows: int):
    k = _KERNELS.get(rows)
    if k is None:
        from kiln.runtime.kernels.cuda.codegen import compile_kernel
        k = _KERNELS[rows] = compile_kernel(f"#define ROWS {rows}\n" + _SOURCE, "kiln_attention")
    return k


def _smem(rows: int, d: int, dv: int) -> int:
    return 4 * (rows * 4 * d + d * 33 + 32 * dv)


def _as4(x):
    """x viewed as [B, H, rows, cols] (leading dims merged, or padded with unit dims) with its
    strides in elements; merging copies only when the leading dims cannot be merged as a view."""
    lead = x.shape[:-2]
    if len(lead) > 2:
        x = x.reshape((-1,) + x.shape[-3:])
    elif len(lead) < 2:
        x = x.reshape((1,) * (2 - len(lead)) + x.shape)
    return x, tuple(s // x.itemsize for s in x.strides)


def attention(q, kt, v, mask, scale: float):
    """softmax(q @ kt * scale + mask) @ v for float32 arrays of one rank >= 3 (mask broadcastable
    to the scores, or None), or None when the kernel does not apply."""
    if q.dtype != np.float32 or kt.dtype != np.float32 or v.dtype != np.float32 or q.ndim < 3 \
            or not (q.ndim == kt.ndim == v.ndim) or (mask is not None and mask.dtype != np.float32):
        return None
    lq, d = q.shape[-2:]
    lk, dv = kt.shape[-1], v.shape[-1]
    batch = q.shape[:-2]
    if kt.shape[:-2] != batch or v.shape[:-2] != batch or kt.shape[-2] != d or v.shape[-2] != lk:
        return None
    if d > MAX_HEAD or dv > MAX_HEAD or d == 0:
        return None
    rows = 8 if _smem(8, d, dv) <= SMEM_LIMIT else 4
    if _smem(rows, d, dv) > SMEM_LIMIT:
        return None
    out = cp.empty(batch + (lq, dv), np.float32)
    if out.size == 0:
        return out
    if lk == 0:
        out.fill(np.nan)  # softmax over no keys: 0 / 0, as the reference
        return out
    q4, qs = _as4(q)
    k4, ks = _as4(kt)
    v4, vs = _as4(v)
    nb, nh = q4.shape[:2]
    if mask is not None:
        m4, ms = _as4(cp.broadcast_to(mask, batch + (lq, lk)))
    else:
        m4, ms = np.uint64(0), (0, 0, 0, 0)  # a null pointer
    grid = (-(-lq // (rows * 4)), nb * nh)
    i32, i64 = np.int32, np.int64
    _kernel(rows)(grid, (128,), (q4, k4, v4, m4, out, i32(nh), i32(lq), i32(lk), i32(d), i32(dv),
                                 np.float32(scale), *map(i64, qs), *map(i64, ks), *map(i64, vs), *map(i64, ms)),
                  shared_mem=_smem(rows, d, dv))
    return out


@kernel("FusedAttention", domain="kiln")
def fused_attention(node, attrs) -> Optional[Callable[..., Any]]:
    from kiln.ir.ops.fused import attention_parts
    from kiln.runtime.kernels.cuda.elementwise import _interpret
    body = attrs["body"]
    parts = attention_parts(body)
    scale, has_mask = float(parts["scale"]), bool(parts["mask"])
    by_nodes = _interpret(node, body)

    def run(q, kt, v, mask=None):
        out = attention(q, kt, v, mask if has_mask else None, scale)
        if out is None:
            return by_nodes(*((q, kt, v, mask) if has_mask else (q, kt, v)))
        return out
    run.strategy = "fused kernel"
    return run


__all__ = ["attention", "MAX_HEAD"]
