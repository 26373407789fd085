"""Elementwise kernels: numpy ufuncs called directly (the references add checks and casts)."""
from __future__ import annotations

import numpy as np

from kiln.runtime.kernels.cpu import kernel

_BINARY_FLOAT_SAFE = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


@kernel("Add", "Sub", "Mul")
def binary(node, attrs):
    return _BINARY_FLOAT_SAFE[node.op]


@kernel("Relu")
def relu(node, attrs):
    zero = node.inputs[0].type.dtype.numpy.type(0)

    def run(x):
        return np.maximum(x, zero)
    return run


@kernel("Identity")
def identity(node, attrs):
    return lambda x: x
