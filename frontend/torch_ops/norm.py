"""Normalization layers (batch, layer, group, instance, RMS norm, F.normalize, weight norm) and
embeddings.

Traces are inference: batch norm uses its running statistics. Missing affine weights/biases
become ones/zeros constants of the normalized shape (static in every torch layer).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.tracer import kiln_dtype
from kiln.ir.dtypes import DType


def _axes(t, axes) -> object:
    return t.constant(np.array(list(axes), np.int64), "axes")


def _affine(t, x: torch.Tensor, tensor: Optional[torch.Tensor], shape, fill: float):
    """The IR value of an optional weight/bias, or a constant ``fill`` of ``shape`` in x's dtype."""
    dt = kiln_dtype(x.dtype)
    if tensor is not None:
        return t.value(tensor, dt)
    return t.constant(np.full(tuple(shape), fill, dt.numpy), "ones" if fill else "zeros")


def _per_channel(t, v, rank: int):
    """A [C] vector reshaped to [C, 1, ...] so it broadcasts over [N, C, *spatial]."""
    return t.emit("Unsqueeze", v, _axes(t, range(1, rank - 1))) if rank > 2 else v


# ---------------------------------------------------------------------------- batch norm
def _batch_norm(t, input, running_mean, running_var, weight, bias, training, eps, name):
    if training and running_mean is not None:
        raise UnsupportedOpError(
            f"{t.where()}: {name}(training=True) updates running statistics, which inference cannot do; "
            "put the model in eval mode (kiln.trace does so for modules)")
    c = input.shape[1]
    dt = kiln_dtype(input.dtype)
    scale, shift = _affine(t, input, weight, [c], 1.0), _affine(t, input, bias, [c], 0.0)
    if training:
        return _batch_statistics_norm(t, input, scale, shift, eps)
    return t.emit("BatchNormalization", t.value(input), scale, shift, t.value(running_mean, dt),
                  t.value(running_var, dt), epsilon=float(eps))


def _batch_statistics_norm(t, input, scale, shift, eps):
    """BatchNorm without running statistics normalizes with the batch's own (biased) statistics."""
    x = t.value(input)
    axes = _axes(t, [0] + list(range(2, input.dim())))
    mean = t.emit("ReduceMean", x, axes, keepdims=1)
    centered = t.emit("Sub", x, mean)
    var = t.emit("ReduceMean", t.emit("Mul", centered, centered), axes, keepdims=1)
    std = t.emit("Sqrt", t.emit("Add", var, t.scalar(float(eps), kiln_dtype(input.dtype))))
    y = t.emit("Div", centered, std)
    rank = input.dim()
    return t.emit("Add", t.emit("Mul", y, _per_channel(t, scale, rank)), _per_channel(t, shift, rank))


@maps(F.batch_norm)
def batch_norm(t, res, input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    return _batch_norm(t, input, running_mean, running_var, weight, bias, training, eps, "batch_norm")


@maps(torch.batch_norm)
def torch_batch_norm(t, res, input, weight, bias, running_mean, running_var, training, momentum, eps,
                     cudnn_enabled=True):
    return _batch_norm(t, input, running_mean, running_var, weight, bias, training, eps, "torch.batch_norm")


# ---------------------------------------------------------------------------- layer / RMS norm
@maps(F.layer_norm, torch.layer_norm)
def layer_norm(t, res, input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    shape = list(normalized_shape)
    inputs = [t.value(input), _affine(t, input, weight, shape, 1.0)]
    if bias is not None:
        inputs.append(t.value(bias, kiln_dtype(input.dtype)))
    return t.emit("LayerNormalization", *inputs, axis=-len(shape), epsilon=float(eps))


@maps(F.rms_norm, torch.rms_norm)
def rms_norm(t, res, input, normalized_shape, weight=None, eps=None):
    dt = kiln_dtype(input.dtype)
    # torch computes in float32 for narrow floats and rounds once at the end.
    acc = DType.FLOAT32 if dt in (DType.FLOAT16, DType.BFLOAT16) else dt
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    x = t.value(input, acc)
    axes = _axes(t, range(-len(normalized_shape), 0))
    mean_square = t.emit("ReduceMean", t.emit("Mul", x, x), axes, keepdims=1)
    rms = t.emit("Sqrt", t.emit("Add", mean_square, t.scalar(float(eps), acc)))
    y = t.emit("Div", x, rms)
    if acc is not dt:
        y = t.emit("Cast", y, to=dt.value)
    return y if weight is None else t.emit("Mul", y, t.value(weight, dt))


# ---------------------------------------------------------------------------- group / instance norm
@maps(F.group_norm, torch.group_norm)
def group_norm(t, res, input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    dt = kiln_dtype(input.dtype)
    g = int(num_groups)
    # Each (sample, group) is one instance of InstanceNormalization over [N, G, C/G * spatial];
    # Reshape's 0 keeps the (maybe symbolic) batch dim.
    grouped = t.emit("Reshape", t.value(input), t.constant(np.array([0, g, -1], np.int64), "shape"))
    normed = t.emit("InstanceNormalization", grouped, t.constant(np.ones(g, dt.numpy), "ones"),
                    t.constant(np.zeros(g, dt.numpy), "zeros"), epsilon=float(eps))
    y = t.emit("Reshape", normed, t.emit("Shape", t.value(input)))
    rank = input.dim()
    if weight is not None:
        y = t.emit("Mul", y, _per_channel(t, t.value(weight, dt), rank))
    if bias is not None:
        y = t.emit("Add", y, _per_channel(t, t.value(bias, dt), rank))
    return y


def _instance_norm(t, input, running_mean, running_var, weight, bias, use_input_stats, eps):
    if not use_input_stats:
        # Tracked running statistics in eval mode: the same per-channel affine map as batch norm.
        return _batch_norm(t, input, running_mean, running_var, weight, bias, False, eps, "instance_norm")
    c = input.shape[1]
    return t.emit("InstanceNormalization", t.value(input), _affine(t, input, weight, [c], 1.0),
                  _affine(t, input, bias, [c], 0.0), epsilon=float(eps))


@maps(F.instance_norm)
def instance_norm(t, res, input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    return _instance_norm(t, input, running_mean, running_var, weight, bias, use_input_stats, eps)


@maps(torch.instance_norm)
def torch_instance_norm(t, res, input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                        cudnn_enabled=True):
    return _instance_norm(t, input, running_mean, running_var, weight, bias, use_input_stats, eps)


# ---------------------------------------------------------------------------- F.normalize
def _norm(t, x, p: float, dim: int):
    axes = _axes(t, [dim])
    if p == 2:
        return t.emit("ReduceL2", x, axes, keepdims=1)
    magnitude = t.emit("Abs", x)
    if p == float("inf"):
        return t.emit("ReduceMax", magnitude, axes, keepdims=1)
    if p == 1:
        return t.emit("ReduceSum", magnitude, axes, keepdims=1)
    dt = x.type.dtype
    total = t.emit("ReduceSum", t.emit("Pow", magnitude, t.scalar(float(p), dt)), axes, keepdims=1)
    return t.emit("Pow", total, t.scalar(1.0 / p, dt))


@maps(F.normalize)
def normalize(t, res, input, p=2.0, dim=1, eps=1e-12, out=None):
    if p <= 0:
        raise UnsupportedOpError(f"{t.where()}: F.normalize(p={p}) is not supported (p must be > 0)")
    x = t.value(input)
    denom = t.emit("Max", _norm(t, x, float(p), dim), t.scalar(float(eps), x.type.dtype))
    return t.emit("Div", x, denom)


@maps(torch._weight_norm)
def weight_norm(t, res, v, g, dim=0):
    """nn.utils.weight_norm / parametrizations.weight_norm: v * g / ||v||, the norm over every dim
    but ``dim`` (over all of v when dim is -1), as torch's norm_except_dim."""
    x = t.value(v)
    axes = list(range(v.dim())) if dim == -1 else [i for i in range(v.dim()) if i != dim % v.dim()]
    norm = t.emit("ReduceL2", x, _axes(t, axes), keepdims=1) if axes else t.emit("Abs", x)
    return t.emit("Mul", x, t.emit("Div", t.value(g), norm))


# ---------------------------------------------------------------------------- embeddings
def _embedding(t, weight, indices, max_norm=None):
    if max_norm is not None:
        raise UnsupportedOpError(f"{t.where()}: embedding(max_norm={max_norm}) is not supported: it rescales "
                                 "the weight rows in place as they are looked up")
    # padding_idx only changes gradients; at inference every row is a plain lookup.
    return t.emit("Gather", t.value(weight), t.value(indices), axis=0)


@maps(F.embedding)
def embedding(t, res, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    return _embedding(t, weight, input, max_norm)


@maps(torch.embedding)
def torch_embedding(t, res, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _embedding(t, weight, indices)
