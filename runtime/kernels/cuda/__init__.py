"""CUDA kernels (CuPy), chosen per node at load time, like the CPU registry beside this.

``KERNELS[(domain, op)]`` is a factory ``(node, attrs) -> kernel | None``: it decodes attributes
once and returns a function of the input arrays (CuPy arrays; ``None`` for omitted inputs) that
returns CuPy arrays. A factory returns ``None`` where it has no native path for this node (a
dtype the code generator lacks, a weight that is not a constant...); the program then runs the
node's CPU kernel on the host and counts it (``CudaProgram.fallback_ops``), so every op runs and
what is native stays visible.

``HOST_INPUTS[(domain, op)]`` names the inputs a kernel reads as parameters on the host (a
Reshape's target shape, a Slice's starts): the program keeps those values in numpy when it
can (constants, ``Shape`` arithmetic), and a kernel turns them into Python values with
``host``. CuPy is imported only in this package and runtime/cuda_program.py.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.graph import Node

Factory = Callable[[Node, dict], Optional[Callable[..., Any]]]
KERNELS: dict[tuple[str, str], Factory] = {}
HOST_INPUTS: dict[tuple[str, str], tuple] = {}


def kernel(*ops: str, domain: str = "", host: tuple = ()) -> Callable[[Factory], Factory]:
    """Register the decorated factory as the CUDA kernel of ``ops``; ``host``: the input
    positions it reads on the host."""

    def deco(factory: Factory) -> Factory:
        for op in ops:
            if (domain, op) in KERNELS:
                raise ValueError(f"CUDA kernel for {op} registered twice")
            KERNELS[(domain, op)] = factory
            if host:
                HOST_INPUTS[(domain, op)] = tuple(host)
        return factory

    return deco


def choose(node: Node, attrs: dict) -> Optional[Callable[..., Any]]:
    """The node's CUDA kernel, or None when there is no native path for it."""
    factory = KERNELS.get((node.domain, node.op))
    return None if factory is None else factory(node, attrs)


def host_inputs(node: Node) -> tuple:
    return HOST_INPUTS.get((node.domain, node.op), ())


def host(v: Any) -> Optional[np.ndarray]:
    """A parameter input as numpy (a device array is copied back: a synchronization)."""
    if v is None or isinstance(v, np.ndarray):
        return v
    get = getattr(v, "get", None)
    return get() if get is not None else np.asarray(v)


def const_input(node: Node, i: int) -> Optional[np.ndarray]:
    if i >= len(node.inputs) or node.inputs[i] is None:
        return None
    return node.inputs[i].const


def out_dtype(node: Node, i: int = 0) -> Optional[np.dtype]:
    t = node.outputs[i].type
    try:
        return np.dtype(t.dtype.numpy)
    except Exception:  # noqa: BLE001 - no type, or one numpy lacks
        return None


def in_dtype(node: Node, i: int = 0) -> Optional[np.dtype]:
    v = node.inputs[i]
    try:
        return np.dtype(v.type.dtype.numpy)
    except Exception:  # noqa: BLE001
        return None


FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def ignored_inputs(k) -> tuple:
    """Input positions a kernel (or the kernel an adapter wraps, through ``inner``) never reads:
    its ``ignores``, for constants it keeps its own device copy of."""
    while k is not None:
        ignored = getattr(k, "ignores", None)
        if ignored is not None:
            return tuple(ignored)
        k = getattr(k, "inner", None)
    return ()

from kiln.runtime.kernels.cuda import attention, elementwise, epilogue, linalg, nn, shape  # noqa: E402,F401,I001  (registers kernels)
from kiln.runtime.kernels.cuda import resize  # noqa: E402,F401  (Resize, issue 15)
