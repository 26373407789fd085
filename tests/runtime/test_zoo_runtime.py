"""Acceptance (issue 5): every model of the tracer's zoo (tests/zoo.py), exported to a .kiln file
and loaded with ``kiln.load(path)``, runs in the CPU runtime and matches torch eager to 1e-4
relative on fresh random inputs: at the example sizes and, through the dynamic spec, at two
other batch sizes / sequence lengths. The caller's input arrays are left untouched."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
import zoo  # noqa: E402
from kiln.frontend.tracer import to_numpy  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


@functools.lru_cache(maxsize=None)
def exported(name: str, folder: str) -> tuple[Any, Any, dict, kiln.Program]:
    model, inputs, spec = zoo.by_name(name).factory()
    graph = kiln.trace(model, inputs, dynamic=spec)
    path = kiln.save(graph, f"{folder}/{name}.kiln")
    return model, inputs, spec, kiln.load(path)


def _flatten(out: Any) -> list[np.ndarray]:
    if isinstance(out, torch.Tensor):
        return [to_numpy(out)]
    if isinstance(out, dict):
        return [a for v in out.values() for a in _flatten(v)]
    return [a for v in out for a in _flatten(v)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zoo_runtime"))


@pytest.mark.parametrize("entry", zoo.params())
def test_runtime_matches_torch_eager(entry, folder):
    model, inputs, spec, program = exported(entry.name, folder)
    names, examples = zoo.input_list(model, inputs)
    example_sizes = {sym: examples[names.index(n)].shape[d] for n, dims in spec.items() for d, sym in dims.items()}
    assert [s.name for s in program.inputs] == names
    for k, sizes in enumerate([example_sizes, *entry.other_sizes]):
        names, tensors = zoo.fresh_inputs(model, inputs, spec, sizes, seed=20 + k)
        feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
        before = {n: a.copy() for n, a in feeds.items()}
        with torch.no_grad():
            want = _flatten(model(**dict(zip(names, tensors))))
        got = program.run(feeds, as_list=True)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            label = f"{entry.name} at {dict(sizes)}: output {program.outputs[i].name}"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), label
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=label)
        for n, a in feeds.items():
            np.testing.assert_array_equal(a, before[n], err_msg=f"input {n} was modified by the run")
