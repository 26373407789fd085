"""Shared pattern of the frontend tests: trace a tiny torch function, then compare the graph
(run by kiln's reference evaluator) with torch eager, on the example inputs and on others.

    from frontend_helpers import check_traced
    check_traced(lambda x: x.softmax(-1), (torch.randn(2, 5),), dynamic_batch=True,
                 other_inputs=[(torch.randn(4, 5),)])
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

import kiln
from kiln.frontend.tracer import to_numpy
from kiln.ir import evaluate, verify
from kiln.ir.graph import Graph


def _as_tuple(inputs: Any) -> tuple:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    return [t for v in out for t in _flat(v)]


def compare(graph: Graph, fn: Callable, inputs: Sequence[torch.Tensor], *, rtol: float = 1e-5,
            atol: float = 1e-6, label: str = "") -> None:
    """Evaluate ``graph`` on ``inputs`` and assert it matches ``fn(*inputs)`` (values, shapes, dtypes)."""
    with torch.no_grad():
        want = [to_numpy(t) for t in _flat(fn(*[x.clone() for x in inputs]))]
    got = evaluate(graph, [to_numpy(x) for x in inputs])
    assert len(got) == len(want), f"{label}: {len(got)} outputs, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        assert g.shape == w.shape, f"{label} output {i}: shape {g.shape}, torch gives {w.shape}"
        assert g.dtype == w.dtype, f"{label} output {i}: dtype {g.dtype}, torch gives {w.dtype}"
        if w.dtype == np.bool_ or np.issubdtype(w.dtype, np.integer):
            np.testing.assert_array_equal(g, w, err_msg=f"{label} output {i}")
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=f"{label} output {i}")


def check_traced(fn: Callable, inputs: Any, *, dynamic_batch: bool = False, dynamic: Optional[dict] = None,
                 other_inputs: Iterable[Any] = (), rtol: float = 1e-5, atol: float = 1e-6) -> Graph:
    """Trace ``fn`` on ``inputs`` (check=False, optimize=False), verify the graph, and compare it with
    torch eager on ``inputs`` and on each entry of ``other_inputs`` (e.g. other batch sizes).

    The inputs are cloned before each eager call so in-place ops in ``fn`` do not disturb them.
    Returns the graph for further assertions (e.g. on its input shapes or ops).
    """
    inputs = _as_tuple(inputs)
    graph = kiln.trace(fn, tuple(x.clone() for x in inputs), dynamic_batch=dynamic_batch, dynamic=dynamic,
                       check=False, optimize=False)
    verify(graph)
    compare(graph, fn, inputs, rtol=rtol, atol=atol, label="example inputs")
    for k, other in enumerate(other_inputs):
        compare(graph, fn, _as_tuple(other), rtol=rtol, atol=atol, label=f"other inputs #{k + 1}")
    return graph


def op_types(graph: Graph) -> list[str]:
    """The op types of the graph's nodes, in order (for asserting which IR ops a mapping emits)."""
    return [n.op for n in graph.nodes]
