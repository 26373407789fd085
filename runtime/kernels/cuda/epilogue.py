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


@kernel("FusedEpilogue", domain="kiln")
def fused_epilogue(node, attrs) -> Optional[Callable[..., Any]]:
    from kiln.runtime.kernels import cuda
    body = attrs["body"]
    anchor = body.nodes[0]
    k = len(anchor.inputs)
    outer = dict(zip(body.inputs, node.inputs))
    y = anchor.outputs[0]
    if y.type is None or y.type.shape is None:
        return None
    rest = list(body.nodes[1:])
    single = len(body.outputs) == 1
    position = {v: i for i, v in enumerate(body.inputs)}
    tf32 = options().tf32  # the program's, bound at load (the anchor's kernel takes the rest)

    def const(v) -> Optional[np.ndarray]:
        return outer[v].const if v in outer else v.const

    # ---- MatMul / Gemm: [a constant bias vector [and a ReLU right after it]] [then a residual add] -> cublasLt
    # (the bias and ReLU as its epilogue, the residual as its C operand with beta 1).
    lt, bias_at, residual_at, t, steps, operands = None, None, None, y, list(rest), None
    if anchor.op in ("MatMul", "Gemm") and steps and steps[0].op == "Add" and _only_reader(y, steps[0]):
        n = y.type.shape[-1]
        b = _other(steps[0], y)
        c = None if b is None else const(b)
        operands = _matmul_operands(anchor, const)
        bias, relu = None, False
        if c is not None and operands is not None and isinstance(n, int) and c.size == n and c.ndim >= 1 \
                and c.shape[-1] == n and np.dtype(c.dtype) in FLOATS and np.dtype(c.dtype) == in_dtype(anchor):
            bias = c
            t = steps[0].outputs[0]
            steps.pop(0)
            relu = bool(steps) and steps[0].op == "Relu" and _only_reader(t, steps[0])
            if relu:
                t = steps[0].outputs[0]
                steps.pop(0)
            bias_at = position.get(b)
        if operands is not None and not relu and steps and steps[0].op == "Add" and _only_reader(t, steps[0]):
            r = _other(steps[0], t)
            if r is not None and r in position and const(r) is None and r.type is not None and t.type is not None \
                    and r.type.shape == t.type.shape and r.type.dtype == t.type.dtype \
                    and steps[0].outputs[0].type is not None and steps[0].outputs[0].type.shape == t.type.shape:
                residual_at, t = position[r], steps[0].outputs[0]
                steps.pop(0)
        if bias is not None or residual_at is not None:
            from kiln.runtime.kernels.cuda.linalg import LtBias
            lt = LtBias(None if bias is None else device_array(np.ascontiguousarray(bias.reshape(-1))), relu=relu,
                        tf32=tf32)
    # ---- MatMul then a multiply by a one-element constant (attention's 1/sqrt(d)) -> the GEMM's alpha.
    alpha = None
    if lt is None and anchor.op == "MatMul" and steps and steps[0].op == "Mul" and _only_reader(y, steps[0]) \
            and in_dtype(anchor) in FLOATS:
        c = _other(steps[0], y)
        c = None if c is None else const(c)
        if c is not None and c.size == 1 and np.dtype(c.dtype) == in_dtype(anchor) and \
                steps[0].outputs[0].type is not None and steps[0].outputs[0].type.shape == y.type.shape:
            alpha = float(c.reshape(-1)[0])
            t = steps[0].outputs[0]
            steps.pop(0)
    anchor_k = None
    if lt is None and alpha is None:
        anchor_k = cuda.choose(_shadow(anchor, [outer[v] for v in anchor.inputs]),
                               anchor.schema.fill_attrs(anchor.attrs))
        if anchor_k is None:
            return None

    # ---- Conv: [Add(residual)] [Relu], the last node giving the one output.
    if anchor.op == "Conv" and anchor_k is not None and hasattr(anchor_k, "with_epilogue") and single:
        t, residual_at, relu, steps = y, None, False, list(rest)
        if steps and steps[0].op == "Add" and _only_reader(t, steps[0]):
            r = _other(steps[0], t)
            if r is not None and r in position and const(r) is None and r.type is not None \
                    and r.type.shape == y.type.shape and r.type.dtype == y.type.dtype:
                residual_at, t = position[r], steps[0].outputs[0]
                steps.pop(0)
        if steps and steps[0].op == "Relu" and _only_reader(t, steps[0]):
            relu, t = True, steps[0].outputs[0]
            steps.pop(0)
        if not steps and body.outputs[0] is t and (relu or residual_at is not None):
            conv = anchor_k.with_epilogue

            def run_conv(*args):
                return conv(args[0], None if residual_at is None else args[residual_at], relu)
            run_conv.ignores = ignored_inputs(anchor_k)
            run_conv.inner = anchor_k  # reports walk through (CudaProgram.conv_paths)
            run_conv.strategy = "conv with " + "+".join(s for s, on in (("residual", residual_at is not None),
                                                                       ("relu", relu)) if on)
            return run_conv
        t, steps = y, list(rest)

    # ---- the rest of the epilogue: one generated kernel over t and the inputs it reads.
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
        body.outputs[0].type.dtype == y.type.dtype

    if lt is not None:
        from kiln.runtime.kernels.cuda.linalg import cublas_matmul
        ta, tb, b_const = operands
        b_dev = None if b_const is None else device_array(np.ascontiguousarray(b_const))

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
                               | ({bias_at} if bias_at is not None and bias_at >= k else set())))
        strategy = "cublasLt " + "+".join(p for p, on in (("bias", lt.bias is not None), ("relu", lt.relu),
                                                           ("residual", residual_at is not None)) if on)
    elif alpha is not None:
        from kiln.runtime.kernels.cuda.linalg import matmul2

        def first(args):
            return matmul2(args[0], args[1], alpha, tf32)
        ignored = ()
        strategy = "cuBLAS alpha"
    else:
        def first(args):
            return anchor_k(*args[:k])
        ignored = ignored_inputs(anchor_k)
        strategy = f"{anchor.op} kernel"

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
