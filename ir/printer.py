"""Readable, stable text for graphs: one node a line, for humans and golden tests.

    graph main(%x: float32[batch,4]) opset=1 {
      init %fc.weight: float32[8,4]
      %gemm: float32[batch,8] = Gemm(%x, %fc.weight, %fc.bias) {transB=1}  # fc
      return %relu
    }
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.ir.graph import Graph, Node, Value


def format_graph(graph: Graph, indent: str = "") -> str:
    lines: list[str] = []
    _graph_lines(graph, indent, lines)
    return "\n".join(lines)


def _graph_lines(graph: Graph, indent: str, lines: list[str]) -> None:
    ins = ", ".join(_decl(v) for v in graph.inputs)
    header = f"{indent}graph {graph.name}({ins})"
    if graph.parent is None:
        header += f" opset={graph.opset_version}"
    lines.append(header + " {")
    inner = indent + "  "
    for v in graph.initializers.values():
        lines.append(f"{inner}init {_decl(v)}")
    for node in graph.nodes:
        lines.append(inner + format_node(node))
        for key, sub in sorted((k, a) for k, a in node.attrs.items() if isinstance(a, Graph)):
            lines.append(f"{inner}  {key}:")
            _graph_lines(sub, inner + "    ", lines)
    lines.append(f"{inner}return " + ", ".join(_ref(v) for v in graph.outputs))
    lines.append(indent + "}")


def format_node(node: Node) -> str:
    outs = ", ".join(_decl(v) for v in node.outputs)
    args = ", ".join("_" if v is None else _ref(v) for v in node.inputs)
    attrs = {k: a for k, a in sorted(node.attrs.items()) if not isinstance(a, Graph)}
    text = f"{outs} = {node.qualified_op}({args})"
    if attrs:
        text += " {" + ", ".join(f"{k}={format_attr(a)}" for k, a in attrs.items()) + "}"
    if node.meta.get("scope"):
        text += f"  # {node.meta['scope']}"
    return text


def format_attr(a: Any) -> str:
    if isinstance(a, tuple):
        return "[" + ", ".join(format_attr(x) for x in a) + "]"
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, str):
        return '"' + a.replace('"', '\\"') + '"'
    if isinstance(a, np.ndarray):
        head = f"tensor<{a.dtype}{list(a.shape)}>"
        return head + (f"({a.reshape(-1).tolist()})" if a.size <= 8 else "")
    return str(a)


def _ref(v: Value) -> str:
    return f"%{v.name}"


def _decl(v: Value) -> str:
    return f"%{v.name}: {v.type}" if v.type is not None else f"%{v.name}"
