"""Matrix products: MatMul, Gemm and Einsum (ONNX semantics), and Det."""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import FLOAT, NUMERIC, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, op
from kiln.ir.types import Dim, TensorType, broadcast_shapes, dims_compatible, merge_dim

# MatMul/Gemm take floats and the wide ints (ONNX also lists uint32/uint64, which kiln lacks).
MATMUL_T = FLOAT | frozenset({DType.INT32, DType.INT64, DType.UINT32, DType.UINT64})


def _same_dtype(ctx: InferContext, *indices: int) -> DType:
    types = [ctx.input(i) for i in indices if ctx.has_input(i)]
    first = types[0].dtype
    if any(t.dtype is not first for t in types[1:]):
        ctx.fail(f"inputs must share one dtype, got {', '.join(str(t.dtype) for t in types)}")
    return first


def _check_inner(ctx: InferContext, k_a: Dim, k_b: Dim, a_shape: tuple, b_shape: tuple) -> None:
    if not dims_compatible(k_a, k_b):
        ctx.fail(f"inner dims differ: A{list(a_shape)} has K={k_a}, B{list(b_shape)} has K={k_b}")


# --------------------------------------------------------------------------- MatMul


def infer_matmul(ctx: InferContext) -> TensorType:
    dtype = _same_dtype(ctx, 0, 1)
    a, b = ctx.input(0).shape, ctx.input(1).shape
    if a is None or b is None:
        return TensorType(dtype, None)
    if len(a) == 0 or len(b) == 0:
        ctx.fail("MatMul needs inputs of rank >= 1, got a scalar")
    # numpy rules: a 1-D A is a row [1, K] and a 1-D B a column [K, 1]; the added dim is dropped.
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    _check_inner(ctx, a2[-1], b2[-2], a, b)
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except ValueError as e:
        ctx.fail(f"batch dims {list(a2[:-2])} and {list(b2[:-2])} do not broadcast ({e})")
    out = list(batch)
    if len(a) > 1:
        out.append(a2[-2])
    if len(b) > 1:
        out.append(b2[-1])
    return TensorType(dtype, out)


@op("MatMul", traits=("anchor",), inputs=[In("A", MATMUL_T), In("B", MATMUL_T)], infer=infer_matmul)
def matmul(a, b):
    """numpy.matmul; narrow floats accumulate in float32."""
    acc = compute_dtype(a.dtype)
    return np.matmul(a.astype(acc, copy=False), b.astype(acc, copy=False)).astype(a.dtype)


# --------------------------------------------------------------------------- Gemm


def _gemm_dims(ctx: InferContext) -> tuple:
    a, b = ctx.input(0).shape, ctx.input(1).shape
    for name, s in (("A", a), ("B", b)):
        if s is not None and len(s) != 2:
            ctx.fail(f"Gemm input {name} must be 2-D, got shape {list(s)}")
    if a is None or b is None:
        return None, None
    m, k_a = (a[1], a[0]) if ctx.attrs["transA"] else a
    k_b, n = (b[1], b[0]) if ctx.attrs["transB"] else b
    _check_inner(ctx, k_a, k_b, a, b)
    return m, n


def _check_gemm_c(ctx: InferContext, m: Dim, n: Dim) -> None:
    """C must broadcast one way onto (M, N): each of its trailing dims is 1 or equal."""
    c = ctx.input(2).shape
    if c is None:
        return
    if len(c) > 2:
        ctx.fail(f"Gemm input C must have rank <= 2, got shape {list(c)}")
    for got, want in zip(reversed(c), (n, m)):
        if got != 1 and not dims_compatible(got, want):
            ctx.fail(f"Gemm input C of shape {list(c)} does not broadcast to (M, N) = ({m}, {n})")


def infer_gemm(ctx: InferContext) -> TensorType:
    dtype = _same_dtype(ctx, 0, 1, 2)
    m, n = _gemm_dims(ctx)
    if ctx.has_input(2):
        _check_gemm_c(ctx, m, n)
    if ctx.input(0).shape is None or ctx.input(1).shape is None:
        return TensorType(dtype, None)
    return TensorType(dtype, (m, n))


@op("Gemm", traits=("anchor",), inputs=[In("A", MATMUL_T), In("B", MATMUL_T), In("C", MATMUL_T, optional=True)],
    attrs=[Attr("alpha", AttrKind.FLOAT, 1.0), Attr("beta", AttrKind.FLOAT, 1.0),
           Attr("transA", AttrKind.INT, 0), Attr("transB", AttrKind.INT, 0)],
    infer=infer_gemm)
def gemm(a, b, c=None, *, alpha, beta, transA, transB):
    """Y = alpha * A' @ B' + beta * C, with A' = A.T if transA, B' = B.T if transB."""
    # Integers compute exactly in int64; alpha/beta scale them only when they are not 1.
    acc = np.dtype(np.int64) if a.dtype.kind in "iu" else compute_dtype(a.dtype)
    a2 = a.T if transA else a
    b2 = b.T if transB else b
    y = np.matmul(a2.astype(acc), b2.astype(acc))
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c.astype(acc) * beta if beta != 1.0 else c.astype(acc))
    return y.astype(a.dtype)


# --------------------------------------------------------------------------- Einsum

ELLIPSIS = "..."


def _parse_term(term: str) -> list:
    """Tokens of one operand's subscripts: single letters and at most one '...'."""
    tokens = []
    rest = term
    while rest:
        if rest.startswith(ELLIPSIS):
            if ELLIPSIS in tokens:
                raise ValueError(f"einsum term '{term}' has more than one '...'")
            tokens.append(ELLIPSIS)
            rest = rest[3:]
        elif rest[0].isalpha():
            tokens.append(rest[0])
            rest = rest[1:]
        else:
            raise ValueError(f"einsum term '{term}' has an invalid character {rest[0]!r}")
    return tokens


def parse_equation(equation: str, num_inputs: int) -> tuple:
    """(input token lists, output token list) of an einsum equation; implicit output mode
    (no '->') gives '...' then the letters used exactly once, alphabetically (numpy's rule)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = [_parse_term(t) for t in lhs.split(",")]
    if len(terms) != num_inputs:
        raise ValueError(f"einsum equation '{equation}' has {len(terms)} operands, the node has {num_inputs} inputs")
    letters = [t for term in terms for t in term if t != ELLIPSIS]
    if not arrow:
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        has_ellipsis = any(ELLIPSIS in term for term in terms)
        return terms, ([ELLIPSIS] if has_ellipsis else []) + once
    out = _parse_term(rhs)
    for c in out:
        if c != ELLIPSIS and c not in letters:
            raise ValueError(f"einsum output subscript '{c}' does not appear in any input of '{equation}'")
        if out.count(c) > 1:
            raise ValueError(f"einsum output subscript '{c}' appears twice in '{equation}'")
    return terms, out


def _bind_term(term: list, shape: tuple, sizes: dict, ellipses: list, where: str) -> None:
    """Record the dims that one operand gives its letters and its '...'."""
    n_letters = sum(1 for t in term if t != ELLIPSIS)
    if ELLIPSIS in term:
        if len(shape) < n_letters:
            raise ValueError(f"{where} has rank {len(shape)}, fewer than its {n_letters} subscripts")
    elif len(shape) != n_letters:
        raise ValueError(f"{where} has rank {len(shape)} but {n_letters} subscripts")
    pos = 0
    for t in term:
        if t == ELLIPSIS:
            width = len(shape) - n_letters
            ellipses.append(tuple(shape[pos:pos + width]))
            pos += width
            continue
        d = shape[pos]
        pos += 1
        if t in sizes and not dims_compatible(sizes[t], d):
            raise ValueError(f"einsum subscript '{t}' has size {sizes[t]} and {d} ({where})")
        sizes[t] = merge_dim(sizes[t], d) if t in sizes else d


def einsum_shape(equation: str, shapes: list) -> tuple:
    """The output shape of an einsum over operands of the given (possibly symbolic) shapes."""
    terms, out = parse_equation(equation, len(shapes))
    sizes: dict = {}
    ellipses: list = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        _bind_term(term, shape, sizes, ellipses, f"einsum operand {i} of shape {list(shape)}")
    try:
        ell = broadcast_shapes(*ellipses) if ellipses else ()
    except ValueError as e:
        raise ValueError(f"the '...' dims of the operands do not broadcast: {e}") from None
    result: list = []
    for t in out:
        result.extend(ell if t == ELLIPSIS else [sizes[t]])
    return tuple(result)


def infer_einsum(ctx: InferContext) -> TensorType:
    n = len(ctx.node.inputs)
    dtype = _same_dtype(ctx, *range(n))
    shapes = [ctx.input(i).shape for i in range(n)]
    if any(s is None for s in shapes):
        parse_equation(ctx.attrs["equation"], n)
        return TensorType(dtype, None)
    return TensorType(dtype, einsum_shape(ctx.attrs["equation"], shapes))


@op("Einsum", inputs=[In("Inputs", NUMERIC, variadic=True)], outputs=["Output"],
    attrs=[Attr("equation", AttrKind.STRING)], infer=infer_einsum)
def einsum(*inputs, equation: str):
    """numpy.einsum; narrow floats accumulate in float32."""
    dtype = inputs[0].dtype
    acc = compute_dtype(dtype)
    result = np.einsum(equation.replace(" ", ""), *(x.astype(acc, copy=False) for x in inputs))
    return np.asarray(result).astype(dtype)



# --------------------------------------------------------------------------- Det


def infer_det(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    if x.shape is None:
        return TensorType(x.dtype, None)
    if len(x.shape) < 2:
        ctx.fail(f"X must have rank >= 2 ([*, M, M]), got shape {list(x.shape)}")
    if not dims_compatible(x.shape[-2], x.shape[-1]):
        ctx.fail(f"the last two dims of X must be equal (square matrices), got shape {list(x.shape)}")
    return TensorType(x.dtype, x.shape[:-2])


@op("Det", inputs=[In("X", FLOAT)], infer=infer_det)
def det(x):
    """The determinants of the square matrices on X's last two dims, shape X.shape[:-2] (Det-11; 22 adds bfloat16),
    by LU factorization (numpy.linalg.det) in float32 or wider; a 0x0 matrix has determinant 1."""
    acc = compute_dtype(x.dtype)
    return np.asarray(np.linalg.det(x.astype(acc, copy=False))).astype(x.dtype)
