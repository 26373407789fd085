"""RotaryEmbedding (ai.onnx opset 23): rotary positional embeddings (RoPE).

X is [B, H, S, D] (4-D) or [B, S, H*D] (3-D, with ``num_heads``). The first ``rotary_embedding_dim`` features of
each head (all D when 0) are rotated pairwise: as two halves (x1 = first half, x2 = second) or, with
``interleaved``, as the even and odd features; each pair becomes (cos x1 - sin x2, sin x1 + cos x2) and goes back
where it came from; the other features pass through. cos/sin are [B, S, rd/2] caches, or, given ``position_ids``
([B, S] int64), [max_position, rd/2] tables that position_ids index (Gather's rule: a negative id counts from the
end). num_heads is ignored on 4-D input, as ONNX's reference ignores it. Narrow floats compute in float32 and
round once.
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, dims_compatible

ROPE_T = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})


def _known(d) -> bool:
    return isinstance(d, int)


def _head_size(ctx: InferContext, shape: tuple):
    """The head size of X (None when not known statically); checks num_heads for 3-D X."""
    if len(shape) == 4:
        return shape[3]
    heads = ctx.attrs["num_heads"]
    if heads is None:
        ctx.fail(f"3-D X ({list(shape)}) needs the num_heads attribute")
    if heads <= 0:
        ctx.fail(f"num_heads must be positive, not {heads}")
    hidden = shape[2]
    if not _known(hidden):
        return None
    if hidden % heads:
        ctx.fail(f"X's hidden size {hidden} is not a multiple of num_heads={heads}")
    return hidden // heads


def _check_dims(ctx: InferContext, what: str, shape: tuple, lead: tuple, half) -> None:
    """shape must be lead + (half,), a 1 also taking a lead dim (numpy broadcasting onto it); None: any size."""
    ok = len(shape) == len(lead) + 1 and dims_compatible(shape[-1], half) and all(
        w is None or d == 1 or dims_compatible(d, w) for d, w in zip(shape, lead))
    if not ok:
        want = ", ".join("?" if w is None else str(w) for w in (*lead, half))
        ctx.fail(f"{what} must have shape [{want}], got {list(shape)}")


def _infer_rotary(ctx: InferContext) -> TensorType:
    x, cos, sin = ctx.input(0), ctx.input(1), ctx.input(2)
    for t, name in ((cos, "cos_cache"), (sin, "sin_cache")):
        if t.dtype is not x.dtype:
            ctx.fail(f"{name} is {t.dtype} but X is {x.dtype}; they must match")
    if ctx.attrs["interleaved"] not in (0, 1):
        ctx.fail(f"interleaved must be 0 or 1, not {ctx.attrs['interleaved']}")
    rd = ctx.attrs["rotary_embedding_dim"]
    if rd < 0 or rd % 2:
        ctx.fail(f"rotary_embedding_dim must be 0 (the whole head) or a positive even number, not {rd}")
    if x.shape is None:
        return x
    if len(x.shape) not in (3, 4):
        ctx.fail(f"X must be 3-D [batch, seq, hidden] or 4-D [batch, heads, seq, head_size], got {list(x.shape)}")
    head = _head_size(ctx, x.shape)
    if _known(head):
        if rd > head:
            ctx.fail(f"rotary_embedding_dim={rd} exceeds the head size {head}")
        if rd == 0 and head % 2:
            ctx.fail(f"the head size {head} is odd: it cannot be rotated whole (set an even rotary_embedding_dim)")
    half = (rd or head) // 2 if _known(rd or head) else None
    batch = x.shape[0]
    seq = x.shape[2] if len(x.shape) == 4 else x.shape[1]
    if ctx.has_input(3):
        pos = ctx.input(3)
        if pos.shape is not None:
            if len(pos.shape) != 2 or not all(d == 1 or dims_compatible(d, w) for d, w in zip(pos.shape, (batch, seq))):
                ctx.fail(f"position_ids must have shape [{batch}, {seq}] (batch, sequence), got {list(pos.shape)}")
        for t, name in ((cos, "cos_cache"), (sin, "sin_cache")):
            if t.shape is not None:
                _check_dims(ctx, f"{name} (indexed by position_ids)", t.shape, (None,), half)
    else:
        for t, name in ((cos, "cos_cache"), (sin, "sin_cache")):
            if t.shape is not None:
                _check_dims(ctx, f"{name} (without position_ids)", t.shape, (batch, seq), half)
    return x


def _gather(cache: np.ndarray, position_ids: np.ndarray, name: str) -> np.ndarray:
    n = cache.shape[0]
    if position_ids.size and (position_ids.min() < -n or position_ids.max() >= n):
        raise ValueError(f"RotaryEmbedding: position_ids hold {int(position_ids.min())}..{int(position_ids.max())}, "
                         f"outside {name}'s {n} positions")
    return cache[position_ids]


@op("RotaryEmbedding",
    inputs=[In("X", ROPE_T, rank=(3, 4)), In("cos_cache", ROPE_T, rank=(2, 3)), In("sin_cache", ROPE_T, rank=(2, 3)),
            In("position_ids", {DType.INT64}, optional=True, rank=2)],
    outputs=["Y"],
    attrs=[Attr("interleaved", AttrKind.INT, 0), Attr("num_heads", AttrKind.INT, None),
           Attr("rotary_embedding_dim", AttrKind.INT, 0)],
    infer=_infer_rotary)
def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=None,
                     rotary_embedding_dim=0):
    """Rotary positional embedding (module docstring)."""
    acc = compute_dtype(x.dtype)
    if x.ndim == 4:
        x4 = np.transpose(x, (0, 2, 1, 3))  # [B, S, H, D]
    else:
        b, s, hidden = x.shape
        x4 = x.reshape(b, s, num_heads, hidden // num_heads)
    x4 = x4.astype(acc)
    rd = rotary_embedding_dim or x4.shape[3]
    if position_ids is not None:
        cos_cache = _gather(cos_cache, position_ids, "cos_cache")
        sin_cache = _gather(sin_cache, position_ids, "sin_cache")
    if cos_cache.shape[-1] != rd // 2 or sin_cache.shape[-1] != rd // 2:
        raise ValueError(f"RotaryEmbedding: the caches' last dims ({cos_cache.shape[-1]}, {sin_cache.shape[-1]}) "
                         f"must be rotary_embedding_dim/2 = {rd // 2}")
    cos = cos_cache.astype(acc)[:, :, None, :]  # [B, S, 1, rd/2]
    sin = sin_cache.astype(acc)[:, :, None, :]
    rot = x4[..., :rd]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :rd // 2], rot[..., rd // 2:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    out = x4.copy()
    if interleaved:
        out[..., 0:rd:2] = real
        out[..., 1:rd:2] = imag
    else:
        out[..., :rd // 2] = real
        out[..., rd // 2:rd] = imag
    if x.ndim == 4:
        out = np.transpose(out, (0, 2, 1, 3))
    return np.ascontiguousarray(out.reshape(x.shape)).astype(x.dtype)
