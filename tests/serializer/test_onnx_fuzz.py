"""Fuzzing the ONNX importer (issue 16, item 5): mutated ModelProtos (serializer/onnx_fuzz.py) import
and round-trip through .kiln, or raise a kiln error; never another exception, never slow, never a large
allocation. A short run here; the long one is ``python -m kiln.serializer.onnx_fuzz`` (docs/NOTES.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnx")

from kiln.serializer import onnx_fuzz  # noqa: E402

CI_SEED, CI_CASES = 4, 2000


def test_seeds_import_and_round_trip(tmp_path):
    folder = onnx_fuzz.prepare_folder(tmp_path)
    for name, model in onnx_fuzz.seed_models().items():
        r = onnx_fuzz.check(model.SerializeToString(), folder)
        assert r.outcome == "imported", (name, r.detail)


def test_mutated_models_give_only_kiln_errors():
    lines = []
    counts = onnx_fuzz.run(CI_CASES, CI_SEED, log=lines.append, memory_every=30)
    failures = [ln for ln in lines if ln.startswith("case ")]
    assert not failures, "\n".join(failures[:5])
    assert sum(counts.values()) == CI_CASES
    # Mutations reach both outcomes: many still import (and round-trip), many are refused.
    assert counts["imported"] > CI_CASES // 10 and counts["refused"] > CI_CASES // 3, counts


def test_cases_are_reproducible():
    seeds = onnx_fuzz.seed_models()
    assert onnx_fuzz.make_case(seeds, 1, 7).data == onnx_fuzz.make_case(seeds, 1, 7).data


def test_the_oracle_reports_a_non_kiln_exception(monkeypatch, tmp_path):
    from kiln.serializer import onnx_import

    def boom(*a, **k):
        raise IndexError("stray")

    monkeypatch.setattr(onnx_import, "import_onnx", boom)
    r = onnx_fuzz.check(onnx_fuzz.seed_models()["mlp"].SerializeToString(), Path(tmp_path))
    assert r.outcome == "crash" and "IndexError" in r.detail
