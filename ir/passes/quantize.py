"""int8 weights for ``kiln mobile pack --quantize int8``: per-output-channel symmetric quantization.

Weights are most of a small model's file, and a phone's download and flash budget is what the
mobile path is for, so the constant weight ``W`` of a Conv, Gemm or MatMul is stored as int8 with
one float32 scale per output channel::

    scale_c = max|W_c| / 127          q = clip(round(W / scale_c), -127, 127)   (int8)

Symmetric (no zero point) because weights are centred on zero and a zero point would cost the
kernels a subtraction; per *output* channel because channels differ in range by orders of
magnitude after BatchNorm folding, and one scale per tensor would crush the small ones. -128 is
never used, so the range is symmetric and ``-q`` never overflows. A channel that is all zeros gets
scale 0 and q 0, which dequantizes to exactly 0.

The rewrite is ONNX-standard, so the packed file stays a normal model that the full runtime (and
ONNX Runtime, after export) can run: ``W`` becomes initializers ``<W>.q`` (int8) and ``<W>.scale``
(float32 [C_out]) and a ``DequantizeLinear(<W>.q, <W>.scale, axis=<out-channel axis>)`` node whose
output feeds the op. The stub's kernels take (q, scale) and dequantize inside the kernel.

Output-channel axes: Conv weight [M, C/g, *k] -> 0; Gemm B [N, K] with transB=1 -> 0, [K, N] with
transB=0 -> 1; MatMul B [..., K, N] -> its last axis. A weight read by several nodes is quantized
once when every reader wants the same axis, and left in float32 when any reader is something else
(a tied embedding that a Gather also reads), since that reader would need the float values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes.shape_inference import infer_node

QMAX = 127
WEIGHT_OPS = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight replaced by int8 + scales: what the pack report lists."""

    name: str
    shape: tuple
    axis: int
    max_abs_error: float  # max |W - dequantize(q, scale)|, at most max(scale) / 2
    float_bytes: int
    quant_bytes: int  # q and scale together


def quantize_per_channel(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int8, scale float32 [w.shape[axis]]): symmetric per-channel quantization of ``w`` along ``axis``."""
    w = np.asarray(w, np.float32)
    axis %= w.ndim
    reduce_axes = tuple(i for i in range(w.ndim) if i != axis)
    scale = (np.max(np.abs(w), axis=reduce_axes) / np.float32(QMAX)).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    s = scale.reshape(shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(w / s), 0)
    return np.clip(q, -QMAX, QMAX).astype(np.int8), scale


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int) -> np.ndarray:
    shape = [1] * q.ndim
    shape[axis % q.ndim] = -1
    return q.astype(np.float32) * scale.reshape(shape)


def weight_axis(node: Node, index: int, ops=WEIGHT_OPS, transposed: bool = False) -> Optional[int]:
    """The output-channel axis of the weight that ``node`` reads at input ``index``, or None when
    that input is not a weight this pass quantizes. A 2-D ``Transpose`` whose output only a MatMul
    reads as its weight (a traced ``nn.Linear``: ``x @ W.T``) counts as that MatMul's weight reader,
    its output channels being the weight's axis 0 (with ``transposed``; the mobile stub fuses only a
    DequantizeLinear that its weight ops read directly)."""
    if transposed and node.domain == "" and node.op == "Transpose" and index == 0 and "MatMul" in ops:
        t = node.outputs[0]
        perm = tuple(node.attrs.get("perm") or ())
        readers = t.uses
        if perm in ((1, 0), ()) and len(readers) >= 1 and all(
                u.op == "MatMul" and u.domain == "" and i == 1 for u, i in readers) and \
                node.inputs[0].type is not None and node.inputs[0].type.rank == 2:
            return 0
        return None
    if node.domain != "" or index != 1 or node.op not in ops:
        return None
    w = node.inputs[1]
    if w is None or w.type is None or w.type.shape is None:
        return None
    rank = len(w.type.shape)
    if node.op == "Conv":
        return 0 if rank >= 3 else None
    if node.op == "Gemm":
        return (0 if node.attrs.get("transB", 0) else 1) if rank == 2 else None
    return rank - 1 if rank >= 2 else None  # MatMul: B [..., K, N]


# The weight dtypes quantized: float32 (the mobile pack), and the half types of a converted model (the GPU's
# weight-only int8, issue 18: the scales keep the weight's dtype, so DequantizeLinear gives it back).
FLOAT_WEIGHTS = ("float32", "float16", "bfloat16")


def _candidates(graph: Graph, ops=WEIGHT_OPS, dtypes=("float32",), transposed: bool = False) -> dict[Value, int]:
    """Float weight initializers (of ``dtypes``) whose every reader wants them quantized along one axis."""
    axes: dict[Value, set] = {}
    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            if v is not None and v.is_initializer and v.const.dtype.name in dtypes and v.const.ndim >= 2:
                axes.setdefault(v, set()).add(weight_axis(node, i, ops, transposed))
    outputs = set(graph.outputs)
    result = {}
    for v, found in axes.items():
        if len(found) == 1 and None not in found and v not in outputs and _only_top_level_uses(v):
            result[v] = found.pop()
    return result


def _only_top_level_uses(v: Value) -> bool:
    """True when no If/Loop body reads ``v`` (this pass rewires top-level readers only)."""
    return all(node.graph is v.graph for node in v.users)


def quantize_weights(graph: Graph, ops=WEIGHT_OPS, dtypes=("float32",), min_elements: int = 0,
                     transposed: bool = False) -> list[QuantizedWeight]:
    """Replace the constant weights of ``ops`` (Conv/Gemm/MatMul by default) in ``graph`` (in place) by
    int8 + per-channel scales behind a DequantizeLinear placed just before the weight's first reader.
    ``dtypes``: the weight dtypes taken (the scales keep the weight's dtype); ``min_elements``: smaller
    weights stay as they are; ``transposed``: also a weight behind a Transpose that a MatMul reads."""
    done = []
    for w, axis in _candidates(graph, tuple(ops), tuple(dtypes), transposed).items():
        arr = w.const
        if arr.size < min_elements:
            continue
        q, scale = quantize_per_channel(arr, axis)
        scale = scale.astype(arr.dtype)  # float32, or the half type of a converted model
        name = w.name
        readers = w.users
        first = next(n for n in graph.nodes if n in readers)
        q_v = graph.add_constant(q, f"{name}.q")
        s_v = graph.add_constant(scale, f"{name}.scale")
        dq = graph.add_node("DequantizeLinear", [q_v, s_v], {"axis": axis}, before=first,
                            name=f"{name}.dequantize", meta=dict(readers[0].meta))
        infer_node(dq)
        for n in readers:
            n.replace_input(w, dq.outputs[0])
        graph.remove_initializer(w)
        err = float(np.max(np.abs(dequantize(q, scale.astype(np.float32), axis) - arr.astype(np.float32)))) \
            if arr.size else 0.0
        done.append(QuantizedWeight(name, tuple(arr.shape), axis, err, int(arr.nbytes),
                                    int(q.nbytes + scale.nbytes)))
    return done
