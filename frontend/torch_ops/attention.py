"""F.scaled_dot_product_attention as MatMul / Softmax / Where, keeping symbolic dims symbolic.

nn.MultiheadAttention needs no mapping of its own: the tracer decomposes the Python function
F.multi_head_attention_forward into linear, view, transpose, baddbmm/bmm, softmax and this op.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend import compat
from kiln.frontend.symbolic import SymInt
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import dim_of
from kiln.frontend.tracer import kiln_dtype
from kiln.ir.dtypes import DType


def _swap_last(rank: int) -> list:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _scale(t, query: torch.Tensor, scale, dt: DType):
    """The score scale: ``scale`` or 1/sqrt(E), computed in the graph when E is symbolic."""
    if scale is not None:
        return t.scalar(float(scale), dt)
    e = dim_of(t, query, -1)
    if not isinstance(e, SymInt):
        return t.scalar(1.0 / float(np.sqrt(e)), dt)
    return t.emit("Reciprocal", t.emit("Sqrt", t.value(e, dt)))


def causal_mask(t, rows, cols):
    """A bool [rows, cols] mask, True where key j <= query i (torch's top-left aligned tril).

    Built from Range over the (maybe symbolic) sizes so it fits every sequence length."""
    one = t.constant(np.array(1, np.int64), "one")
    zero = t.constant(np.array(0, np.int64), "zero")
    i = t.emit("Range", zero, t.int_value(rows), one)
    j = t.emit("Range", zero, t.int_value(cols), one)
    i = t.emit("Unsqueeze", i, t.constant(np.array([1], np.int64), "axes"))
    j = t.emit("Unsqueeze", j, t.constant(np.array([0], np.int64), "axes"))
    return t.emit("LessOrEqual", j, i)


def _repeat_kv_heads(t, x, key: torch.Tensor, query: torch.Tensor):
    """enable_gqa: each key/value head serves query.size(-3) / key.size(-3) query heads in a row."""
    hq, hkv = query.shape[-3], key.shape[-3]
    if hq == hkv:
        return x
    heads = [dim_of(t, query, -3), dim_of(t, key, -3)]
    if any(isinstance(h, SymInt) for h in heads):
        raise UnsupportedOpError(f"{t.where()}: scaled_dot_product_attention(enable_gqa=True) needs static "
                                 "head counts")
    index = t.constant(np.arange(hq, dtype=np.int64) // (hq // hkv), "heads")
    return t.emit("Gather", x, index, axis=key.dim() - 3)


def _masked(t, scores, attn_mask: torch.Tensor, dt: DType):
    if attn_mask.dtype is torch.bool:
        low = t.scalar(float("-inf"), dt)
        return t.emit("Where", t.value(attn_mask), scores, low)
    return t.emit("Add", scores, t.value(attn_mask, dt))


def _safe_softmax(t, scores, dt: DType):
    """Softmax whose fully masked rows (all -inf) give zeros, not NaN, as torch's does."""
    probs = t.emit("Softmax", scores, axis=-1)
    row_max = t.emit("ReduceMax", scores, t.constant(np.array([-1], np.int64), "axes"), keepdims=1)
    masked_row = t.emit("Equal", row_max, t.scalar(float("-inf"), dt))
    return t.emit("Where", masked_row, t.scalar(0.0, dt), probs)


@maps(F.scaled_dot_product_attention)
def scaled_dot_product_attention(t, res, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    if dropout_p:
        raise UnsupportedOpError(f"{t.where()}: scaled_dot_product_attention(dropout_p={dropout_p}) drops "
                                 "attention weights at random; pass dropout_p=0.0 at inference")
    dt = kiln_dtype(res.dtype)
    q, k, v = t.value(query, dt), t.value(key, dt), t.value(value, dt)
    if enable_gqa:
        k = _repeat_kv_heads(t, k, key, query)
        v = _repeat_kv_heads(t, v, value, query)
    scores = t.emit("MatMul", q, t.emit("Transpose", k, perm=_swap_last(key.dim())))
    scores = t.emit("Mul", scores, _scale(t, query, scale, dt))
    if is_causal:  # never masks a whole row: query i always sees key 0
        mask = causal_mask(t, dim_of(t, query, -2), dim_of(t, key, -2))
        scores = t.emit("Where", mask, scores, t.scalar(float("-inf"), dt))
    if attn_mask is None:
        probs = t.emit("Softmax", scores, axis=-1)
    elif compat.SDPA_MASKED_ROWS_GIVE_ZEROS:
        probs = _safe_softmax(t, _masked(t, scores, attn_mask, dt), dt)
    else:  # torch 2.4: a fully masked row is NaN in eager torch, so it is in the graph too
        probs = t.emit("Softmax", _masked(t, scores, attn_mask, dt), axis=-1)
    return t.emit("MatMul", probs, v)
