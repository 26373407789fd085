"""Losses ONNX models carry: SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss.

Both take scores/log-probabilities ``[N, C, d1..dk]`` (k >= 0), integer class labels ``[N, d1..dk]`` and an
optional per-class ``weight`` ``[C]``. The per-element loss is ``-input[n, label, d...] * weight[label]`` (weight 1
without ``weight``), 0 where the label equals ``ignore_index`` (an attribute with no default: absent, no label is
ignored). ``reduction`` 'none' gives that tensor (the labels' shape), 'sum' its sum, and 'mean' (the default) its
sum divided by the sum of the weights it used (without ``weight``: the number of labels not ignored), so a mean
over labels that are all ignored is 0/0 = NaN, as in ONNX's definition and PyTorch. A label outside [0, C) that
is not ``ignore_index`` has no defined result: the reference refuses it.

SoftmaxCrossEntropyLoss applies LogSoftmax over the class axis (1) first and can also return it (the optional
``log_prob`` output, the scores' shape). Narrow floats compute in float32 and round once, on the way out.

kiln implements SoftmaxCrossEntropyLoss-13 (12 lacks only bfloat16) and NegativeLogLikelihoodLoss-13 (22 adds
only bfloat16, imported as it is).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.ops._common import FLOAT, INDEX, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op
from kiln.ir.types import TensorType, dims_compatible, merge_dim

REDUCTIONS = ("none", "sum", "mean")

_ATTRS = [Attr("ignore_index", AttrKind.INT, None), Attr("reduction", AttrKind.STRING, "mean")]


# --------------------------------------------------------------------------- inference


def _infer_loss(ctx: InferContext, what: str, label_name: str, weight_name: str) -> TensorType:
    """The loss output's type; checks the reduction, the dtypes and the [N, C, d...] / [N, d...] / [C] shapes."""
    reduction = ctx.attrs["reduction"]
    if reduction not in REDUCTIONS:
        ctx.fail(f"reduction must be 'none', 'sum' or 'mean', not {reduction!r}")
    x, labels = ctx.input(0), ctx.input(1)
    dt = x.dtype
    if ctx.has_input(2) and ctx.input(2).dtype is not dt:
        ctx.fail(f"{weight_name} is {ctx.input(2).dtype} but {what} is {dt}; they must match")
    xs, ls = x.shape, labels.shape
    if xs is not None and len(xs) < 2:
        ctx.fail(f"{what} must have rank >= 2 ([N, C, d1..dk]), got shape {list(xs)}")
    if ls is not None and len(ls) < 1:
        ctx.fail(f"{label_name} must have rank >= 1 ([N, d1..dk]), got a scalar")
    out_shape = ls
    if xs is not None and ls is not None:
        want = (xs[0],) + tuple(xs[2:])  # the scores' shape without the class axis
        if len(ls) != len(want) or not all(dims_compatible(a, b) for a, b in zip(ls, want)):
            ctx.fail(f"{label_name} of shape {list(ls)} does not match {what} of shape {list(xs)}: "
                     f"{label_name} must be {what}'s shape without dim 1, {list(want)}")
        out_shape = tuple(merge_dim(a, b) for a, b in zip(ls, want))
    elif xs is not None:
        out_shape = (xs[0],) + tuple(xs[2:])
    if ctx.has_input(2):
        ws = ctx.input(2).shape
        classes = xs[1] if xs is not None else None
        if ws is not None and (len(ws) != 1 or not dims_compatible(ws[0], classes)):
            ctx.fail(f"{weight_name} must have shape [{classes if classes is not None else 'C'}] (one weight per "
                     f"class), got {list(ws)}")
    if reduction != "none":
        return TensorType(dt, ())
    return TensorType(dt, out_shape)


def infer_softmax_cross_entropy(ctx: InferContext) -> list:
    if ctx.num_outputs > 2:
        ctx.fail(f"SoftmaxCrossEntropyLoss has 2 outputs (output, log_prob), the node asks for {ctx.num_outputs}")
    loss = _infer_loss(ctx, "scores", "labels", "weights")
    if ctx.num_outputs == 1:
        return [loss]
    return [loss, ctx.input(0)]


def infer_nll(ctx: InferContext) -> TensorType:
    if ctx.num_outputs > 1:
        ctx.fail(f"NegativeLogLikelihoodLoss has 1 output (loss), the node asks for {ctx.num_outputs}")
    return _infer_loss(ctx, "input", "target", "weight")


# --------------------------------------------------------------------------- reference


def _nll(log_p: np.ndarray, target: np.ndarray, weight: Optional[np.ndarray], reduction: str,
         ignore_index: Optional[int], out_dtype) -> np.ndarray:
    """The (reduced) negative log likelihood of ``target`` under ``log_p`` [N, C, d...] (in its compute dtype)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', not {reduction!r}")
    if log_p.ndim < 2 or target.shape != (log_p.shape[0],) + log_p.shape[2:]:
        raise ValueError(f"labels of shape {target.shape} do not match input of shape {log_p.shape} "
                         f"(the input's shape without dim 1)")
    acc = log_p.dtype
    classes = log_p.shape[1]
    t = target.astype(np.int64)
    valid = np.ones(t.shape, bool) if ignore_index is None else t != ignore_index
    bad = valid & ((t < 0) | (t >= classes))
    if bad.any():
        raise ValueError(f"label {int(t[bad].reshape(-1)[0])} is outside [0, {classes}) and is not "
                         f"ignore_index ({ignore_index})")
    safe = np.where(valid, t, 0)
    picked = np.take_along_axis(log_p, np.expand_dims(safe, 1), axis=1).squeeze(1)
    w = np.ones(t.shape, acc) if weight is None else weight.astype(acc)[safe]
    w = np.where(valid, w, acc.type(0))
    loss = np.where(valid, -picked * w, acc.type(0))
    if reduction == "none":
        return loss.astype(out_dtype)
    total = loss.sum(dtype=acc)
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):  # every label ignored: 0 / 0 = NaN
            total = total / w.sum(dtype=acc)
    return np.asarray(total, acc).astype(out_dtype)


@op("NegativeLogLikelihoodLoss",
    inputs=[In("input", FLOAT), In("target", INDEX), In("weight", FLOAT, optional=True, rank=1)],
    outputs=["loss"], attrs=_ATTRS, infer=infer_nll)
def negative_log_likelihood_loss(x, target, weight=None, *, ignore_index=None, reduction="mean"):
    """loss[n, d...] = -input[n, target[n, d...], d...] * weight[target[n, d...]], 0 where the target is
    ignore_index; reduced by 'none', 'sum' or 'mean' (sum / sum of the weights used) (module docstring)."""
    return _nll(x.astype(compute_dtype(x.dtype)), target, weight, reduction, ignore_index, x.dtype)


@op("SoftmaxCrossEntropyLoss",
    inputs=[In("scores", FLOAT), In("labels", INDEX), In("weights", FLOAT, optional=True, rank=1)],
    outputs=["output", Out("log_prob", FLOAT, optional=True)], attrs=_ATTRS,
    infer=infer_softmax_cross_entropy)
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None, reduction="mean"):
    """NegativeLogLikelihoodLoss of LogSoftmax(scores, axis=1), which is also returned as ``log_prob``
    (module docstring)."""
    xa = scores.astype(compute_dtype(scores.dtype))
    if xa.ndim < 2:
        raise ValueError(f"scores must have rank >= 2 ([N, C, d1..dk]), got shape {scores.shape}")
    shifted = xa - xa.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = _nll(log_p, labels, weights, reduction, ignore_index, scores.dtype)
    return loss, log_p.astype(scores.dtype)
