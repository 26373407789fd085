"""LayerNormalization, Softmax, LogSoftmax, BatchNormalization (inference), float32.

The normalized tensor is computed in the output view; the per-row statistics (mean, variance,
max, sum: keepdims arrays a row-count in size) are small temporaries, written into the optional
Mean/InvStdDev outputs when the graph asks for them.
"""
from __future__ import annotations

import numpy as np


def layer_normalization(ins, outs, attrs):
    x, scale = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    y = outs[0]
    axes = tuple(range(attrs.get("axis", -1) % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    np.subtract(x, mean, out=y)
    var = np.square(y).mean(axis=axes, keepdims=True)  # temporary: the squares (x-sized)
    var += np.float32(attrs.get("epsilon", 1e-5))
    inv_std = np.reciprocal(np.sqrt(var, out=var), out=var)
    y *= inv_std
    y *= scale
    if b is not None:
        y += b
    for out, stat in zip(outs[1:], (mean, inv_std)):
        if out is not None:
            np.copyto(out, stat, casting="unsafe")


def softmax(ins, outs, attrs):
    x, y = ins[0], outs[0]
    axis = attrs.get("axis", -1)
    np.subtract(x, x.max(axis=axis, keepdims=True), out=y)
    np.exp(y, out=y)
    y /= y.sum(axis=axis, keepdims=True)


def log_softmax(ins, outs, attrs):
    x, y = ins[0], outs[0]
    axis = attrs.get("axis", -1)
    np.subtract(x, x.max(axis=axis, keepdims=True), out=y)
    y -= np.log(np.exp(y).sum(axis=axis, keepdims=True))  # temporary: the exponentials


def batch_normalization(ins, outs, attrs):
    x, scale, bias, mean, var = ins[:5]
    y = outs[0]
    shape = (1, -1) + (1,) * (x.ndim - 2)
    k = scale / np.sqrt(var + np.float32(attrs.get("epsilon", 1e-5)))  # per-channel temporaries
    np.subtract(x, mean.reshape(shape), out=y)
    y *= k.reshape(shape)
    y += bias.reshape(shape)


KERNELS = {"LayerNormalization": layer_normalization, "Softmax": softmax, "LogSoftmax": log_softmax,
           "BatchNormalization": batch_normalization}
SUPPORTS = {op: {"float32"} for op in KERNELS}
