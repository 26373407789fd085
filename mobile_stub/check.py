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

import numpy as np

from kiln.mobile_stub import opset
from kiln.mobile_stub.runtime import DTYPES


@dataclass(frozen=True)
class Problem:
    """One node whose op, at the dtype it runs in, the mobile runtime has no kernel for."""

    node: str
    op: str  # qualified op ("Conv", "com.example.Foo")
    dtype: str  # the key dtype, as in the manifest ("float32")
    scope: str  # module path from node.meta["scope"], "" when the node has none
    reason: str = ""  # why, where the op set has the op at this dtype but the stub still cannot run the node

    def __str__(self) -> str:
        where = f" at {self.scope}" if self.scope else ""
        known = opset.dtypes_for(self.op)
        why = self.reason or (f"the mobile op set has {self.op} only for {', '.join(sorted(known))}" if known
                              else f"the mobile op set has no {self.op}")
        return f"node '{self.node}' ({self.op}:{self.dtype}){where}: {why}"


# What the op set's Op:dtype key does not say, and the stub's kernels and reader do not take (each refused
# only at load or at run time before; the op suite run on the stub found them):
# - values of a dtype the packed format's reader has no numpy type for (bfloat16: a Cast to it, a Where of it);
STUB_DTYPES = {np.dtype(t).name for t in DTYPES.values()}
# - convolutions and pools over more than two spatial dims (the kernels run 1-D and 2-D).
SPATIAL_2D_OPS = {"Conv", "MaxPool", "AveragePool"}
# - optional outputs past the first (MaxPool's Indices).
OUTPUT_0_ONLY_OPS = {"MaxPool"}


def check_graph(graph) -> list[Problem]:
    """Problems of an already prepared (static, optimized) graph, in node order; nested graphs
    (If/Loop bodies) included, since the stub would have to run them too."""
    problems = []
    for node in graph.walk():
        key = opset.node_key(node)
        op, _, dtype = key.rpartition(":")
        scope = node.meta.get("scope", "")
        if not opset.supports(key):
            problems.append(Problem(node.name, op, dtype, scope))
            continue
        odd = [str(v.type.dtype) for v in (*node.inputs, *node.outputs)
               if v is not None and v.type is not None and str(v.type.dtype) not in STUB_DTYPES]
        if odd:
            problems.append(Problem(node.name, op, odd[0], scope,
                                    f"the mobile runtime holds no {odd[0]} values"))
        elif op in SPATIAL_2D_OPS and node.inputs[0].type is not None and node.inputs[0].type.shape is not None \
                and len(node.inputs[0].type.shape) > 4:
            problems.append(Problem(node.name, op, dtype, scope,
                                    f"the mobile {op} kernel runs 1-D and 2-D {op.lower()}s, not "
                                    f"{len(node.inputs[0].type.shape) - 2}-D"))
        elif op in OUTPUT_0_ONLY_OPS and len(node.outputs) > 1:
            problems.append(Problem(node.name, op, dtype, scope, f"the mobile {op} kernel writes its first output "
                                    f"only, not {', '.join(v.name for v in node.outputs[1:])}"))
        elif op == "BatchNormalization" and node.attrs.get("training_mode", 0):
            problems.append(Problem(node.name, op, dtype, scope, "the mobile BatchNormalization kernel runs "
                                    "inference mode only (training_mode=0)"))
        elif op == "DequantizeLinear" and node.attrs.get("block_size", 0):
            problems.append(Problem(node.name, op, dtype, scope, "the mobile DequantizeLinear kernel takes "
                                    "per-tensor and per-axis scales, not blocked ones (block_size)"))
    return problems


def check(path: str, dims: Optional[Mapping[str, int]] = None) -> list[Problem]:
    """Load ``path``, prepare it as ``kiln mobile pack`` would (``dims`` fixes symbolic dims; batch
    defaults to 1) and return every op/dtype the mobile op set lacks. Empty means the model can run."""
    from kiln.mobile_stub.pack import prepare_graph
    from kiln.serializer import load_graph

    graph = load_graph(path)
    return check_graph(prepare_graph(graph, dims))
