"""Activation functions (ONNX opset-18 semantics, plus Gelu from ONNX opset 20, Swish from 24 and SwiGLU
from 28).

Float formulas are evaluated in float64 and rounded once to the input dtype (see
:func:`kiln.ir.ops.elementwise.float_map`), written in forms that cannot overflow
(``logaddexp`` for softplus, ``expm1`` for the exponential linear units).
"""
from __future__ import annotations

import math

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, NUMERIC, SIGNED_NUMERIC, infer_same
from kiln.ir.ops.elementwise import erf64, float_map, sigmoid64
from kiln.ir.ops.normalization import infer_softmax
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType, dims_compatible, merge_dim, normalize_axis

# ONNX Selu defaults: the constants of Klambauer et al. rounded to float32.
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875
PRELU_TYPES = FLOAT | {DType.INT32, DType.INT64, DType.UINT32, DType.UINT64}
GELU_APPROXIMATIONS = ("none", "tanh")


@op("Relu", traits=("elementwise",), inputs=[In("X", SIGNED_NUMERIC)], outputs=["Y"], infer=infer_same)
def relu(x):
    return np.maximum(x, x.dtype.type(0))


@op("LeakyRelu", traits=("elementwise",),
    inputs=[In("X", FLOAT)], outputs=["Y"], attrs=[Attr("alpha", AttrKind.FLOAT, 0.01)],
    infer=infer_same)
def leaky_relu(x, alpha=0.01):
    return float_map(lambda v: np.where(v >= 0, v, alpha * v), x)


@op("Elu", traits=("elementwise",),
    inputs=[In("X", FLOAT)], outputs=["Y"], attrs=[Attr("alpha", AttrKind.FLOAT, 1.0)], infer=infer_same)
def elu(x, alpha=1.0):
    return float_map(lambda v: np.where(v >= 0, v, alpha * np.expm1(v)), x)


@op("Selu", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, SELU_ALPHA), Attr("gamma", AttrKind.FLOAT, SELU_GAMMA)], infer=infer_same)
def selu(x, alpha=SELU_ALPHA, gamma=SELU_GAMMA):
    return float_map(lambda v: gamma * np.where(v > 0, v, alpha * np.expm1(v)), x)


def _infer_gelu(ctx: InferContext) -> TensorType:
    if ctx.attrs["approximate"] not in GELU_APPROXIMATIONS:
        ctx.fail(f"approximate must be one of {GELU_APPROXIMATIONS}, not {ctx.attrs['approximate']!r}")
    return ctx.input(0)


def _gelu64(v: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)
        return 0.5 * v * (1.0 + np.tanh(inner))
    if approximate == "none":
        return 0.5 * v * (1.0 + erf64(v / math.sqrt(2.0)))
    raise ValueError(f"Gelu approximate must be one of {GELU_APPROXIMATIONS}, not {approximate!r}")


# Gelu is an ONNX opset-20 op. kiln registers it in its own opset (with opset-20 semantics)
# because exported transformers use it, and a fused Gelu beats its five-op Erf expansion.
@op("Gelu", traits=("elementwise",),
    inputs=[In("X", FLOAT)], outputs=["Y"], attrs=[Attr("approximate", AttrKind.STRING, "none")],
    infer=_infer_gelu)
def gelu(x, approximate="none"):
    """Gaussian error linear unit: x * Phi(x), exact (erf) or with the tanh approximation."""
    return float_map(lambda v: _gelu64(v, approximate), x)


def _hard_sigmoid64(v: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return np.clip(alpha * v + beta, 0.0, 1.0)


@op("HardSigmoid", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, 0.2), Attr("beta", AttrKind.FLOAT, 0.5)], infer=infer_same)
def hard_sigmoid(x, alpha=0.2, beta=0.5):
    return float_map(lambda v: _hard_sigmoid64(v, alpha, beta), x)


@op("HardSwish", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def hard_swish(x):
    """x * HardSigmoid(x) with alpha = 1/6, beta = 0.5."""
    return float_map(lambda v: v * _hard_sigmoid64(v, 1.0 / 6.0, 0.5), x)


def _softplus64(v: np.ndarray) -> np.ndarray:
    # log(1 + exp(v)) without overflow for large v.
    return np.logaddexp(0.0, v)


@op("Softplus", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def softplus(x):
    return float_map(_softplus64, x)


@op("Softsign", traits=("elementwise",), inputs=[In("input", FLOAT)], outputs=["output"], infer=infer_same)
def softsign(x):
    return float_map(lambda v: v / (1.0 + np.abs(v)), x)


@op("Mish", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"], infer=infer_same)
def mish(x):
    return float_map(lambda v: v * np.tanh(_softplus64(v)), x)


def _infer_prelu(ctx: InferContext) -> TensorType:
    """Output has X's type; slope must broadcast *to* X (unidirectionally)."""
    x, slope = ctx.input(0), ctx.input(1)
    if slope.dtype is not x.dtype:
        ctx.fail(f"slope is {slope.dtype} but X is {x.dtype}")
    if x.shape is None or slope.shape is None:
        return x
    if len(slope.shape) > len(x.shape):
        ctx.fail(f"slope {slope} has a higher rank than X {x}")
    padded = (1,) * (len(x.shape) - len(slope.shape)) + slope.shape
    out = []
    for xd, sd in zip(x.shape, padded):
        if sd != 1 and not dims_compatible(xd, sd):
            ctx.fail(f"slope {slope} does not broadcast to X {x}")
        out.append(xd if sd == 1 else merge_dim(xd, sd))
    return TensorType(x.dtype, out)


@op("PRelu", traits=("elementwise",),
    inputs=[In("X", PRELU_TYPES), In("slope", PRELU_TYPES)], outputs=["Y"], infer=_infer_prelu)
def prelu(x, slope):
    """x where x >= 0, slope * x elsewhere; slope broadcasts to x's shape."""
    if x.dtype.kind in "iu":
        return np.where(x < 0, x * slope, x).astype(x.dtype)
    return float_map(lambda v, s: np.where(v < 0, s * v, v), x, slope)


@op("Celu", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, 1.0)], infer=infer_same)
def celu(x, alpha=1.0):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    return float_map(lambda v: np.maximum(v, 0.0) + np.minimum(0.0, alpha * np.expm1(v / alpha)), x)


@op("ThresholdedRelu", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, 1.0)], infer=infer_same)
def thresholded_relu(x, alpha=1.0):
    """x where x > alpha, else 0."""
    return np.where(x > x.dtype.type(alpha), x, x.dtype.type(0))


@op("Shrink", traits=("elementwise",), inputs=[In("input", NUMERIC)], outputs=["output"],
    attrs=[Attr("lambd", AttrKind.FLOAT, 0.5), Attr("bias", AttrKind.FLOAT, 0.0)], infer=infer_same)
def shrink(x, lambd=0.5, bias=0.0):
    """x + bias below -lambd, x - bias above lambd, 0 between (computed in float64, cast back)."""
    v = x.astype(np.float64)
    return np.where(v < -lambd, v + bias, np.where(v > lambd, v - bias, 0.0)).astype(x.dtype)


@op("Hardmax", inputs=[In("input", FLOAT)], outputs=["output"], attrs=[Attr("axis", AttrKind.INT, -1)],
    infer=infer_softmax)
def hardmax(x, *, axis=-1):
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    ax = normalize_axis(axis, x.ndim)
    out = np.zeros_like(x)
    if x.size:
        np.put_along_axis(out, np.expand_dims(np.argmax(x, axis=ax), ax), 1, axis=ax)
    return out


def _alpha_as(alpha: float, dt: np.dtype) -> float:
    """Swish's ``alpha`` as its ONNX function body uses it: the float attribute (float32) cast to X's type
    (``CastLike``), then widened for the float64 math."""
    return float(np.asarray(np.float32(alpha)).astype(dt))


# Swish (ai.onnx 24) and SwiGLU (ai.onnx 28) are newer than the opsets kiln writes: the ONNX export spells them
# with Sigmoid and Mul (kiln.serializer.onnx).
@op("Swish", traits=("elementwise",), inputs=[In("X", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, 1.0)], infer=infer_same)
def swish(x, alpha=1.0):
    """x * Sigmoid(alpha * x), alpha cast to X's type as the function body does; one rounding at the end."""
    a = _alpha_as(alpha, x.dtype)
    return float_map(lambda v: v * sigmoid64(a * v), x)


def _infer_swiglu(ctx: InferContext) -> TensorType:
    """A and B of one float type and one shape (SwiGLU does not broadcast); Y is that type."""
    a, b = ctx.input(0), ctx.input(1)
    if b.dtype is not a.dtype:
        ctx.fail(f"B is {b.dtype} but A is {a.dtype}; SwiGLU takes one type for both")
    if a.shape is None or b.shape is None:
        return TensorType(a.dtype, a.shape if a.shape is not None else b.shape)
    if len(a.shape) != len(b.shape) or not all(dims_compatible(p, q) for p, q in zip(a.shape, b.shape)):
        ctx.fail(f"A {list(a.shape)} and B {list(b.shape)} must have the same shape (SwiGLU does not broadcast)")
    return TensorType(a.dtype, tuple(merge_dim(p, q) for p, q in zip(a.shape, b.shape)))


@op("SwiGLU", traits=("elementwise",), inputs=[In("A", FLOAT), In("B", FLOAT)], outputs=["Y"],
    attrs=[Attr("alpha", AttrKind.FLOAT, 1.0)], infer=_infer_swiglu)
def swiglu(a, b, alpha=1.0):
    """Swish_alpha(A) * B (the gate A, the value B, of one shape); one rounding at the end."""
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU takes A and B of one shape (no broadcasting), got {a.shape} and {b.shape}")
    k = _alpha_as(alpha, a.dtype)
    return float_map(lambda u, v: u * sigmoid64(k * u) * v, a, b)
