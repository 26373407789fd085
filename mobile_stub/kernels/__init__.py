"""The mobile stub's kernels: one small module per op family, each exposing two tables.

    KERNELS  = {"Conv": fn, ...}            fn(ins, outs, attrs) -> None
    SUPPORTS = {"Conv": {"float32"}, ...}   the input dtypes (of the node's first input) it runs

A kernel gets its inputs (numpy arrays, or None for an absent optional input), its outputs as
preallocated views into the stub's one arena, and the node's stored attributes (a dict; absent ones
take their ONNX defaults inside the kernel). It writes its results into ``outs`` and returns None:
the arena plan made at pack time is the only allocation of activations. Where numpy cannot compute
in place (im2col of a strided conv, padding, reductions' keepdims statistics, int8 weights cast to
float32) a kernel uses a temporary and its module says so.

Families are imported by name and a missing module is skipped (``load``): a bundle ships only the
modules its model's manifest needs, and the stub then refuses at load time any op outside them.
"""
from __future__ import annotations

import importlib

FAMILIES = ("conv", "pool", "activation", "elementwise", "linalg", "norm", "shape", "checks", "resize")


def load(families=FAMILIES) -> tuple[dict, dict, dict]:
    """(kernels, supports, family of each op) merged over the family modules that are present."""
    kernels, supports, family_of = {}, {}, {}
    for fam in families:
        name = f"{__name__}.{fam}"
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module is there but something it imports is not
                raise
            continue
        kernels.update(mod.KERNELS)
        for op, dtypes in mod.SUPPORTS.items():
            supports.setdefault(op, set()).update(dtypes)
            family_of[op] = fam
    return kernels, supports, family_of


class QWeight:
    """An int8 weight with per-channel float32 scales, fused from a DequantizeLinear at load time:
    the Conv/Gemm/MatMul kernels take it in place of a float weight and dequantize themselves."""

    __slots__ = ("q", "scale", "axis", "shape", "dtype")

    def __init__(self, q, scale, axis: int):
        self.q, self.scale, self.axis = q, scale, axis % q.ndim
        self.shape, self.dtype = q.shape, scale.dtype

    def dequantize(self):
        """The float weight (a temporary the size of the weight)."""
        shape = [1] * self.q.ndim
        shape[self.axis] = -1
        return self.q.astype(self.scale.dtype) * self.scale.reshape(shape)
