"""``kiln.FusedEpilogue`` on the GPU: a Conv/Gemm/MatMul (the anchor) and its elementwise epilogue.

Why: the unfused graph writes the anchor's output, then reads it back once per epilogue kernel
(bias add, activation, residual add), each a launch of its own. Here the epilogue runs inside
the anchor's library call where the library can do it, and otherwise as one generated kernel
writing over the anchor's output in place:

- **Conv** whose epilogue is ``[Add(residual)] [Relu]`` (ResNet's ``relu(conv(x) + identity)``
  and ``relu(conv(x))``; the conv's own bias, from the folded BatchNorm, is part of the conv):
  the conv kernel's ``with_epilogue`` (nn.py), i.e. cuDNN's fused graph, or for what cuDNN
  would not fuse, and on the im2col path, one pass after the GEMM;
- **MatMul / Gemm** whose epilogue starts with the add of a constant bias vector (a Linear
  layer) and/or a residual add (a tensor of the product's shape, the transformer's ``x + ...``):
  cublasLt with its bias epilogue (linalg.LtBias; with a ReLU right after the bias, ReLU too)
  and the residual as its C operand (beta 1), then the rest of the epilogue (a Gelu) as one
  generated kernel;
- **MatMul** times a one-element constant (attention's ``q @ k^T * (1/sqrt(d))``): the scale
  is the GEMM's alpha, free;
- anything else: the anchor's own kernel, then the whole epilogue as one generated kernel.

The anchor's kernel is the one the unfused node would get (chosen with a detached copy of the
anchor node whose inputs are the fused node's outer values, so constant weights are seen as
constants and prepared once). What each node ended up doing is in ``run.strategy`` (reported
by CudaProgram.epilogues). When the epilogue has no generated kernel (an op the code generator
lacks), the factory returns None and the node runs on the host like any unsupported node.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import cupy as cp
import numpy as np

from kiln.errors import KilnError
from kiln.ir.graph import Node
from kiln.runtime.kernels.cuda import FLOATS as _FLOATS32, codegen, device_array, ignored_inputs, in_dtype, kernel, options

FLOATS = _FLOATS32 + (np.dtype(np.float16),)  # float16 too (issue 18): cublasLt's bias epilogue takes it
if codegen.BF16 is not None:  # and bfloat16 (held as uint16 words on the device)
    FLOATS = FLOATS + (codegen.BF16,)
from kiln.runtime.kernels.cuda.codegen import ElementwiseKernel, Unsupported


def _shadow(anchor: Node, outer_inputs: list) -> Node:
    """A detached copy of ``anchor`` reading ``outer_inputs``: never part of a graph, and it
    registers no uses on those values (the inputs are set below the use-tracking setter)."""
    s = Node(anchor.graph, anchor.op, anchor.domain, anchor.name, anchor.attrs)
    s.meta = anchor.meta
    s.outputs = anchor.outputs
    s._inputs = tuple(outer_inputs)
    return s


def _other(add: Node, v) -> Optional[Any]:
    """The other input of a two-input Add reading ``v`` once."""
    a, b = add.inputs
    if a is v and b is not v:
        return b
    if b is v and a is not v:
        return a
    return None


def _only_reader(v, node: Node) -> bool:
    return all(u is node for u in v.users) and len(v.users) == 1


class _Epilogue:
    """One FusedEpilogue node as the strategies below see it: the body, its anchor and the anchor's output
    ``y``, the body's nodes after the anchor, where each body input sits among the node's inputs."""

    def __init__(self, node, body):
        self.body = body
        self.anchor = body.nodes[0]
        self.k = len(self.anchor.inputs)
        self.outer = dict(zip(body.inputs, node.inputs))
        self.y = self.anchor.outputs[0]
        self.rest = list(body.nodes[1:])
        self.single = len(body.outputs) == 1
        self.position = {v: i for i, v in enumerate(body.inputs)}
        self.tf32 = options().tf32  # the program's, bound at load (the anchor's kernel takes the rest)

    def const(self, v) -> Optional[np.ndarray]:
        return self.outer[v].const if v in self.outer else v.const

    def residual(self, t, add: Node) -> Optional[int]:
        """The body-input position of the non-constant tensor ``add`` adds to ``t``, of ``t``'s shape and
        dtype, or None."""
        r = _other(add, t)
        if r is None or r not in self.position or self.const(r) is not None or r.type is None or t.type is None:
            return None
        if r.type.shape != t.type.shape or r.type.dtype != t.type.dtype:
            return None
        return self.position[r]


@kernel("FusedEpilogue", domain="kiln")
def fused_epilogue(node, attrs) -> Optional[Callable[..., Any]]:
    """The first strategy that takes the node (module docstring): cublasLt's epilogue, the GEMM's alpha, the
    conv's own epilogue, else the anchor's kernel; what the chosen one leaves runs as one generated kernel."""
    from kiln.runtime.kernels import cuda
    e = _Epilogue(node, attrs["body"])
    if e.y.type is None or e.y.type.shape is None:
        return None
    found = _cublaslt(e) or _gemm_alpha(e)
    if found is not None:
        return _with_tail(e, *found)
    anchor_k = cuda.choose(_shadow(e.anchor, [e.outer[v] for v in e.anchor.inputs]),
                           e.anchor.schema.fill_attrs(e.anchor.attrs))
    if anchor_k is None:
        return None
    conv = _conv_epilogue(e, anchor_k)
    if conv is not None:
        return conv

    def first(args):
        return anchor_k(*args[:e.k])
    return _with_tail(e, first, ignored_inputs(anchor_k), f"{e.anchor.op} kernel", e.y, e.rest, anchor_k)


def _cublaslt(e: _Epilogue) -> Optional[tuple]:
    """MatMul / Gemm: [a constant bias vector [and a ReLU right after it]] [then a residual add] -> cublasLt
    (the bias and ReLU as its epilogue, the residual as its C operand with beta 1). Returns
    ``(first, ignored inputs, strategy, value it gives, steps left)`` or None."""
    anchor, y, steps = e.anchor, e.y, list(e.rest)
    if anchor.op not in ("MatMul", "Gemm") or not steps or steps[0].op != "Add" or not _only_reader(y, steps[0]):
        return None
    operands = _matmul_operands(anchor, e.const)
    if operands is None:
        return None
    n = y.type.shape[-1]
    b = _other(steps[0], y)
    c = None if b is None else e.const(b)
    t, bias, relu, bias_at, residual_at = y, None, False, None, None
    if c is not None and isinstance(n, int) and c.size == n and c.ndim >= 1 \
            and c.shape[-1] == n and np.dtype(c.dtype) in FLOATS and np.dtype(c.dtype) == in_dtype(anchor):
        bias = c
        t = steps.pop(0).outputs[0]
        relu = bool(steps) and steps[0].op == "Relu" and _only_reader(t, steps[0])
        if relu:
            t = steps.pop(0).outputs[0]
        bias_at = e.position.get(b)
    if not relu and steps and steps[0].op == "Add" and _only_reader(t, steps[0]):
        out = steps[0].outputs[0].type
        at = e.residual(t, steps[0])
        if at is not None and out is not None and out.shape == t.type.shape:
            residual_at, t = at, steps.pop(0).outputs[0]
    if bias is None and residual_at is None:
        return None
    from kiln.runtime.kernels.cuda.linalg import LtBias, cublas_matmul
    lt = LtBias(None if bias is None else device_array(np.ascontiguousarray(bias.reshape(-1))), relu=relu,
                tf32=e.tf32)
    ta, tb, b_const = operands
    b_dev = None if b_const is None else device_array(np.ascontiguousarray(b_const))
    tf32 = e.tf32

    def first(args):
        a = args[0].T if ta else args[0]
        bm = b_dev if b_dev is not None else (args[1].T if tb else args[1])
        r = None if residual_at is None else args[residual_at]
        out = lt(a, bm, r)
        if out is None and a.dtype == np.uint16:  # CuPy's adds below would be integer adds of bfloat16 words
            raise KilnError(f"cublasLt took no layout for this bfloat16 product ({a.shape} x {bm.shape}); no other "
                            "GPU path adds its bias yet: convert the model with precision='fp16'")
        if out is None:  # a layout cublasLt cannot take: cuBLAS, then the bias (and ReLU), the residual
            out = cublas_matmul(a, bm, tf32=tf32) if a.ndim == 2 or bm.ndim != 2 else \
                cublas_matmul(a.reshape(-1, a.shape[-1]), bm, tf32=tf32).reshape(a.shape[:-1] + (bm.shape[1],))
            if lt.bias is not None:
                out += lt.bias
            if lt.relu:
                cp.maximum(out, 0, out=out)
            if r is not None:
                out += r
        return out
    ignored = tuple(sorted(({1} if b_dev is not None else set())
                           | ({bias_at} if bias_at is not None and bias_at >= e.k else set())))
    strategy = "cublasLt " + "+".join(p for p, on in (("bias", lt.bias is not None), ("relu", lt.relu),
                                                       ("residual", residual_at is not None)) if on)
    return first, ignored, strategy, t, steps


def _gemm_alpha(e: _Epilogue) -> Optional[tuple]:
    """MatMul then a multiply by a one-element constant (attention's 1/sqrt(d)) -> the GEMM's alpha.
    Returns what :func:`_cublaslt` returns, or None."""
    anchor, y, steps = e.anchor, e.y, list(e.rest)
    if anchor.op != "MatMul" or not steps or steps[0].op != "Mul" or not _only_reader(y, steps[0]) \
            or in_dtype(anchor) not in FLOATS:
        return None
    c = _other(steps[0], y)
    c = None if c is None else e.const(c)
    out = steps[0].outputs[0].type
    if c is None or c.size != 1 or np.dtype(c.dtype) != in_dtype(anchor) or out is None or out.shape != y.type.shape:
        return None
    from kiln.runtime.kernels.cuda.linalg import matmul2
    alpha, tf32 = float(c.reshape(-1)[0]), e.tf32

    def first(args):
        return matmul2(args[0], args[1], alpha, tf32)
    t = steps.pop(0).outputs[0]
    return first, (), "cuBLAS alpha", t, steps


def _conv_epilogue(e: _Epilogue, anchor_k) -> Optional[Callable[..., Any]]:
    """Conv: [Add(residual)] [Relu], the last node giving the one output -> the conv kernel's own epilogue
    (cuDNN's fused graph, or one pass after the im2col GEMM). The whole node's kernel, or None."""
    if e.anchor.op != "Conv" or not hasattr(anchor_k, "with_epilogue") or not e.single:
        return None
    t, residual_at, relu, steps = e.y, None, False, list(e.rest)
    if steps and steps[0].op == "Add" and _only_reader(t, steps[0]):
        at = e.residual(t, steps[0])
        if at is not None:
            residual_at, t = at, steps.pop(0).outputs[0]
    if steps and steps[0].op == "Relu" and _only_reader(t, steps[0]):
        relu, t = True, steps.pop(0).outputs[0]
    if steps or e.body.outputs[0] is not t or not (relu or residual_at is not None):
        return None
    conv = anchor_k.with_epilogue

    def run_conv(*args):
        return conv(args[0], None if residual_at is None else args[residual_at], relu)
    run_conv.ignores = ignored_inputs(anchor_k)
    run_conv.inner = anchor_k  # reports walk through (CudaProgram.conv_paths)
    run_conv.strategy = "conv with " + "+".join(s for s, on in (("residual", residual_at is not None),
                                                               ("relu", relu)) if on)
    return run_conv


def _with_tail(e: _Epilogue, first, ignored: tuple, strategy: str, t, steps: list,
               anchor_k=None) -> Optional[Callable[..., Any]]:
    """The node's kernel: ``first(args)`` gives ``t``; ``steps``, the rest of the epilogue, run as one generated
    kernel over ``t`` and the body inputs they read (in place over ``t`` where the contract allows)."""
    body, position, single = e.body, e.position, e.single
    ew, extra = None, []
    if steps:
        reads = []
        for s in steps:
            for v in s.inputs:
                if v is not None and v is not t and v in position and v not in reads:
                    reads.append(v)
        extra = [position[v] for v in reads]
        try:
            ew = ElementwiseKernel(codegen.body_from_nodes([t] + reads, body.initializers.values(), steps,
                                                           body.outputs))
        except Unsupported:
            return None
    elif not (len(body.outputs) == 1 and body.outputs[0] is t):
        return None  # an epilogue of nothing but an exported intermediate: not a pattern made here
    in_place = ew is not None and len(body.outputs) == 1 and body.outputs[0].type is not None and \
        body.outputs[0].type.dtype == e.y.type.dtype

    def run(*args):
        base = first(args)
        if ew is None:
            return base
        operands = [base] + [args[i] for i in extra]
        outs = None
        if in_place and base.flags.c_contiguous and base.data.ptr % 16 == 0 and \
                all(o is not base for o in operands[1:]):
            try:
                outs = ew(*operands, out=base)
            except ValueError:  # shapes the contract rules out; computed into a fresh array then
                outs = None
        if outs is None:
            outs = ew(*operands)
        return outs[0] if single else tuple(outs)
    run.ignores = ignored
    if anchor_k is not None:
        run.inner = anchor_k  # reports walk through (CudaProgram.conv_paths)
    run.strategy = strategy + (f" + generated epilogue ({', '.join(s.op for s in steps)})" if steps else "")
    if ew is not None:
        run.launcher = ew
    return run


def _matmul_operands(anchor: Node, const) -> Optional[tuple]:
    """(transpose A, transpose B, constant B as [K, N] or None) when the anchor is a plain product
    cublasLt can take with a bias: a MatMul of float matrices (or a stack times a matrix), or a
    Gemm with alpha 1 and no C of its own."""
    if in_dtype(anchor) not in FLOATS:
        return None
    if anchor.op == "MatMul":
        return False, False, None
    attrs = anchor.schema.fill_attrs(anchor.attrs)
    if attrs["alpha"] != 1.0 or len(anchor.inputs) > 2:
        return None
    c = const(anchor.inputs[1])
    return bool(attrs["transA"]), bool(attrs["transB"]), None if c is None else (c.T if attrs["transB"] else c)
