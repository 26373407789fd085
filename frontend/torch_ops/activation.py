"""Activations, softmax and dropout (relu is in core.py; tanh and sigmoid in elementwise.py).

Torch's parameters map onto IR attributes where the IR op has them (LeakyRelu alpha, Gelu
approximate); otherwise the handler builds the torch formula from simpler ops (softplus with
beta/threshold, celu, relu6, silu).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedOpError
from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.elementwise import aliases, res_dtype
from kiln.ir.dtypes import DType

T = torch.Tensor


def _x(t, res, input):
    """The input in the result's dtype (what torch computes in)."""
    return t.value(input, res_dtype(res))


# ---------------------------------------------------------------------------- piecewise linear
def _clip(t, res, input, lo, hi):
    x = _x(t, res, input)
    dt = x.type.dtype
    return t.emit("Clip", x, t.scalar(lo, dt), t.scalar(hi, dt))


@maps(F.relu6)
def relu6(t, res, input, inplace=False):
    return _clip(t, res, input, 0, 6)


@maps(F.hardtanh, F.hardtanh_)
def hardtanh(t, res, input, min_val=-1.0, max_val=1.0, inplace=False):
    return _clip(t, res, input, min_val, max_val)


@maps(F.leaky_relu, F.leaky_relu_)
def leaky_relu(t, res, input, negative_slope=0.01, inplace=False):
    return t.emit("LeakyRelu", _x(t, res, input), alpha=float(negative_slope))


@maps(*aliases("rrelu", functional=True))
def rrelu(t, res, input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    if training:
        raise UnsupportedOpError(f"{t.where()}: rrelu in training mode (random slopes) is not supported; "
                                 "trace the model in eval mode")
    # In eval, rrelu is a leaky relu with the mean slope.
    return t.emit("LeakyRelu", _x(t, res, input), alpha=(lower + upper) / 2)


@maps(*aliases("threshold", F.threshold, F.threshold_))
def threshold(t, res, input, threshold, value, inplace=False):
    x = _x(t, res, input)
    dt = x.type.dtype
    return t.emit("Where", t.emit("Greater", x, t.scalar(threshold, dt)), x, t.scalar(value, dt))


@maps(*aliases("prelu"))
def prelu(t, res, input, weight):
    """torch applies one slope per channel (dim 1); IR PRelu broadcasts numpy-style from the
    right, so a [C] weight becomes [C, 1, ...]."""
    x, w = _x(t, res, input), t.value(weight, res_dtype(res))
    if weight.numel() != 1 and input.dim() > 2:
        shape = t.constant(np.array([weight.numel()] + [1] * (input.dim() - 2), np.int64), "shape")
        w = t.emit("Reshape", w, shape)
    return t.emit("PRelu", x, w)


# ---------------------------------------------------------------------------- smooth
@maps(F.gelu)
def gelu(t, res, input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise UnsupportedOpError(f"{t.where()}: gelu approximate={approximate!r} is not supported")
    return t.emit("Gelu", _x(t, res, input), approximate=approximate)


@maps(F.silu)
def silu(t, res, input, inplace=False):
    x = _x(t, res, input)
    return t.emit("Mul", x, t.emit("Sigmoid", x))


@maps(F.mish)
def mish(t, res, input, inplace=False):
    return t.emit("Mish", _x(t, res, input))


@maps(F.hardswish)
def hardswish(t, res, input, inplace=False):
    return t.emit("HardSwish", _x(t, res, input))


@maps(F.hardsigmoid)
def hardsigmoid(t, res, input, inplace=False):
    return t.emit("HardSigmoid", _x(t, res, input), alpha=1.0 / 6, beta=0.5)


@maps(F.elu, F.elu_)
def elu(t, res, input, alpha=1.0, inplace=False):
    return t.emit("Elu", _x(t, res, input), alpha=float(alpha))


@maps(*aliases("selu", functional=True))
def selu(t, res, input, inplace=False):
    return t.emit("Selu", _x(t, res, input))


@maps(*aliases("celu", functional=True))
def celu(t, res, input, alpha=1.0, inplace=False):
    """celu(x) = alpha * elu(x / alpha) (with elu's alpha = 1)."""
    x = _x(t, res, input)
    if alpha == 1:
        return t.emit("Elu", x, alpha=1.0)
    a = t.scalar(alpha, x.type.dtype)
    return t.emit("Mul", t.emit("Elu", t.emit("Div", x, a), alpha=1.0), a)


@maps(F.softplus)
def softplus(t, res, input, beta=1.0, threshold=20.0):
    """torch: log(1 + exp(beta*x)) / beta, and x itself where beta*x > threshold."""
    x = _x(t, res, input)
    dt = x.type.dtype
    # With the defaults the linear branch differs from softplus by < exp(-20), below float32
    # resolution there: the plain op is exact enough, and fuses.
    if beta == 1 and threshold >= 20 and dt is not DType.FLOAT64:
        return t.emit("Softplus", x)
    z = x if beta == 1 else t.emit("Mul", x, t.scalar(beta, dt))
    soft = t.emit("Softplus", z)
    soft = soft if beta == 1 else t.emit("Div", soft, t.scalar(beta, dt))
    return t.emit("Where", t.emit("Greater", z, t.scalar(threshold, dt)), x, soft)


@maps(F.logsigmoid)
def logsigmoid(t, res, input):
    """log(sigmoid(x)) = -softplus(-x), which never takes the log of an underflowed 0."""
    x = _x(t, res, input)
    return t.emit("Neg", t.emit("Softplus", t.emit("Neg", x)))


@maps(F.softsign)
def softsign(t, res, input):
    return t.emit("Softsign", _x(t, res, input))


@maps(F.tanh)
def tanh(t, res, input):
    return t.emit("Tanh", _x(t, res, input))


@maps(F.sigmoid)
def sigmoid(t, res, input):
    return t.emit("Sigmoid", _x(t, res, input))


@maps(F.glu)
def glu(t, res, input, dim=-1):
    """a * sigmoid(b) for the two halves of dim."""
    a, b = t.emit("Split", _x(t, res, input), axis=dim, num_outputs=2, outputs=2)
    return t.emit("Mul", a, t.emit("Sigmoid", b))


# ---------------------------------------------------------------------------- softmax
def _legacy_softmax_dim(ndim: int) -> int:
    # What F.softmax picks (with a deprecation warning) when dim is None.
    return 0 if ndim in (0, 1, 3) else 1


def _softmax(t, res, op: str, input, dim, negate: bool = False):
    # dtype=... casts the input first; res already has that dtype.
    x = _x(t, res, input)
    if negate:
        x = t.emit("Neg", x)
    axis = _legacy_softmax_dim(input.dim()) if dim is None else dim
    return t.emit(op, x, axis=axis)


@maps(torch.softmax, T.softmax, torch.special.softmax)
def softmax(t, res, input, dim, dtype=None):
    return _softmax(t, res, "Softmax", input, dim)


@maps(F.softmax)
def f_softmax(t, res, input, dim=None, _stacklevel=3, dtype=None):
    return _softmax(t, res, "Softmax", input, dim)


@maps(F.softmin)
def softmin(t, res, input, dim=None, _stacklevel=3, dtype=None):
    return _softmax(t, res, "Softmax", input, dim, negate=True)


@maps(torch.log_softmax, T.log_softmax, torch.special.log_softmax)
def log_softmax(t, res, input, dim, dtype=None):
    return _softmax(t, res, "LogSoftmax", input, dim)


@maps(F.log_softmax)
def f_log_softmax(t, res, input, dim=None, _stacklevel=3, dtype=None):
    return _softmax(t, res, "LogSoftmax", input, dim)


# ---------------------------------------------------------------------------- dropout
def _dropout(t, name: str, input, p, training):
    """In eval (or with p = 0) every dropout is the identity; in training it is random."""
    if training and p > 0:
        raise UnsupportedOpError(f"{t.where()}: {name} with training=True (random masks) is not supported; "
                                 "trace the model in eval mode (model.eval()) or pass training=False")
    return t.value(input)


@maps(F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)
def dropout(t, res, input, p=0.5, training=True, inplace=False):
    return _dropout(t, "dropout", input, p, training)


@maps(F.alpha_dropout, F.feature_alpha_dropout)
def alpha_dropout(t, res, input, p=0.5, training=False, inplace=False):
    return _dropout(t, "alpha_dropout", input, p, training)


@maps(*aliases("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout"))
def torch_dropout(t, res, input, p, train):
    return _dropout(t, "dropout", input, p, train)
