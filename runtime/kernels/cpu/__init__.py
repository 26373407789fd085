"""CPU kernels in numpy, chosen per node at load time.

``KERNELS[(domain, op)]`` is a factory ``(node, attrs) -> kernel``: it decodes attributes and
picks a code path once, and returns a function of the input arrays. An op with no fast kernel
runs its IR reference implementation (the op's definition), so every registered op runs; fast
kernels are tested against the references by one conformance suite.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from kiln.ir.graph import Node

Factory = Callable[[Node, dict], Callable[..., Any]]
KERNELS: dict[tuple[str, str], Factory] = {}


def kernel(*ops: str, domain: str = "") -> Callable[[Factory], Factory]:
    """Register the decorated factory as the CPU kernel of ``ops``."""

    def deco(factory: Factory) -> Factory:
        for op in ops:
            if (domain, op) in KERNELS:
                raise ValueError(f"CPU kernel for {op} registered twice")
            KERNELS[(domain, op)] = factory
        return factory

    return deco


def reference_kernel(node: Node, attrs: dict) -> Callable[..., Any]:
    """The op's reference implementation with its attributes bound."""
    ref = functools.partial(node.schema.reference, **attrs)
    if len(node.outputs) == 1:
        def single(*args: Any) -> Any:
            out = ref(*args)
            return out[0] if isinstance(out, (tuple, list)) else out
        return single
    return ref


def choose(node: Node, attrs: dict) -> Callable[..., Any]:
    factory = KERNELS.get((node.domain, node.op))
    if factory is None:
        return reference_kernel(node, attrs)
    return factory(node, attrs)


from kiln.runtime.kernels.cpu import activation, elementwise, fused, linalg, nn, norm, pool, shape  # noqa: E402,F401  (registers kernels)


@kernel("Resize")
def _resize(node: Node, attrs: dict) -> Callable[..., Any]:
    """Resize's kernel (runtime/kernels/cpu/resize.py, issue 15), imported when a model has one: its module and the
    IR's resize plans were ~3 ms of every fresh process's start-up."""
    from kiln.runtime.kernels.cpu.resize import resize
    return resize(node, attrs)
