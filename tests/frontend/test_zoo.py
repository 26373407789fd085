"""Acceptance: every model of the zoo (tests/zoo.py) traces with no TraceWarning (but size
comparisons a library makes on dynamic dims, which are guarded), verifies, and
matches torch eager on fresh random inputs (fp32, 1e-5) through kiln's reference evaluator: at
the example sizes, and with the dynamic spec at two other batch sizes / sequence lengths.
After optimize, the CNNs hold no BatchNormalization, Identity or Dropout; save + load gives
the same outputs. (The data-dependent branch trap is in test_tracer_core.py.)"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
import zoo  # noqa: E402
from kiln import TraceWarning  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402
from kiln.ir import evaluate, verify  # noqa: E402

RTOL = ATOL = 1e-5


ALL = zoo.params()
CNNS = zoo.params([e for e in zoo.ZOO if e.cnn])


@functools.lru_cache(maxsize=None)
def traced(name: str, dynamic: bool) -> tuple[Any, Any, dict, kiln.Graph]:
    """The model, its example inputs, its dynamic spec and its graph (traced once per session,
    with check and optimize on, and any TraceWarning turned into an error)."""
    model, inputs, spec = zoo.by_name(name).factory()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        graph = kiln.trace(model, inputs, dynamic=spec if dynamic else None)
    # A library comparing a symbolic size in Python (transformers' `q_length > 1`) is specialized
    # and guarded, as torch.export specializes sizes 0 and 1; every other read of tensor data is
    # an error here.
    reads = [str(w.message) for w in caught if issubclass(w.category, TraceWarning)
             and not (dynamic and "a symbolic size compared" in str(w.message))]
    assert not reads, reads
    return model, inputs, spec, graph


def _eager(model, names: list[str], tensors: list) -> list[tuple[str, np.ndarray]]:
    with torch.no_grad():
        out = model(**dict(zip(names, tensors)))
    return _flatten(out, "" if isinstance(out, dict) else "output")


def _flatten(out: Any, prefix: str) -> list[tuple[str, np.ndarray]]:
    if isinstance(out, torch.Tensor):
        return [(prefix, to_numpy(out))]
    if isinstance(out, dict):
        return [item for k, v in out.items() for item in _flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    return [item for i, v in enumerate(out) for item in _flatten(v, f"{prefix}_{i}")]


def assert_matches(graph: kiln.Graph, model, names: list[str], tensors: list, label: str) -> None:
    want = _eager(model, names, tensors)
    got = evaluate(graph, {n: to_numpy(t) for n, t in zip(names, tensors)})
    assert [v.name for v in graph.outputs] == [n for n, _ in want], label
    for (name, w), g in zip(want, got):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{label}: output {name}: {g.dtype}{g.shape}, torch {w.dtype}{w.shape}"
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{label}: output {name}")


@pytest.mark.parametrize("entry", ALL)
def test_static_trace_matches_eager(entry):
    model, inputs, _, graph = traced(entry.name, dynamic=False)
    verify(graph)
    names, examples = zoo.input_list(model, inputs)
    assert all(isinstance(d, int) for v in graph.inputs for d in v.type.shape)
    assert_matches(graph, model, *zoo.fresh_inputs(model, inputs, {}, {}, seed=1), label="fresh inputs")
    assert_matches(graph, model, names, examples, label="example inputs")


@pytest.mark.parametrize("entry", ALL)
def test_dynamic_trace_runs_at_other_sizes(entry):
    model, inputs, spec, graph = traced(entry.name, dynamic=True)
    verify(graph)
    assert "Dropout" not in {n.op for n in graph.nodes}  # traced in inference mode
    names, examples = zoo.input_list(model, inputs)
    for v, ex in zip(graph.inputs, examples):
        want = [spec.get(v.name, {}).get(i, s) for i, s in enumerate(ex.shape)]
        assert list(v.type.shape) == want, f"input {v.name}: {v.type.shape}, expected {want}"
    example_sizes = {sym: examples[names.index(n)].shape[d] for n, dims in spec.items() for d, sym in dims.items()}
    for k, sizes in enumerate([example_sizes, *entry.other_sizes]):
        fresh = zoo.fresh_inputs(model, inputs, spec, sizes, seed=10 + k)
        assert_matches(graph, model, *fresh, label=f"sizes {dict(sizes)}")


@pytest.mark.parametrize("entry", CNNS)
def test_optimized_cnn_has_no_batchnorm_identity_or_dropout(entry):
    for dynamic in (False, True):
        graph = traced(entry.name, dynamic)[3]
        left = sorted({n.op for n in graph.nodes} & {"BatchNormalization", "Identity", "Dropout"})
        assert not left, f"dynamic={dynamic}: {left} left after optimize"
        assert "Conv" in {n.op for n in graph.nodes}


@pytest.mark.parametrize("entry", ALL)
def test_save_load_round_trip(entry, tmp_path):
    model, inputs, spec, graph = traced(entry.name, dynamic=True)
    path = kiln.save(graph, tmp_path / f"{entry.name}.kiln")
    loaded = kiln.load_graph(path)
    verify(loaded)
    assert [v.name for v in loaded.inputs] == [v.name for v in graph.inputs]
    assert [v.name for v in loaded.outputs] == [v.name for v in graph.outputs]
    names, tensors = zoo.fresh_inputs(model, inputs, spec, entry.other_sizes[-1], seed=3)
    feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
    for a, b in zip(evaluate(graph, feeds), evaluate(loaded, feeds)):
        np.testing.assert_array_equal(a, b)


def test_optimized_gpt_stores_each_weight_once_under_its_module_path():
    model, _, _, graph = traced("gpt", dynamic=True)
    weights = {n: p.numel() for n, p in model.named_parameters() if p.dim() == 2}  # tied: listed once
    stored = {n: v.const.size for n, v in graph.initializers.items() if v.const.ndim == 2}
    assert stored == weights
