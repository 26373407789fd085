"""Broadcasting binary and unary ops: each is one numpy ufunc call with ``out=`` the arena view.

Float32 throughout, int64 too for the arithmetic a static graph can still hold (index math that
did not fold). Where writes ``y`` in two masked copies, no temporary.
"""
from __future__ import annotations

import numpy as np


def _binary(ufunc):
    def kernel(ins, outs, attrs):
        ufunc(ins[0], ins[1], out=outs[0])
    kernel.__name__ = ufunc.__name__
    return kernel


def _unary(ufunc):
    def kernel(ins, outs, attrs):
        ufunc(ins[0], out=outs[0])
    kernel.__name__ = ufunc.__name__
    return kernel


def div(ins, outs, attrs):
    a, b, y = ins[0], ins[1], outs[0]
    if y.dtype.kind in "iu":  # ONNX integer Div truncates toward zero
        np.copyto(y, np.trunc(np.true_divide(a, b)), casting="unsafe")  # temporary: the float quotient
    else:
        np.true_divide(a, b, out=y)


def where(ins, outs, attrs):
    cond, a, b = ins
    y = outs[0]
    np.copyto(y, np.broadcast_to(b, y.shape))
    np.copyto(y, np.broadcast_to(a, y.shape), where=np.broadcast_to(cond, y.shape))


def variadic(ufunc):
    def kernel(ins, outs, attrs):
        y = outs[0]
        np.copyto(y, np.broadcast_to(ins[0], y.shape))
        for x in ins[1:]:
            ufunc(y, x, out=y)
    return kernel


KERNELS = {"Add": _binary(np.add), "Sub": _binary(np.subtract), "Mul": _binary(np.multiply), "Div": div,
           "Pow": _binary(np.power), "Max": variadic(np.maximum), "Min": variadic(np.minimum), "Where": where,
           "Neg": _unary(np.negative), "Sqrt": _unary(np.sqrt), "Exp": _unary(np.exp), "Abs": _unary(np.abs),
           "Reciprocal": _unary(np.reciprocal)}
SUPPORTS = {op: {"float32"} for op in KERNELS}
for _op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Abs"):
    SUPPORTS[_op].add("int64")
SUPPORTS["Where"] = {"bool"}  # keyed by the first input: the condition
