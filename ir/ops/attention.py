"""``Attention``: ai.onnx's scaled dot-product attention (Attention-23/24/25).

Q [B, Hq, Sq, D] (or [B, Sq, Hq*D] with ``q_num_heads``/``kv_num_heads``), K [B, Hkv, Skv, D], V [B, Hkv, Skv, Dv];
an optional additive (float) or boolean (True attends) mask broadcast to [B, Hq, Sq, Stotal] and padded with
-inf / False up to Stotal; a key/value cache (``past_key``/``past_value``, prepended to K/V along the sequence,
given back as ``present_key``/``present_value``) or a per-batch count of valid keys (``nonpad_kv_seqlen``, the
static-cache form); ``is_causal`` (bottom-right aligned: query i attends key j iff j <= i + offset, offset the
past length, or nonpad_kv_seqlen - Sq); grouped-query attention (each KV head serves Hq/Hkv query heads,
interleaved); ``softcap`` (c * tanh(s / c) before the mask); ``softmax_precision``; a sliding window
(``left_window_size``/``right_window_size``, Attention-25); and ``qk_matmul_output`` (``qk_matmul_output_mode``
0: Q·Kᵀ scaled, 1: after the softcap, 2: plus the mask, 3: after the softmax). A query row whose every key is
masked gives zeros (Y and mode 3 alike). The reference follows onnx.reference's, computing narrow floats in
float32 (rounded once, on the way out).

kiln implements Attention-25 and imports 23 and 24 as they are: 24 adds ``nonpad_kv_seqlen`` and 25 the window
attributes, both optional; 25 also forbids the head-count attributes on 4-D inputs, where 23/24 read them as
the head counts, so kiln takes them on 4-D inputs only when they equal the inputs' head dims.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType

_MASK = FLOAT | {DType.BOOL}


def _known(d) -> bool:
    return isinstance(d, int)


def _sum_dims(a, b):
    if _known(a) and _known(b):
        return a + b
    if _known(a) and a == 0:
        return b
    if _known(b) and b == 0:
        return a
    return None


def _heads(ctx: InferContext, shape: tuple, attr: str, what: str) -> tuple:
    """(batch, heads, seq, head size) of a 3-D or 4-D Q/K/V shape."""
    if len(shape) == 4:
        given = ctx.attrs[attr]
        if given is not None and _known(shape[1]) and given != shape[1]:
            ctx.fail(f"{attr}={given} but {what} has {shape[1]} heads ({list(shape)})")
        return shape
    heads = ctx.attrs[attr]
    if heads is None:
        ctx.fail(f"3-D {what} ({list(shape)}) needs the {attr} attribute")
    if heads <= 0:
        ctx.fail(f"{attr} must be positive, not {heads}")
    hidden = shape[2]
    if _known(hidden) and hidden % heads:
        ctx.fail(f"{what}'s hidden size {hidden} is not a multiple of {attr}={heads}")
    return shape[0], heads, shape[1], hidden // heads if _known(hidden) else None


def _infer_attention(ctx: InferContext):
    q, k, v = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = q.dtype
    for t, name in ((k, "K"), (v, "V")):
        if t.dtype is not dt:
            ctx.fail(f"Q is {dt} but {name} is {t.dtype}")
    ranks = {len(t.shape) for t in (q, k, v) if t.shape is not None}
    if len(ranks) > 1 or not ranks <= {3, 4}:
        ctx.fail(f"Q, K and V must all be 3-D or all 4-D, not {q}, {k}, {v}")
    mask = ctx.inputs[3] if ctx.has_input(3) else None
    if mask is not None and mask.dtype is not DType.BOOL and mask.dtype is not dt:
        ctx.fail(f"attn_mask must be bool or Q's dtype {dt}, not {mask.dtype}")
    for i, name in ((4, "past_key"), (5, "past_value")):
        if ctx.has_input(i) and ctx.input(i).dtype is not dt:
            ctx.fail(f"{name} must have Q's dtype {dt}, not {ctx.input(i).dtype}")
    if ctx.has_input(4) != ctx.has_input(5):
        ctx.fail("past_key and past_value must be given together")
    if ctx.has_input(6) and ctx.has_input(4):
        ctx.fail("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if ctx.attrs["qk_matmul_output_mode"] not in (0, 1, 2, 3):
        ctx.fail(f"qk_matmul_output_mode must be 0..3, not {ctx.attrs['qk_matmul_output_mode']}")
    for w in ("left_window_size", "right_window_size"):
        if ctx.attrs[w] < -1:
            ctx.fail(f"{w} must be -1 or nonnegative, not {ctx.attrs[w]}")
    precision = ctx.attrs["softmax_precision"]
    if precision is not None and precision not in (DType.FLOAT16.value, DType.FLOAT32.value, DType.FLOAT64.value,
                                                   DType.BFLOAT16.value):
        ctx.fail(f"softmax_precision must be a float type code, not {precision}")
    if not ranks or any(t.shape is None for t in (q, k, v)):
        return [TensorType(dt, None)] * ctx.num_outputs
    b, hq, sq, d = _heads(ctx, q.shape, "q_num_heads", "Q")
    _, hk, skv, dk = _heads(ctx, k.shape, "kv_num_heads", "K")
    _, hv, sv, dv = _heads(ctx, v.shape, "kv_num_heads", "V")
    if _known(d) and _known(dk) and d != dk:
        ctx.fail(f"Q's head size {d} differs from K's {dk}")
    if _known(skv) and _known(sv) and skv != sv:
        ctx.fail(f"K has {skv} positions and V {sv}")
    if _known(hq) and _known(hk) and (hk == 0 or hq % hk):
        ctx.fail(f"{hq} query heads are not a multiple of {hk} key/value heads")
    past = 0
    if ctx.has_input(4):
        pk = ctx.input(4)
        past = pk.shape[2] if pk.shape is not None and len(pk.shape) == 4 else None
    total = _sum_dims(past, skv)
    if q.shape is not None and len(q.shape) == 3:
        y = TensorType(dt, (b, sq, hq * dv if _known(hq) and _known(dv) else None))
    else:
        y = TensorType(dt, (b, hq, sq, dv))
    outs = [y, TensorType(dt, (b, hk, total, dk)), TensorType(dt, (b, hv, total, dv)),
            TensorType(dt, (b, hq, sq, total))]
    return outs[:ctx.num_outputs]


def _to_4d(x: np.ndarray, heads: Optional[int]) -> np.ndarray:
    if x.ndim == 4:
        return x
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _frontier(q_len: int, kv_len: int, offset, left: int, right: int, causal: bool) -> Optional[np.ndarray]:
    """The keys each query may attend by position ([q, kv] or [B, 1, q, kv] booleans), or None for all."""
    if not causal and left < 0 and right < 0:
        return None
    i = np.arange(q_len).reshape(q_len, 1)
    j = np.arange(kv_len).reshape(1, kv_len)
    pos = i + (np.reshape(offset, (-1, 1, 1)) if np.ndim(offset) else int(offset))
    allowed = np.ones(np.broadcast_shapes(pos.shape, j.shape), bool)
    if causal:
        allowed &= j <= pos
    if left >= 0:
        allowed &= pos - j <= left
    if right >= 0:
        allowed &= j - pos <= right
    return allowed.reshape(-1, 1, q_len, kv_len) if np.ndim(offset) else allowed


@op("Attention",
    inputs=[In("Q", FLOAT, rank=(3, 4)), In("K", FLOAT, rank=(3, 4)), In("V", FLOAT, rank=(3, 4)),
            In("attn_mask", _MASK, optional=True), In("past_key", FLOAT, optional=True, rank=4),
            In("past_value", FLOAT, optional=True, rank=4),
            In("nonpad_kv_seqlen", {DType.INT64}, optional=True, rank=1)],
    outputs=["Y", Out("present_key", FLOAT, optional=True), Out("present_value", FLOAT, optional=True),
             Out("qk_matmul_output", FLOAT, optional=True)],
    attrs=[Attr("is_causal", AttrKind.INT, 0), Attr("kv_num_heads", AttrKind.INT, None),
           Attr("q_num_heads", AttrKind.INT, None), Attr("qk_matmul_output_mode", AttrKind.INT, 0),
           Attr("scale", AttrKind.FLOAT, None), Attr("softcap", AttrKind.FLOAT, 0.0),
           Attr("softmax_precision", AttrKind.INT, None), Attr("left_window_size", AttrKind.INT, -1),
           Attr("right_window_size", AttrKind.INT, -1)],
    infer=_infer_attention)
def attention(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *, is_causal=0,
              kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None, softcap=0.0,
              softmax_precision=None, left_window_size=-1, right_window_size=-1):
    """Scaled dot-product attention (module docstring)."""
    out_dt = q.dtype
    # float16 computes in float16, as ONNX's reference (which makes the suite's expected values) does: in
    # float32 a float16 causal case came out 1 float16 ulp away from them. bfloat16 widens to float32.
    acc = out_dt if out_dt == np.float16 else compute_dtype(out_dt)
    three_d = q.ndim == 3
    q4 = _to_4d(q, q_num_heads).astype(acc)
    k4 = _to_4d(k, kv_num_heads).astype(acc)
    v4 = _to_4d(v, kv_num_heads).astype(acc)
    if past_key is not None:
        k4 = np.concatenate([past_key.astype(acc), k4], axis=2)
        v4 = np.concatenate([past_value.astype(acc), v4], axis=2)
    present_key, present_value = k4.astype(out_dt), v4.astype(out_dt)
    b, hq, sq, d = q4.shape
    total = k4.shape[2]
    # The scale is split as in ONNX's definition: sqrt(scale) on Q and on K, rounded to the input type.
    root = acc.type(np.asarray(np.sqrt(1.0 / np.sqrt(d) if scale is None else scale)).astype(out_dt))

    bias = np.zeros((sq, total), acc)
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == np.bool_ else attn_mask.astype(acc)
        pad = total - mask.shape[-1]
        if pad > 0:
            fill = False if mask.dtype == np.bool_ else -np.inf
            mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], constant_values=fill)
        if mask.dtype == np.bool_:
            mask = np.where(mask, acc.type(0), acc.type(-np.inf))
        bias = bias + mask
    if past_key is None and nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.reshape(-1).astype(np.int64) - sq
    else:
        offset = past_key.shape[2] if past_key is not None else 0
    allowed = _frontier(sq, total, offset, left_window_size, right_window_size, bool(is_causal))
    if allowed is not None:
        bias = bias + np.where(allowed, acc.type(0), acc.type(-np.inf))
    if nonpad_kv_seqlen is not None:
        valid = np.arange(total) < nonpad_kv_seqlen.reshape(-1, 1)
        bias = bias + np.where(valid, acc.type(0), acc.type(-np.inf)).reshape(-1, 1, 1, total)

    hk = k4.shape[1]
    if hq != hk:
        k4 = np.repeat(k4, hq // hk, axis=1)
        v4 = np.repeat(v4, hq // hk, axis=1)
    scores = np.matmul(q4 * root, np.swapaxes(k4 * root, -1, -2))
    qk = scores
    if softcap > 0:  # onnx.reference's qk_matmul_output then holds the capped scores in modes 0 and 1 alike
        scores = qk = np.tanh(scores / softcap) * softcap
    with np.errstate(invalid="ignore"):  # inf + -inf in a masked score: the row guard below decides
        biased = scores + bias
    if qk_matmul_output_mode == 2:
        qk = biased
    soft_dt = acc if softmax_precision is None else compute_dtype(DType(softmax_precision).numpy)
    s = biased.astype(soft_dt)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isneginf(top) | np.isnan(top), soft_dt.type(0), top)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(s - top)
    total_e = e.sum(axis=-1, keepdims=True)
    probs = e / np.where(total_e == 0, soft_dt.type(1), total_e)
    # A query whose every key is masked (by the bias alone, not by its scores) attends nothing: zeros.
    dead = np.isneginf(np.max(np.broadcast_to(bias, biased.shape), axis=-1, keepdims=True))
    probs = np.where(dead, soft_dt.type(0), probs)
    if qk_matmul_output_mode == 3:
        qk = probs
    probs = probs.astype(out_dt).astype(acc)  # ONNX casts the probabilities back to the input type
    y = np.matmul(probs, v4)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, sq, -1)
    return (y.astype(out_dt), present_key, present_value,
            np.broadcast_to(qk, (b, hq, sq, total)).astype(out_dt))
