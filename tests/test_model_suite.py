"""The public model suite's CI subset (``bench/suite_models.py: CI_SUBSET``), run through the suite's
own code (``bench/model_suite.py: evaluate_case``): each model traces with kiln's check on, and
kiln's CPU runtime and kiln's ONNX export (in onnxruntime, where it is installed) match torch eager
on every input set of the suite (the example, a second batch size / length / padding, another
padding pattern, batch 1) at the suite's scale-aware tolerance. A model kiln cannot handle yet must
be listed in EXPECTED_REFUSALS with the refusal it gives; a listed model that starts passing fails
too, so the list only shrinks. A wrong answer never passes.

Needs torchvision, timm and transformers (the suite's venv, bench/suite-requirements.txt, which is
also CI's newest-torch venv); skips cleanly where any is missing. The full suite and its report:
``bench/model_suite.py`` -> bench/COVERAGE.md.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

for _mod in ("torch", "torchvision", "timm", "transformers"):
    pytest.importorskip(_mod, reason=f"the model suite needs {_mod} (bench/suite-requirements.txt)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import model_suite  # noqa: E402
import suite_models  # noqa: E402

# model -> (regular expression the kiln refusal must match, why / what it waits for).
# Empty: hf/gpt2 was here until kiln.trace bound a dict's inputs by keyword (issue 15).
EXPECTED_REFUSALS: dict[str, tuple[str, str]] = {}

COLUMNS = ("kiln_trace", "kiln_run") + (("kiln_onnx",) if importlib.util.find_spec("onnxruntime") else ())


def test_ci_subset_names_exist():
    names = {c.name for c in suite_models.all_cases()}
    assert set(suite_models.CI_SUBSET) <= names
    assert set(EXPECTED_REFUSALS) <= set(suite_models.CI_SUBSET)


@pytest.mark.parametrize("name", suite_models.CI_SUBSET)
def test_model(name, tmp_path):
    case = suite_models.by_name(name)
    rec = model_suite.evaluate_case(case, COLUMNS, workdir=tmp_path)
    results = {c: rec["columns"][c] for c in COLUMNS}
    wrong = {c: r["error"] for c, r in results.items() if r["status"] == "WRONG"}
    assert not wrong, f"{name}: kiln answers WRONG (silently): {wrong}"
    refused = {c: r["error"] for c, r in results.items() if r["status"] != "ok" and not r.get("skipped")}
    if name in EXPECTED_REFUSALS:
        pattern, why = EXPECTED_REFUSALS[name]
        assert refused, f"{name} now passes every column: remove it from EXPECTED_REFUSALS ({why})"
        msg = " / ".join(refused.values())
        assert re.search(pattern, msg), f"{name}: expected a refusal matching {pattern!r} ({why}), got: {msg}"
        pytest.xfail(f"expected refusal ({why}): {msg[:200]}")
    assert not refused, f"{name}: refused: {refused}"
    assert all(r["status"] == "ok" for r in results.values())
