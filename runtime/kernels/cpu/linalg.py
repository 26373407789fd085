"""MatMul and Gemm straight to BLAS.

The references widen narrow floats (and Gemm's integers) and scale by alpha/beta always; here
float32/float64 go to ``np.matmul`` as they are (a stack against a matrix as one 2-D product),
transposes stay views (BLAS reads them transposed), alpha/beta apply only when they change
something, and the bias adds in place on the fresh product. Other dtypes keep the reference.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from kiln.runtime.kernels.cpu import kernel, native, reference_kernel

BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def input_dtype(node, i: int = 0) -> np.dtype:
    """The numpy dtype of input i as typed in the graph."""
    return np.dtype(node.inputs[i].type.dtype.numpy)


def const_input(node, i: int) -> Optional[np.ndarray]:
    """Input i's constant value (a weight), or None when it is computed or omitted."""
    if i >= len(node.inputs) or node.inputs[i] is None:
        return None
    return node.inputs[i].const


def weight_input(node, i: int) -> Optional[np.ndarray]:
    """Input i's constant value, or where it is a 2-D ``Transpose`` of a constant (the passes keep a weight's
    transpose a node: at run time it is a free view) that constant transposed (a view), else None."""
    value = const_input(node, i)
    if value is not None or i >= len(node.inputs) or node.inputs[i] is None:
        return value
    producer = node.inputs[i].producer
    if producer is None or producer.domain != "" or producer.op != "Transpose" or not producer.inputs \
            or producer.inputs[0] is None or producer.inputs[0].const is None:
        return None
    source = np.asarray(producer.inputs[0].const)
    perm = producer.attrs.get("perm")
    if source.ndim != 2 or (perm is not None and list(perm) != [1, 0]):
        return None
    return source.T


@kernel("MatMul")
def matmul(node, attrs) -> Callable[..., Any]:
    dt = input_dtype(node)
    weight = weight_input(node, 1)
    if dt == np.float32 and weight is not None and weight.ndim == 2:
        fast = native.linear(np.asarray(weight, np.float32), None) if weight.dtype == np.float32 else None
        if fast is not None:  # x @ W with W packed once for the extension's AVX-512 sgemm
            def run_native(a, b_unused):
                # below native.SGEMM_MIN_ROWS rows (1: none but an empty input) numpy's product
                if a.dtype == np.float32 and a.ndim >= 1 and a.size >= native.SGEMM_MIN_ROWS * a.shape[-1]:
                    return fast(a)
                return _matmul_folded(a, b_unused)
            return run_native
    if dt == np.float32 and native.has_sgemm():
        def run_products(a, b):  # both computed (attention's products): the extension's sgemm where it takes them
            y = native.matmul(a, b)
            return _matmul_folded(a, b) if y is None else y
        return run_products
    # Integer matmul wraps in the input dtype exactly as the reference does.
    if dt in BLAS_DTYPES or dt.kind in "iu":
        def run(a, b):
            return _matmul_folded(a, b)
        return run
    return reference_kernel(node, attrs)


def _matmul_folded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``, with a stacked ``a`` against a matrix ``b`` folded into one 2-D product.

    np.matmul loops over the stack, one small BLAS call per matrix (per row when ``a`` is a
    transposed view: [seq, batch, k] @ [k, n] was 128 GEMVs, 8x slower than one GEMM); the
    reshape copies a non-contiguous ``a`` once, far cheaper than those calls. When ``a`` is a
    permutation of a contiguous stack (a transposed activation, [seq, batch, k] over memory
    [batch, seq, k]) the product runs on that memory order instead, without the copy, and comes
    back permuted the same way: a view, which the reshapes and transposes that follow read as
    they would the contiguous product."""
    if a.ndim <= 2 or b.ndim != 2:
        return np.matmul(a, b)
    if not a.flags.c_contiguous and a.strides[-1] == a.itemsize:
        # Leading axes from the outermost in memory (stable: ties are size-1 axes, in any order).
        order = sorted(range(a.ndim - 1), key=lambda i: -a.strides[i]) + [a.ndim - 1]
        base = a.transpose(order)
        if base.flags.c_contiguous:
            y = _matmul_folded(base, b)
            return y.transpose(np.argsort(order))
    lead = a.shape[:-1]
    flat = a.reshape(math.prod(lead), a.shape[-1])
    return np.matmul(flat, b).reshape(lead + (b.shape[1],))


@kernel("Gemm")
def gemm(node, attrs) -> Callable[..., Any]:
    if input_dtype(node) not in BLAS_DTYPES:
        return reference_kernel(node, attrs)
    alpha, beta = attrs["alpha"], attrs["beta"]
    trans_a, trans_b = attrs["transA"], attrs["transB"]
    b_const = const_input(node, 1)
    # A constant weight is transposed once: the view is what BLAS reads each run.
    b_fixed = None if b_const is None else (b_const.T if trans_b else b_const)
    c_const = const_input(node, 2)
    c_fixed = None if c_const is None else _scaled_bias(c_const, beta)

    if b_fixed is not None and not trans_a and alpha == 1.0 and input_dtype(node) == np.float32 \
            and (c_fixed is None or c_fixed.shape in ((b_fixed.shape[1],), (1, b_fixed.shape[1]))) \
            and (c_fixed is not None or len(node.inputs) < 3 or node.inputs[2] is None):
        fast = native.linear(np.asarray(b_fixed), None if c_fixed is None else np.asarray(c_fixed).reshape(-1))
        if fast is not None:  # a Linear layer through the extension's AVX-512 sgemm, the weight packed once
            def linear_native(a, b, c=None):
                if a.dtype == np.float32 and a.size >= native.SGEMM_MIN_ROWS * a.shape[-1]:
                    return fast(a)
                y = np.matmul(a, b_fixed)
                if c_fixed is not None:
                    y += c_fixed
                return y
            return linear_native

    if b_fixed is not None and c_fixed is not None and not trans_a and alpha == 1.0:
        # A Linear layer (constant weight and bias): at batch 1 the call layers around the two
        # numpy calls are a visible share of a small model's run, so this case gets its own
        # closure. np.dot of 2-D operands is the same BLAS product as np.matmul with less
        # dispatch (about 0.2 us less per call); Gemm's A and B are matrices.
        def linear(a, b, c):
            y = np.dot(a, b_fixed) if a.ndim == 2 else np.matmul(a, b_fixed)
            y += c_fixed
            return y
        return linear

    def run(a, b, c=None):
        y = np.matmul(a.T if trans_a else a, b_fixed if b_fixed is not None else (b.T if trans_b else b))
        if alpha != 1.0:
            y *= alpha
        if c is not None:
            y += c_fixed if c_fixed is not None else _scaled_bias(c, beta)
        return y
    return run


def _scaled_bias(c: np.ndarray, beta: float) -> np.ndarray:
    return c * beta if beta != 1.0 else c
