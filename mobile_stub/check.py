"""``kiln mobile check``: every op/dtype a model would need on the device that the mobile op set lacks.

The complaint this answers is ExecuTorch's most common one: a model exports fine and then fails on the
phone with a missing operator. So the check looks at the graph the device would really run, not the one
in the file: the model is specialized to static shapes and optimized exactly as ``kiln mobile pack``
does it (shape arithmetic folds away, BatchNorm folds into Conv, ...), and only then is each node's
``Op:dtype`` looked up in the declared op set (mobile_stub/opset.py, the union of the stub kernels'
SUPPORTS tables). A missing entry is reported with the node's name and its module path (``node.meta
["scope"]``, e.g. ``features.3.block.0``), which is what a user needs to find it in the PyTorch source.

A file that is already packed is checked as it is (its manifest was computed from the same graph).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from kiln.mobile_stub import opset


@dataclass(frozen=True)
class Problem:
    """One node whose op, at the dtype it runs in, the mobile runtime has no kernel for."""

    node: str
    op: str  # qualified op ("Conv", "com.example.Foo")
    dtype: str  # the key dtype, as in the manifest ("float32")
    scope: str  # module path from node.meta["scope"], "" when the node has none

    def __str__(self) -> str:
        where = f" at {self.scope}" if self.scope else ""
        known = opset.dtypes_for(self.op)
        why = (f"the mobile op set has {self.op} only for {', '.join(sorted(known))}" if known
               else f"the mobile op set has no {self.op}")
        return f"node '{self.node}' ({self.op}:{self.dtype}){where}: {why}"


def check_graph(graph) -> list[Problem]:
    """Problems of an already prepared (static, optimized) graph, in node order; nested graphs
    (If/Loop bodies) included, since the stub would have to run them too."""
    problems = []
    for node in graph.walk():
        key = opset.node_key(node)
        if not opset.supports(key):
            op, _, dtype = key.rpartition(":")
            problems.append(Problem(node.name, op, dtype, node.meta.get("scope", "")))
    return problems


def check(path: str, dims: Optional[Mapping[str, int]] = None) -> list[Problem]:
    """Load ``path``, prepare it as ``kiln mobile pack`` would (``dims`` fixes symbolic dims; batch
    defaults to 1) and return every op/dtype the mobile op set lacks. Empty means the model can run."""
    from kiln.mobile_stub.pack import prepare_graph
    from kiln.serializer import load_graph

    graph = load_graph(path)
    return check_graph(prepare_graph(graph, dims))
