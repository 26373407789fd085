"""Fold inference BatchNormalization into the Conv or Gemm that feeds it.

In inference BN is a per-channel affine map: ``y = x * s + t`` with
``s = scale / sqrt(var + eps)`` and ``t = B - mean * s``. Scaling the producer's weights by
``s`` along the output channel and adding ``t`` to its bias gives the same result with one
op less. Applies when the BN is in inference mode (``training_mode=0``, only its first output
used), its statistics are initializers, and its input is the only use of the output of a
Conv whose weight (and bias) are initializers, or of a Gemm whose B (and C) are. The folded
weights are new initializers of the original dtype (computed in float64); the original
arrays are not touched (they may be shared).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.ir.graph import Graph, Node
from kiln.ir.passes._rewrite import Editor


def fold_batchnorm(graph: Graph) -> bool:
    """Fold every foldable BatchNormalization in ``graph`` and its subgraphs; returns whether
    one was folded."""
    ed = Editor(graph)
    changed = False
    for g in list(graph.all_graphs()):
        for node in list(g.nodes):
            if node.op == "BatchNormalization" and node.domain == "":
                changed |= _fold(node, ed)
    return changed


def _fold(bn: Node, ed: Editor) -> bool:
    producer = _foldable_producer(bn, ed)
    affine = _affine(bn)
    if producer is None or affine is None:
        return False
    scale, shift = affine
    if producer.op == "Conv":
        done = _fold_into_conv(producer, scale, shift)
    else:
        done = _fold_into_gemm(producer, scale, shift)
    if not done:
        return False
    return ed.replace_node(bn, [producer.outputs[0]] + [None] * (len(bn.outputs) - 1))


def _foldable_producer(bn: Node, ed: Editor) -> Optional[Node]:
    """The Conv/Gemm feeding ``bn`` if its output is read by ``bn`` alone, else None."""
    if bn.attr("training_mode") != 0 or not ed.only_first_output_used(bn):
        return None
    x = bn.inputs[0]
    producer = x.producer
    if producer is None or producer.domain != "" or producer.op not in ("Conv", "Gemm"):
        return None
    if producer.graph is not bn.graph or len(x.uses) != 1 or ed.is_output(x):
        return None
    # Checked now so that the producer is never rewritten for a BN that then cannot go.
    if not ed.can_replace(bn.outputs[0], x):
        return None
    return producer


def _affine(bn: Node) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Per-channel (scale, shift) of the BN in float64, if its statistics are constants."""
    stats = [v.const if v is not None else None for v in bn.inputs[1:5]]
    if len(stats) != 4 or any(s is None for s in stats):
        return None
    gamma, beta, mean, var = (s.astype(np.float64).reshape(-1) for s in stats)
    scale = gamma / np.sqrt(var + bn.attr("epsilon"))
    return scale, beta - mean * scale


def _fold_into_conv(conv: Node, scale: np.ndarray, shift: np.ndarray) -> bool:
    w = conv.inputs[1].const
    bias_value = conv.inputs[2] if len(conv.inputs) > 2 else None
    bias = None if bias_value is None else bias_value.const
    if w is None or (bias_value is not None and bias is None) or w.shape[0] != scale.size:
        return False
    # Output channels are the weight's first axis: [M, C/group, k...]. One pass over the weight
    # in its own precision (at least float32), with the per-channel scale computed in float64.
    compute = np.promote_types(w.dtype, np.float32)
    new_w = w * scale.astype(compute).reshape((-1,) + (1,) * (w.ndim - 1))
    old_b = np.zeros(scale.size) if bias is None else bias.astype(np.float64)
    new_b = old_b * scale + shift
    graph = conv.graph
    w_value = graph.add_constant(new_w.astype(w.dtype), hint=f"{conv.inputs[1].name}_bn")
    b_hint = f"{conv.name}_bias" if bias_value is None else f"{bias_value.name}_bn"
    b_value = graph.add_constant(new_b.astype(w.dtype), hint=b_hint)
    conv.inputs = [conv.inputs[0], w_value, b_value]
    return True


def _fold_into_gemm(gemm: Node, scale: np.ndarray, shift: np.ndarray) -> bool:
    b = gemm.inputs[1].const
    c_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    c = None if c_value is None else c_value.const
    if b is None or b.ndim != 2 or (c_value is not None and c is None):
        return False
    # Y = alpha * A' B' + beta * C with Y [M, N]: channels are N, the columns of B'.
    trans_b = gemm.attr("transB") != 0
    n = b.shape[0] if trans_b else b.shape[1]
    if n != scale.size:
        return False
    col = scale.reshape(-1, 1) if trans_b else scale.reshape(1, -1)
    new_b = b.astype(np.float64) * col
    beta = gemm.attr("beta")
    old_c = np.zeros(n) if c is None else beta * c.astype(np.float64)
    new_c = old_c * scale + shift
    graph = gemm.graph
    b_value = graph.add_constant(new_b.astype(b.dtype), hint=f"{gemm.inputs[1].name}_bn")
    c_hint = f"{gemm.name}_bias" if c_value is None else f"{c_value.name}_bn"
    c_value = graph.add_constant(new_c.astype(b.dtype), hint=c_hint)
    gemm.inputs = [gemm.inputs[0], b_value, c_value]
    gemm.attrs["beta"] = 1.0
    return True

