"""The declared mobile op set: exactly the ``Op:dtype`` pairs the stub's kernels implement.

It is computed, not written down: the union of every kernel family's SUPPORTS table
(mobile_stub/kernels/), so the list ``kiln mobile check`` and ``pack`` test a model against can never
drift from what the stub runtime can run. A key's dtype is that of the node's first present input
(its first output for an op without inputs); for Where that is the condition, for DequantizeLinear
the quantized data. Nothing here imports kiln.ir: nodes are read duck-typed.
"""
from __future__ import annotations

from typing import Iterable

from kiln.mobile_stub import kernels

_KERNELS, SUPPORTED, FAMILY_OF = kernels.load()


def key(op: str, dtype: str) -> str:
    return f"{op}:{dtype}"


def supports(op_key: str) -> bool:
    op, _, dtype = op_key.rpartition(":")
    return dtype in SUPPORTED.get(op, ())


def dtypes_for(op: str) -> set:
    return set(SUPPORTED.get(op, ()))


def declared() -> list[str]:
    """Every supported key, sorted (the op set as a list)."""
    return sorted(key(op, dt) for op, dts in SUPPORTED.items() for dt in dts)


def _dtype_name(dtype) -> str:
    return str(dtype).lower()  # kiln.ir DType prints as "float32"; numpy dtypes too


def node_key(node) -> str:
    """The key of a kiln IR node (duck-typed: .op, .domain, .inputs/.outputs with .type.dtype)."""
    op = f"{node.domain}.{node.op}" if getattr(node, "domain", "") else node.op
    first = next((v for v in node.inputs if v is not None), None) or node.outputs[0]
    return key(op, _dtype_name(first.type.dtype))


def unsupported(keys: Iterable[str]) -> list[str]:
    """The keys of a manifest (or any list of keys) that the mobile op set lacks, sorted, no repeats."""
    return sorted({k for k in keys if not supports(k)})


def families_for(keys: Iterable[str]) -> list[str]:
    """The kernel modules a model with these keys needs (what a bundle must ship), in FAMILIES order."""
    needed = {FAMILY_OF[k.rpartition(":")[0]] for k in keys if supports(k)}
    return [f for f in kernels.FAMILIES if f in needed]
