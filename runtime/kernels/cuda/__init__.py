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

Settings (issue 17): a kernel takes the program's ``CudaOptions`` (runtime/cuda_options.py) from
``options()`` while its factory runs: ``choose(node, attrs, options)`` binds them for the factory
and for the factories it calls in turn (FusedEpilogue's anchor, a body run node by node), and a
factory keeps what it needs (the TF32 switch, the conv and attention paths, the cuDNN cap) in
its closure. ``CudaProgram`` also runs each plan under ``bound(options)``, so what is decided per
call (``cublas_matmul``'s handle, for callers that pass no ``tf32``) follows the running program.
The binding is a context variable: per thread, never process-wide.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional

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


_BOUND: contextvars.ContextVar = contextvars.ContextVar("kiln_cuda_options", default=None)


def options():
    """The CudaOptions bound now (the program being loaded or run), else fresh process defaults
    (the environment read now: for kernels used outside a program)."""
    o = _BOUND.get()
    if o is None:
        from kiln.runtime.cuda_options import CudaOptions
        o = CudaOptions()
    return o


@contextlib.contextmanager
def bound(opts) -> Iterator[Any]:
    """Bind ``opts`` (a CudaOptions) for the kernels chosen or run inside the block (this thread only)."""
    token = _BOUND.set(opts)
    try:
        yield opts
    finally:
        _BOUND.reset(token)


def bind(opts):
    """``bound`` without the context manager's cost (per run: CudaProgram): returns the token
    for ``unbind``."""
    return _BOUND.set(opts)


def unbind(token) -> None:
    _BOUND.reset(token)


def choose(node: Node, attrs: dict, options=None) -> Optional[Callable[..., Any]]:
    """The node's CUDA kernel, or None when there is no native path for it. ``options`` (a
    CudaOptions) are bound while the factory runs; None keeps the current binding."""
    factory = KERNELS.get((node.domain, node.op))
    if factory is None:
        return None
    if options is None:
        return factory(node, attrs)
    with bound(options):
        return factory(node, attrs)


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
U16 = np.dtype(np.uint16)


def is_bf16(dt) -> bool:
    """Whether ``dt`` is bfloat16 (ml_dtypes'), which lives on the device as uint16 words (issue 18)."""
    return dt is not None and np.dtype(dt).name == "bfloat16"


def device_array(a):
    """A host array (a constant, a feed) on the device: bfloat16, which CuPy lacks, as its uint16 words.
    Kernels that take bfloat16 know it from the graph's types; float-only kernels read uint16 arrays as
    bfloat16 (their factories admit a node only for float types, and no float op has uint16 operands)."""
    import cupy as cp
    a = np.asarray(a)
    if is_bf16(a.dtype):
        a = a.view(U16)
    return cp.asarray(a)


def host_array(a, dt=None):
    """A device array back on the host, as the graph's ``dt`` (uint16 words of a bfloat16 value become
    ml_dtypes bfloat16)."""
    h = a.get() if hasattr(a, "get") else np.asarray(a)
    if dt is not None and is_bf16(dt) and h.dtype == U16:
        h = h.view(np.dtype(dt))
    return h


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
from kiln.runtime.kernels.cuda import quant  # noqa: E402,F401  (DequantizeLinear, issue 18)
