"""Elementwise ops and FusedElementwise through generated kernels (codegen.py).

A single elementwise node is a body of one op: one code path serves both, so the per-op
conformance tests check every expression the fused kernels use. One-element constant inputs
(``x + 1``) become literals in the source; other constants are operands like any input.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.ir.dtypes import DType
from kiln.runtime.kernels.cuda import codegen, const_input, device_array, kernel
from kiln.runtime.kernels.cuda.codegen import EXPRESSIONS, ElementwiseKernel, Unsupported


def _single(node, attrs) -> Optional[Callable[..., Any]]:
    literals = {}
    for i, v in enumerate(node.inputs):
        c = const_input(node, i)
        if c is not None and c.size == 1 and codegen.supported_dtype(c.dtype):
            literals[i] = c.reshape(-1)[0]
    try:
        body = codegen.body_from_node(node, attrs, literals)
    except Unsupported:
        return None
    ew = ElementwiseKernel(body)
    keep = [i for i, v in enumerate(node.inputs) if v is not None and i not in literals]
    if keep == list(range(len(node.inputs))):
        def run(*args):
            return ew(*args)[0]
    else:
        def run(*args):
            return ew(*[args[i] for i in keep])[0]
    run.launcher = ew
    return run


kernel(*(op for op in EXPRESSIONS if op != "Identity"))(_single)


@kernel("FusedElementwise", domain="kiln")
def fused(node, attrs) -> Optional[Callable[..., Any]]:
    """One generated kernel for the whole body when every output has the full broadcast shape
    (the usual case); otherwise the body's nodes run one by one with their own kernels."""
    body_graph = attrs["body"]
    try:
        body = codegen.body_from_graph(body_graph)
        full = _outputs_full_shape(node, body_graph)
    except Unsupported:
        body, full = None, False
    if body is not None and full:
        ew = ElementwiseKernel(body)
        single = len(node.outputs) == 1

        def run(*args):
            outs = ew(*args)
            return outs[0] if single else tuple(outs)
        run.launcher = ew
        return run
    return _interpret(node, body_graph)


def _outputs_full_shape(node, body_graph) -> bool:
    """Every output's static shape is the broadcast of all operands' (then one launch covers all)."""
    shapes = [v.type.shape if v.type is not None else None for v in node.inputs]
    shapes += [tuple(v.const.shape) for v in body_graph.initializers.values()]
    outs = [v.type.shape if v.type is not None else None for v in node.outputs]
    if any(s is None for s in shapes + outs):
        raise Unsupported("unknown shapes")
    rank = max([len(s) for s in shapes] + [0])
    want = []
    for d in range(rank):
        dims = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0}
        dims.discard(1)
        if len(dims) > 1:
            return False  # symbolic vs static mix: decide at run time by the node-by-node path
        want.append(dims.pop() if dims else 1)
    return all(len(o) == rank and list(o) == want for o in outs)


def _interpret(node, body_graph) -> Callable[..., Any]:
    """The body node by node: each with its CUDA kernel (or host fallback), constants uploaded once."""
    from kiln.runtime.kernels import cuda
    steps = []
    # A constant read only as a host parameter (a ReduceMax's axes, a Reshape's shape) stays numpy: on the
    # device, the kernel would copy it back on every call, a synchronization that also breaks CUDA-graph
    # capture (issue 18: the safe softmax's ReduceMax axes in an attention body run node by node).
    host_only = {v for v in body_graph.initializers.values()
                 if v.uses and all(i in cuda.host_inputs(u) for u, i in v.uses)}
    env_consts = {v: v.const if v in host_only else device_array(v.const) for v in body_graph.initializers.values()}
    for n in body_graph.nodes:
        k = cuda.choose(n, n.schema.fill_attrs(n.attrs))
        if k is None and any(v is not None and v.type is not None and v.type.dtype is DType.BFLOAT16
                             for v in list(n.inputs) + list(n.outputs)):
            from kiln.errors import KilnError
            raise KilnError(f"{node.describe()}: body node {n.describe()} has no bfloat16 GPU kernel (a host run would "
                            "read bfloat16's device words as integers): convert the model with precision='fp16'")
        if k is None:
            from kiln.runtime.kernels import cpu
            k = host_fallback(cpu.choose(n, n.schema.fill_attrs(n.attrs)))
        steps.append((k, n.inputs, n.outputs))
    inputs, outputs = body_graph.inputs, body_graph.outputs
    single = len(node.outputs) == 1

    def run(*args):
        env = dict(env_consts)
        env.update(zip(inputs, args))
        for k, ins, outs in steps:
            r = k(*[None if v is None else env[v] for v in ins])
            if len(outs) == 1:
                env[outs[0]] = r
            else:
                env.update(zip(outs, r))
        res = [env[v] for v in outputs]
        return res[0] if single else tuple(res)
    return run


def host_fallback(cpu_kernel: Callable[..., Any]) -> Callable[..., Any]:
    """Run a CPU kernel on host copies of the arguments and upload its results."""
    def run(*args):
        out = cpu_kernel(*[a.get() if isinstance(a, cp.ndarray) else a for a in args])
        if isinstance(out, (tuple, list)):
            return tuple(cp.asarray(o) for o in out)
        return cp.asarray(out)
    run.fallback = True
    return run


@kernel("Identity")
def identity(node, attrs):
    return lambda x: x


@kernel("Dropout", host=(1, 2))
def dropout(node, attrs):
    """Inference: the identity (training_mode=True runs on the host, it needs the RNG)."""
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        mode = const_input(node, 2)
        if mode is None or bool(np.asarray(mode).reshape(-1)[0]):
            return None
    if len(node.outputs) > 1:
        return lambda x, *unused: (x, cp.ones(x.shape, bool))
    return lambda x, *unused: x
