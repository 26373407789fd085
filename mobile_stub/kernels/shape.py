"""Data movement: Reshape, Flatten, Squeeze, Unsqueeze, Identity, Transpose, Concat, Split, Slice,
Gather, Expand, Cast, Shape, DequantizeLinear (when pack left one the stub could not fuse).

Every output has its own arena slot (the planner does not alias), so reshapes are one copy into it;
shapes come from the output view itself (static), so shape inputs are not even read. No temporaries.
"""
from __future__ import annotations

import numpy as np

from kiln.numerics import onnx_slice

ALL = {"float32", "int64", "int32", "bool", "int8", "uint8"}


def copy_reshaped(ins, outs, attrs):
    """Reshape / Flatten / Squeeze / Unsqueeze / Identity: the same elements in the output's shape."""
    np.copyto(outs[0], ins[0].reshape(outs[0].shape))


def transpose(ins, outs, attrs):
    x = ins[0]
    np.copyto(outs[0], x.transpose(attrs.get("perm") or tuple(reversed(range(x.ndim)))))


def concat(ins, outs, attrs):
    y = outs[0]
    axis = attrs["axis"] % y.ndim
    at = 0
    for x in ins:
        idx = [slice(None)] * y.ndim
        idx[axis] = slice(at, at + x.shape[axis])
        np.copyto(y[tuple(idx)], x)
        at += x.shape[axis]


def split(ins, outs, attrs):
    x = ins[0]
    axis = attrs.get("axis", 0) % x.ndim
    at = 0
    for y in outs:  # the sizes come from the output views (static shapes), not the split input
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(at, at + y.shape[axis])
        np.copyto(y, x[tuple(idx)])
        at += y.shape[axis]


def slice_(ins, outs, attrs):
    x = ins[0]
    starts, ends = ins[1], ins[2]
    axes = ins[3] if len(ins) > 3 and ins[3] is not None else range(len(starts))
    steps = ins[4] if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        axis = int(a) % x.ndim
        # ONNX's clamping, not Python's: they differ for a negative step from before the front (the op suite
        # on the stub found it: x[-2::-1] of one element is empty in Python, [x[0]] in ONNX).
        idx[axis] = onnx_slice(int(s), int(e), int(st), x.shape[axis])
    np.copyto(outs[0], x[tuple(idx)])


def gather(ins, outs, attrs):
    data, indices = ins
    np.take(data, indices, axis=attrs.get("axis", 0), out=outs[0])


def expand(ins, outs, attrs):
    np.copyto(outs[0], np.broadcast_to(ins[0], outs[0].shape))


def cast(ins, outs, attrs):
    np.copyto(outs[0], ins[0], casting="unsafe")


def shape(ins, outs, attrs):
    dims = ins[0].shape[attrs.get("start", 0):attrs.get("end")]
    outs[0][...] = dims


def dequantize_linear(ins, outs, attrs):
    x, scale = ins[0], ins[1]
    zero = ins[2] if len(ins) > 2 else None
    y = outs[0]
    bshape = [1] * x.ndim
    if scale.ndim == 1 and x.ndim > 0:
        bshape[attrs.get("axis", 1) % x.ndim] = -1
    np.copyto(y, x, casting="unsafe")
    if zero is not None:
        y -= zero.reshape(bshape) if scale.ndim == 1 else zero
    y *= scale.reshape(bshape) if scale.ndim == 1 else scale


KERNELS = {"Reshape": copy_reshaped, "Flatten": copy_reshaped, "Squeeze": copy_reshaped,
           "Unsqueeze": copy_reshaped, "Identity": copy_reshaped, "Transpose": transpose, "Concat": concat,
           "Split": split, "Slice": slice_, "Gather": gather, "Expand": expand, "Cast": cast, "Shape": shape,
           "DequantizeLinear": dequantize_linear}
SUPPORTS = {op: set(ALL) for op in KERNELS}
SUPPORTS["DequantizeLinear"] = {"int8", "uint8", "int32"}
