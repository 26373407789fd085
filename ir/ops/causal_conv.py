"""``CausalConvWithState`` (ai.onnx 27): a stateful causal depthwise 1-D convolution, the short convolution of
Mamba and Gated DeltaNet layers, with the carry state an incremental decode needs.

input [B, C, L] is prefixed with past_state [B, C, k-1] (zeros when omitted) and convolved, channel by channel,
with weight [C, 1, k] (the layout of a depthwise ``Conv(group=C)`` weight) over the valid positions, so that
output[b, c, t] = bias[c] + sum_j weight[c, 0, j] * padded[b, c, t + j] only sees positions up to t; the fused
``activation`` 'silu' (alias 'swish') applies x * Sigmoid(x) to it. present_state [B, C, k-1] is the last k-1
positions of the prefixed sequence (values of past_state, or zeros, when L < k-1), copied exactly.

Types are ONNX's (float, float16, bfloat16) for every tensor. The convolution and the activation compute in
float32 and round once to the input's type (ONNX's reference evaluator rounds the convolution to the input's
type before a float32 activation, i.e. twice for 16-bit types). Vectorized over batch, channels and positions:
one multiply-add per kernel tap.
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import compute_dtype
from kiln.ir.ops.elementwise import sigmoid64
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, dims_compatible, merge_dim

# tensor(float), tensor(float16), tensor(bfloat16): CausalConvWithState-27's T.
CAUSAL_CONV_TYPES = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})
ACTIVATIONS = ("none", "silu", "swish")


def _infer_causal_conv(ctx: InferContext) -> list:
    x, w = ctx.input(0), ctx.input(1)
    bias = ctx.input(2) if ctx.has_input(2) else None
    past = ctx.input(3) if ctx.has_input(3) else None
    if ctx.attrs["activation"] not in ACTIVATIONS:
        ctx.fail(f"activation must be one of {list(ACTIVATIONS)}, not {ctx.attrs['activation']!r}")
    for name, t in (("weight", w), ("bias", bias), ("past_state", past)):
        if t is not None and t.dtype is not x.dtype:
            ctx.fail(f"{name} is {t.dtype} but input is {x.dtype}; CausalConvWithState takes one type for all")
    for name, t, rank, form in (("input", x, 3, "[batch, channels, length]"), ("weight", w, 3, "[channels, 1, k]"),
                                ("bias", bias, 1, "[channels]"),
                                ("past_state", past, 3, "[batch, channels, k - 1]")):
        if t is not None and t.shape is not None and len(t.shape) != rank:
            ctx.fail(f"{name} must have rank {rank} ({form}), got {list(t.shape)}")
    n, c, length = x.shape if x.shape is not None else (None, None, None)
    k1 = None
    if w.shape is not None:
        ch, one, k = w.shape
        if isinstance(one, int) and one != 1:
            ctx.fail(f"weight must be [channels, 1, k] (depthwise), got {list(w.shape)}: dim 1 must be 1")
        if isinstance(k, int):
            if k < 1:
                ctx.fail(f"weight's kernel size (dim 2) must be at least 1, got {list(w.shape)}")
            k1 = k - 1
        if not dims_compatible(c, ch):
            ctx.fail(f"weight {list(w.shape)} has {ch} channels (dim 0) but input {list(x.shape)} has {c}")
        c = merge_dim(c, ch)
    if bias is not None and bias.shape is not None:
        if not dims_compatible(c, bias.shape[0]):
            ctx.fail(f"bias {list(bias.shape)} must have one value per channel ({c})")
        c = merge_dim(c, bias.shape[0])
    if past is not None and past.shape is not None:
        pn, pc, pk = past.shape
        for what, want, got in (("batch (dim 0)", n, pn), ("channels (dim 1)", c, pc), ("k - 1 (dim 2)", k1, pk)):
            if not dims_compatible(want, got):
                ctx.fail(f"past_state {list(past.shape)} must be [batch, channels, k - 1]: its {what} is {got}, "
                         f"not {want}")
        n, c, k1 = merge_dim(n, pn), merge_dim(c, pc), merge_dim(k1, pk)
    return [TensorType(x.dtype, (n, c, length)), TensorType(x.dtype, (n, c, k1))]


@op("CausalConvWithState",
    inputs=[In("input", CAUSAL_CONV_TYPES, rank=3), In("weight", CAUSAL_CONV_TYPES, rank=3),
            In("bias", CAUSAL_CONV_TYPES, optional=True, rank=1),
            In("past_state", CAUSAL_CONV_TYPES, optional=True, rank=3)],
    outputs=["output", "present_state"], attrs=[Attr("activation", AttrKind.STRING, "none")],
    infer=_infer_causal_conv)
def causal_conv_with_state(x, weight, bias=None, past_state=None, *, activation="none"):
    """Depthwise causal convolution of past_state ++ input, optional SiLU, and the new carry state."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"CausalConvWithState activation must be one of {list(ACTIVATIONS)}, not {activation!r}")
    n, c, length = x.shape
    k = weight.shape[2]
    # What inference checks where the dims are known, checked again on the actual shapes (symbolic dims).
    for name, arr, want in (("weight", weight, (c, 1, max(k, 1))), ("bias", bias, (c,)),
                            ("past_state", past_state, (n, c, k - 1))):
        if arr is not None and arr.shape != want:
            raise ValueError(f"CausalConvWithState: {name} has shape {list(arr.shape)}, expected {list(want)} "
                             f"for input {list(x.shape)} and kernel size {k}")
    if past_state is None:
        past_state = np.zeros((n, c, k - 1), x.dtype)
    padded = np.concatenate([past_state, x], axis=2)  # [N, C, L + k - 1]
    acc = compute_dtype(x.dtype)
    wide = padded.astype(acc)
    taps = weight.reshape(c, k).astype(acc)[:, :, None]  # [C, k, 1]
    y = np.zeros((n, c, length), acc) if bias is None else np.broadcast_to(bias.astype(acc)[:, None],
                                                                             (n, c, length)).copy()
    for j in range(k):
        y += taps[:, j] * wide[:, :, j:j + length]
    if activation != "none":
        with np.errstate(over="ignore"):
            y = y * sigmoid64(y)
    return y.astype(x.dtype), padded[:, :, length:].copy()
