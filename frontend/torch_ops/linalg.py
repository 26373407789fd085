"""Matrix products: matmul and its aliases, addmm/baddbmm (scaled sums), einsum, outer, bilinear.

F.linear lives in core.py (a worked example of the table).
"""
from __future__ import annotations

import string

import numpy as np
import torch

from kiln.frontend.torch_ops import maps
from kiln.frontend.torch_ops.core import operands
from kiln.frontend.tracer import kiln_dtype


# numpy's matmul rules are torch's: 1-D operands gain and lose a dim, batch dims broadcast.
@maps(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.linalg.matmul)
def matmul(t, res, input, other, *, out=None):
    a, b = operands(t, res, input, other)
    return t.emit("MatMul", a, b)


@maps(torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm)
def mm(t, res, input, mat2, *, out=None):
    return matmul(t, res, input, mat2)


@maps(torch.mv, torch.Tensor.mv)
def mv(t, res, input, vec, *, out=None):
    return matmul(t, res, input, vec)


@maps(torch.dot, torch.Tensor.dot, torch.vdot, torch.Tensor.vdot)
def dot(t, res, input, tensor, *, out=None):
    return matmul(t, res, input, tensor)


@maps(torch.inner, torch.Tensor.inner)
def inner(t, res, input, other, *, out=None):
    a, b = operands(t, res, input, other)
    if input.dim() == 0 or other.dim() == 0:
        return t.emit("Mul", a, b)
    # Contract the last dims; the leading dims of both operands stay, one after the other.
    left = string.ascii_lowercase[:input.dim() - 1]
    right = string.ascii_uppercase[:other.dim() - 1]
    return t.emit("Einsum", a, b, equation=f"{left}z,{right}z->{left}{right}")


def _scaled_sum(t, res, product, input, beta, alpha):
    """beta * input + alpha * product; beta=0 ignores input entirely (torch: NaNs there do not spread)."""
    dt = kiln_dtype(res.dtype)
    if alpha != 1:
        product = t.emit("Mul", product, t.value(alpha, dt))
    if beta == 0:
        return product
    c = t.value(input, dt)
    if beta != 1:
        c = t.emit("Mul", c, t.value(beta, dt))
    return t.emit("Add", product, c)


@maps(torch.addmm, torch.Tensor.addmm, torch.Tensor.addmm_)
def addmm(t, res, input, mat1, mat2, *, beta=1, alpha=1, out=None):
    a, b = operands(t, res, mat1, mat2)
    # Gemm's C broadcasts one way onto (M, N), as addmm's input does.
    if beta == 0:
        return t.emit("Gemm", a, b, alpha=float(alpha))
    return t.emit("Gemm", a, b, t.value(input, kiln_dtype(res.dtype)), alpha=float(alpha), beta=float(beta))


@maps(torch.baddbmm, torch.Tensor.baddbmm, torch.Tensor.baddbmm_)
def baddbmm(t, res, input, batch1, batch2, *, beta=1, alpha=1, out=None):
    a, b = operands(t, res, batch1, batch2)
    return _scaled_sum(t, res, t.emit("MatMul", a, b), input, beta, alpha)


@maps(torch.addmv, torch.Tensor.addmv, torch.Tensor.addmv_)
def addmv(t, res, input, mat, vec, *, beta=1, alpha=1, out=None):
    a, b = operands(t, res, mat, vec)
    return _scaled_sum(t, res, t.emit("MatMul", a, b), input, beta, alpha)


@maps(torch.outer, torch.Tensor.outer, torch.ger, torch.Tensor.ger)
def outer(t, res, input, vec2, *, out=None):
    a, b = operands(t, res, input, vec2)
    column = t.emit("Unsqueeze", a, t.constant(np.array([1], np.int64), "axes"))
    return t.emit("Mul", column, b)


# ---------------------------------------------------------------------------- einsum
@maps(torch.einsum)
def einsum(t, res, equation, *operands_):
    # torch turns the sublist form einsum(a, [0, 1], b, [1, 2]) into an equation before this
    # point; the operands may still come as one list.
    if len(operands_) == 1 and isinstance(operands_[0], (list, tuple)):
        operands_ = tuple(operands_[0])
    return t.emit("Einsum", *operands(t, res, *operands_), equation=equation.replace(" ", ""))


def _tensordot_dims(dims, a_rank: int) -> tuple:
    """(a's contracted dims, b's contracted dims) of torch.tensordot's ``dims``."""
    if isinstance(dims, torch.Tensor):
        dims = dims.tolist()
    if isinstance(dims, int):
        return list(range(a_rank - dims, a_rank)), list(range(dims))
    da, db = dims
    return ([da] if isinstance(da, int) else list(da)), ([db] if isinstance(db, int) else list(db))


@maps(torch.tensordot)
def tensordot(t, res, a, b, dims=2, out=None):
    da, db = _tensordot_dims(dims, a.dim())
    da = [d % a.dim() for d in da]
    db = [d % b.dim() for d in db]
    letters = iter(string.ascii_letters)
    a_terms = [next(letters) for _ in range(a.dim())]
    b_terms = [next(letters) for _ in range(b.dim())]
    for i, j in zip(da, db):
        b_terms[j] = a_terms[i]
    kept = [c for i, c in enumerate(a_terms) if i not in da] + [c for j, c in enumerate(b_terms) if j not in db]
    equation = f"{''.join(a_terms)},{''.join(b_terms)}->{''.join(kept)}"
    return t.emit("Einsum", *operands(t, res, a, b), equation=equation)


@maps(torch.bilinear)
def bilinear(t, res, input1, input2, weight, bias=None):
    x1, x2, w = operands(t, res, input1, input2, weight)
    y = t.emit("Einsum", x1, w, x2, equation="...i,oij,...j->...o")
    if bias is None:
        return y
    return t.emit("Add", y, t.value(bias, kiln_dtype(res.dtype)))
