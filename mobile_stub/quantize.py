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


def weight_axis(node: Node, index: int) -> Optional[int]:
    """The output-channel axis of the weight that ``node`` reads at input ``index``, or None when
    that input is not a weight this pass quantizes."""
    if node.domain != "" or index != 1 or node.op not in WEIGHT_OPS:
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


def _candidates(graph: Graph) -> dict[Value, int]:
    """Float32 weight initializers whose every reader wants them quantized along one axis."""
    axes: dict[Value, set] = {}
    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            if v is not None and v.is_initializer and v.const.dtype == np.float32 and v.const.ndim >= 2:
                axes.setdefault(v, set()).add(weight_axis(node, i))
    outputs = set(graph.outputs)
    result = {}
    for v, found in axes.items():
        if len(found) == 1 and None not in found and v not in outputs and _only_top_level_uses(v):
            result[v] = found.pop()
    return result


def _only_top_level_uses(v: Value) -> bool:
    """True when no If/Loop body reads ``v`` (this pass rewires top-level readers only)."""
    return all(node.graph is v.graph for node in v.users)


def quantize_weights(graph: Graph) -> list[QuantizedWeight]:
    """Replace the Conv/Gemm/MatMul constant weights of ``graph`` (in place) by int8 + per-channel
    scales behind a DequantizeLinear placed just before the weight's first reader."""
    done = []
    for w, axis in _candidates(graph).items():
        arr = w.const
        q, scale = quantize_per_channel(arr, axis)
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
        err = float(np.max(np.abs(dequantize(q, scale, axis) - arr))) if arr.size else 0.0
        done.append(QuantizedWeight(name, tuple(arr.shape), axis, err, int(arr.nbytes),
                                    int(q.nbytes + scale.nbytes)))
    return done
