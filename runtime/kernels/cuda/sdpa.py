"""``kiln.FusedAttention`` in float16 through cuDNN's fused attention (flash attention on tensor cores).

Why: kiln's own attention kernel (attention.py) computes in float32 FMAs on CUDA cores. In half
precision everything around it runs on tensor cores, and attention became the largest share of
BERT-base's time at batch 32 (31% of an fp16 profile) while torch.compile runs a tensor-core flash
attention there. cuDNN's SDPA graph (reached like the convolutions, through nvidia-cudnn-frontend's
Python graph API with raw device pointers, so no torch at run time) is that kernel: Q K^T, scale,
bias, softmax and P V in one pass, half inputs, float32 accumulation and softmax statistics.

How: one frontend graph per key (shapes, strides, scale, mask layout), built on the eager warm-up
call and cached like the convolution plans (never while a stream captures). Q, K and V are read
where they are, through their strides: K from the graph's ``kt`` ([.., D, Lk]) is the same memory
described as [.., Lk, D]. The mask (BERT's [B, 1, 1, Lk] padding bias, GPT-2's [Lq, Lk] causal bias)
is cuDNN's additive bias, broadcast over batch and heads by unit dims; where cuDNN refuses a stride-0
query dim, the mask is expanded to [., ., Lq, Lk] on each call (the build records which). The output
is written [B, Lq, H, Dv] and handed on as its [B, H, Lq, Dv] view (attention.empty_output: the
head merge after it is then a view).

Fully masked rows: the graph says what a query row whose every key is masked out gives (NaN from a
plain softmax, zeros from torch's safe softmax, attention_parts' "safe"). What cuDNN gives there is
probed once (``empty_row_answer``); where a mask may mask out a whole row and cuDNN's answer differs
from the graph's, kiln's kernel runs instead (it does either exactly).

Where it does not apply (float32 or float64; cuDNN absent, its self-test failed, or no engine for
this shape: head dims not a multiple of 8, a last dim that is not contiguous), ``sdpa`` returns None
and the caller takes kiln's kernel. The attention path is the program's ``CudaOptions.attention``:
"auto" takes this for float16 where cuDNN has an engine, "cudnn" the same (the name for tests and
A/B timings), "kernel" and "ops" never.
"""
from __future__ import annotations

import threading
from typing import Optional

import cupy as cp
import numpy as np

from kiln.runtime.kernels.cuda import cudnn as _cudnn

_PLANS: dict = {}   # key -> SdpaPlan, or the Unsupported that building it raised
_LOCK = threading.Lock()


class SdpaPlan:
    """A built cuDNN SDPA graph for one key; executes on any buffers of that layout."""

    def __init__(self, cudnn, q, k, v, mask, o, scale: float, expand_mask: bool, dtype=np.float16):
        # float16, or bfloat16 held as uint16 words (a uint16 attention input is bfloat16: cuda/__init__.py)
        half = cudnn.data_type.BFLOAT16 if np.dtype(dtype) == np.uint16 else cudnn.data_type.HALF
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=half, intermediate_data_type=f32, compute_data_type=f32)
        Q = g.tensor(name="Q", dim=list(q[0]), stride=list(q[1]), data_type=half)
        K = g.tensor(name="K", dim=list(k[0]), stride=list(k[1]), data_type=half)
        V = g.tensor(name="V", dim=list(v[0]), stride=list(v[1]), data_type=half)
        B = None
        if mask is not None:
            dims, strides = mask
            if expand_mask:
                strides = _cudnn._row_major(dims)
            B = g.tensor(name="bias", dim=list(dims), stride=list(strides), data_type=half)
        O, _ = g.sdpa(name="sdpa", q=Q, k=K, v=V, attn_scale=float(scale), bias=B, generate_stats=False,
                      compute_data_type=f32)
        O.set_output(True).set_dim(list(o[0])).set_stride(list(o[1])).set_data_type(half)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        self.graph = g
        self.uids = (Q.uid, K.uid, V.uid, None if B is None else B.uid, O.uid)
        self.expand_mask = expand_mask
        self.mask_dims = None if mask is None else tuple(mask[0])
        self.workspace_bytes = int(g.get_workspace_size())

    def execute(self, q, k, v, bias, o) -> None:
        qu, ku, vu, bu, ou = self.uids
        pack = {qu: q.data.ptr, ku: k.data.ptr, vu: v.data.ptr, ou: o.data.ptr}
        if bu is not None:
            pack[bu] = bias.data.ptr
        ws = _cudnn.workspace(self.workspace_bytes)
        self.graph.execute(pack, None if ws is None else ws.ptr, handle=_cudnn._handle(cp.cuda.get_current_stream()))


def _plan(key, build) -> Optional[SdpaPlan]:
    with _LOCK:
        p = _PLANS.get(key)
        if p is None:
            if _cudnn.capturing():
                return None  # never built inside a capture; the caller takes kiln's kernel
            try:
                p = build()
            except Exception as e:  # noqa: BLE001 - the frontend raises several types
                p = _cudnn.Unsupported(f"{type(e).__name__}: {e}")
            _PLANS[key] = p
    return None if isinstance(p, _cudnn.Unsupported) else p


def why_not(key) -> Optional[str]:
    """Why cuDNN refused the plan of ``key`` (tests and reports), or None."""
    p = _PLANS.get(key)
    return str(p) if isinstance(p, _cudnn.Unsupported) else None


def available() -> bool:
    """cuDNN is usable here (the convolution self-test passed), and capturable when a stream captures."""
    if not _cudnn.available():
        return False
    return _cudnn.capture_ok() or not _cudnn.capturing()


def sdpa(q, kt, v, mask, scale: float, *, safe: bool = False, may_empty: bool = True):
    """softmax(q @ kt * scale + mask) @ v through cuDNN for float16 [B, H, L, D] inputs (or ranks the
    caller's shape checks allowed, as [1, B*H, ...] views), or None where cuDNN does not take it.
    Where the mask may mask out a whole row (``may_empty``), cuDNN is used only if its answer for such
    a row is the graph's: zeros for a safe softmax (``safe``), NaN otherwise (``empty_row_answer``)."""
    from kiln.runtime.kernels.cuda.attention import _as4, empty_output
    if q.dtype not in (np.float16, np.uint16) or not available():
        return None
    if may_empty and empty_row_answer(q.dtype) != ("zero" if safe else "nan"):
        return None
    batch, lq, lk, dv = q.shape[:-2], q.shape[-2], kt.shape[-1], v.shape[-1]
    q4, qs = _as4(q)
    k4, ks = _as4(kt)
    v4, vs = _as4(v)
    nb, nh = q4.shape[:2]
    d = q4.shape[-1]
    if mask is not None:
        m4, ms = _as4(cp.broadcast_to(mask, batch + (lq, lk)))
        # batch and heads the mask does not vary over are unit dims (cuDNN broadcasts them)
        mdims = (nb if ms[0] else 1, nh if ms[1] else 1, lq, lk)
        mstrides = tuple(s if n > 1 else _unit_stride(mdims, i) for i, (s, n) in enumerate(zip(ms, mdims)))
        mask_key = (mdims, mstrides)
    else:
        m4, mask_key = None, None
    out, buf, os_ = empty_output(batch, lq, dv, q.dtype)
    qd = ((nb, nh, lq, d), qs)
    kd = ((nb, nh, lk, d), (ks[0], ks[1], ks[3], ks[2]))
    vd = ((nb, nh, lk, dv), vs)
    od = ((nb, nh, lq, dv), os_ + (1,))
    cudnn = _cudnn._module()
    key = (qd, kd, vd, mask_key, od, float(scale), str(q.dtype))
    p = _plan(key, lambda: _build(cudnn, qd, kd, vd, mask_key, od, scale, q.dtype))
    if p is None:
        return None
    bias = None
    if m4 is not None:
        bias = m4[:p.mask_dims[0], :p.mask_dims[1]]
        if p.expand_mask:
            bias = cp.ascontiguousarray(bias)
    p.execute(q4, k4, v4, bias, buf)
    return out


_EMPTY_ROW: dict = {}


def _on_device(a: np.ndarray, dtype):
    """float32 host data as a device array of ``dtype`` (float16, or bfloat16 as uint16 words)."""
    if np.dtype(dtype) == np.uint16:
        import ml_dtypes  # noqa: PLC0415 - present wherever bfloat16 models are loaded
        return cp.asarray(a.astype(ml_dtypes.bfloat16).view(np.uint16))
    return cp.asarray(a.astype(dtype))


def _to_float(a, dtype) -> np.ndarray:
    h = cp.asnumpy(a)
    if np.dtype(dtype) == np.uint16:
        import ml_dtypes  # noqa: PLC0415
        return h.view(ml_dtypes.bfloat16).astype(np.float32)
    return h.astype(np.float32)


def empty_row_answer(dtype=np.float16) -> str:
    """What cuDNN's attention gives for a query row whose every key is masked out (-inf bias): "zero",
    "nan" or "other" (or "error: ..."), probed once per dtype (float16; uint16 = bfloat16) on a small problem."""
    key = np.dtype(dtype).name
    if key not in _EMPTY_ROW:
        if _cudnn.capturing():
            return "unknown"  # probed on the next eager call
        try:
            rng = np.random.default_rng(0)
            q = _on_device(rng.standard_normal((1, 2, 16, 64)).astype(np.float32), dtype)
            # k as the graph hands it over: a transposed view (cuDNN wants the head dim contiguous)
            kt = _on_device(rng.standard_normal((1, 2, 32, 64)).astype(np.float32), dtype).transpose(0, 1, 3, 2)
            v = _on_device(rng.standard_normal((1, 2, 32, 64)).astype(np.float32), dtype)
            bias = np.zeros((1, 1, 16, 32), np.float32)
            bias[..., 3, :] = -np.inf
            out = sdpa(q, kt, v, _on_device(bias, dtype), 0.125, may_empty=False)
            if out is None:
                answer = "error: no engine for the probe"
            else:
                o = _to_float(out, dtype)
                row, others = o[:, :, 3], np.delete(o, 3, axis=2)
                answer = ("other" if not np.isfinite(others).all() else "zero" if (row == 0).all()
                          else "nan" if np.isnan(row).all() else "other")
        except Exception as e:  # noqa: BLE001
            answer = f"error: {type(e).__name__}: {e}"
        _EMPTY_ROW[key] = answer
    return _EMPTY_ROW[key]


def _unit_stride(dims, i) -> int:
    """A harmless stride for unit dim ``i`` of a row-major ``dims`` (the product of the dims after it)."""
    return int(np.prod(dims[i + 1:]))


def _build(cudnn, qd, kd, vd, mask_key, od, scale, dtype) -> SdpaPlan:
    try:
        return SdpaPlan(cudnn, qd, kd, vd, mask_key, od, scale, expand_mask=False, dtype=dtype)
    except Exception:  # noqa: BLE001 - e.g. a stride-0 query dim in the bias: retry with it expanded
        if mask_key is None or 0 not in mask_key[1]:
            raise
        return SdpaPlan(cudnn, qd, kd, vd, mask_key, od, scale, expand_mask=True, dtype=dtype)


__all__ = ["sdpa", "available", "why_not", "empty_row_answer", "SdpaPlan"]
