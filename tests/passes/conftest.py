"""What every pass test checks, as a fixture: ``check_pass(fn, graph, feeds)`` runs the pass and
asserts that it reports the change, leaves a valid graph with the same signature that computes
the same outputs, and is idempotent (a second run returns False)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from kiln.ir import Graph, evaluate, verify
from kiln.ir.passes import infer_shapes


def assert_same_outputs(before: Graph, after: Graph, feeds: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    want = evaluate(before, feeds)
    got = evaluate(after, feeds)
    assert len(want) == len(got)
    for w, o in zip(want, got):
        assert o.dtype == w.dtype and o.shape == w.shape
        np.testing.assert_allclose(o, w, rtol=rtol, atol=atol)


def _check_pass(fn: Callable[[Graph], bool], graph: Graph, feeds: dict, *, changes: bool = True,
                rtol: float = 1e-5, atol: float = 1e-6) -> Graph:
    """Run ``fn`` on ``graph`` (in place); return the copy taken before it ran."""
    infer_shapes(graph)
    verify(graph)
    before = graph.copy()
    text = str(graph)
    assert fn(graph) is changes
    if not changes:
        assert str(graph) == text, "the pass said it changed nothing, but the graph differs"
    verify(graph)
    assert [(v.name, v.type) for v in graph.inputs] == [(v.name, v.type) for v in before.inputs]
    assert [v.name for v in graph.outputs] == [v.name for v in before.outputs]
    assert_same_outputs(before, graph, feeds, rtol, atol)
    after = str(graph)
    assert fn(graph) is False, "a second run changed the graph again"
    assert str(graph) == after
    return before


@pytest.fixture
def check_pass() -> Callable:
    return _check_pass


@pytest.fixture
def same_outputs() -> Callable:
    return assert_same_outputs
